"""``mstar check NAME``: the conformance suite against an installed backend (see
:mod:`mstar_core.testing.check`); a table of cases, exit 1 on any failure."""

from __future__ import annotations

import argparse
import json
import sys

from mstar_core.cli.options import add_config, config_from, parse_device
from mstar_core.errors import InputError
from mstar_core.resource import as_dtype


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="run the conformance suite against an installed backend",
        description="Run the conformance suite against the installed backend NAME: every capability it provides, "
        "in each dtype and head dim it declares (64 and 128 where it runs them), with the features it declares, "
        "plus one wrapper re-planned with different shapes (replayed from a CUDA graph where capturable), rows "
        "poisoned with NaN/inf and rows that see no key, each against a float64 oracle. Prints a table of cases; "
        "exits 1 when any case fails, 2 when the backend cannot run here.",
    )
    p.add_argument("name", help="backend name, as `mstar backends` lists it")
    p.add_argument("--device", default=None, help="torch device (default: cuda when usable and the backend runs "
                   "there, else cpu)")
    p.add_argument("--dtype", action="append", default=None, metavar="DTYPE",
                   help="check only this dtype (repeat for several; default: every dtype the backend declares)")
    p.add_argument("--head-dim", action="append", type=int, default=None, metavar="N",
                   help="check only this head dim (repeat for several; default: 64 and 128 where declared)")
    p.add_argument("--failures-only", action="store_true", help="list only the failing cases in the table")
    add_config(p, pins_only=True)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mstar_core.testing.check import check_backend

    device = str(parse_device(args.device, "check")) if args.device is not None else None
    dtypes = [as_dtype(d) for d in args.dtype] if args.dtype else None
    for d in args.head_dim or ():
        if d < 1:
            raise InputError(f"check: --head-dim {d} must be >= 1")

    def progress(result) -> None:  # a long run (a GPU compiling kernels) shows it is moving
        if not args.json and not result.passed:
            print(f"FAIL {result.capability} {result.dtype} {result.group} {result.name}", file=sys.stderr, flush=True)

    report = check_backend(args.name, device, dtypes, args.head_dim, on_result=progress, config=config_from(args))
    print(json.dumps(report.as_json(), indent=2) if args.json else report.render(all_rows=not args.failures_only))
    return 0 if report.ok else 1
