"""``mstar new-backend NAME DIR``: write a working plugin distribution skeleton (see
:mod:`mstar_core.scaffold`)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "new-backend",
        help="write a plugin distribution skeleton that passes `mstar check` as generated",
        description="Write a plugin distribution for a new attention backend NAME into DIR: pyproject.toml with "
        "the mstar.backends entry point, the BackendSpec, a probe, a plain-PyTorch prefixed_ragged wrapper and a "
        "test that runs the conformance suite. Install it (pip install -e DIR) and `mstar check NAME` passes; "
        "then replace the wrapper's body with your kernel. DIR must not exist or be empty.",
    )
    p.add_argument("name", help="backend name: lowercase letters, digits, underscores (e.g. mykernel)")
    p.add_argument("dir", help="directory to create")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mstar_core.scaffold import write_skeleton

    files = write_skeleton(args.name, args.dir)
    print(f"wrote the {args.name} plugin distribution to {args.dir}:")
    for f in files:
        print(f"  {f}")
    print(f"next: pip install -e {args.dir} && mstar check {args.name}")
    return 0
