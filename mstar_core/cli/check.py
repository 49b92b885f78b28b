"""``mstar check NAME``: the conformance suite against an installed backend (see
:mod:`mstar_core.testing.check`); a table of cases, exit 1 on any failure."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from mstar_core.cli.options import add_config, config_from, parse_device
from mstar_core.cli.progress import CLEAR
from mstar_core.errors import InputError
from mstar_core.registry.spec import dtype_name
from mstar_core.resource import as_dtype
from mstar_core.testing.groups import GROUPS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="run the conformance suite against an installed backend",
        description="Run the conformance suite against the installed backend NAME: every capability it provides, "
        "in each dtype and head dim it declares (every listed one; from a range, 64, 128, 256 and its largest), with "
        "the features it declares, plus scores in the hundreds and far below zero, long rows (32k keys), shapes past "
        "the usual tiles (64 rows, 64 query heads), one wrapper re-planned with different shapes "
        "and refusing a plan, several wrappers with different windows and scales run in turn, a CUDA-graph replay "
        "where capturable, rows poisoned with NaN/inf, NaN in what a row does not own, and rows that see no key, "
        "each against a float64 oracle; every case run twice (bit-identical), on strided inputs too, its inputs "
        "compared before and after. Prints the case count, a progress line, then a table of cases, each failure "
        "naming its rule, and what the run left out (not covered); exits 1 when any case fails, 2 when the backend "
        "cannot run here.",
    )
    p.add_argument("name", help="backend name, as `mstar backends` lists it; 'auto' (or any name with "
                   "--layer-windows/--sink-logits): each layer group's paged picks, checked at the group's features")
    p.add_argument("--device", default=None, help="torch device (default: cuda when usable and the backend runs "
                   "there, else cpu)")
    p.add_argument("--dtype", action="append", default=None, metavar="DTYPE",
                   help="check only this dtype (repeat for several; default: every dtype the backend declares)")
    p.add_argument("--head-dim", action="append", type=int, default=None, metavar="N",
                   help="check only this head dim (repeat for several; default: every listed one, from a range 64, "
                   "128, 256 and its largest)")
    p.add_argument("--quick", action="store_true", help="a short subset: the first head dim only, fewer plain and "
                   "feature cases, long rows of 8192 keys (every group and rule still checked)")
    p.add_argument("--group", action="append", default=None, metavar="GROUP",
                   help="run only this group of cases (repeat for several): " + ", ".join(GROUPS))
    p.add_argument("--failures-only", action="store_true", help="list only the failing cases in the table")
    g = p.add_argument_group("layer groups", "check the paged picks of each layer group of a model that asks these")
    g.add_argument("--layer-windows", default=None, metavar="W,W,...",
                   help="window_left per layer, comma-separated (-1: a full layer); write --layer-windows=-1,4096 "
                        "when the list starts with -1")
    g.add_argument("--sink-logits", nargs="?", const=True, default=False, metavar="B,B,...",
                   help="sink logits on every layer, or one 1/0 per layer (comma-separated)")
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

    if "OMP_NUM_THREADS" not in os.environ:  # the cases' tensors are small: a second thread only waits
        import torch

        torch.set_num_threads(1)
    err = sys.stderr
    tty = bool(getattr(err, "isatty", lambda: False)())
    state = {"n": 0, "total": 0, "shown": time.perf_counter()}

    def start(checks) -> None:  # the case count, before anything runs
        state["total"] = len(checks)
        caps = sorted({c.capability for c in checks})
        dtypes = sorted({dtype_name(c.dtype) for c in checks})
        print(f"mstar check {args.name}: {len(checks)} cases ({', '.join(caps)}; {', '.join(dtypes)}"
              f"{'; quick subset' if args.quick else ''})", file=err, flush=True)

    def progress(result) -> None:  # a long run (a GPU compiling kernels) shows it is moving
        state["n"] += 1
        n, total = state["n"], state["total"]
        case = f"{result.capability} {result.dtype} {result.group} {result.name}"
        if not result.passed:
            print(f"{CLEAR if tty else ''}FAIL {case} [{result.rule}]", file=err, flush=True)
        if tty:  # one line, rewritten in place, cleared at the end
            print(CLEAR + f"[{n}/{total}] {case}"[:150] if n < total else CLEAR, end="", file=err, flush=True)
        elif time.perf_counter() - state["shown"] >= 10.0:  # a log: a line every 10 s
            state["shown"] = time.perf_counter()
            print(f"[{n}/{total}] {case}", file=err, flush=True)

    if args.name == "auto" or args.layer_windows is not None or args.sink_logits is not False:
        if args.group:
            raise InputError("check: --group selects cases of one named backend; drop it for 'auto', "
                             "--layer-windows or --sink-logits")
        from mstar_core.cli.backends import features_from_args
        from mstar_core.testing.group_check import check_groups

        report: Any = check_groups(args.name, features_from_args(args), device, dtypes, args.head_dim,
                                   config=config_from(args), quick=args.quick, on_result=progress, on_start=start)
    else:
        report = check_backend(args.name, device, dtypes, args.head_dim, on_result=progress,
                               config=config_from(args), quick=args.quick, on_start=start, groups=args.group)
    print(json.dumps(report.as_json(), indent=2) if args.json else report.render(all_rows=not args.failures_only))
    return 0 if report.ok else 1
