"""``mstar new-backend NAME DIR [--capability CAP ...]``: write a working plugin distribution
skeleton (see :mod:`mstar_core.scaffold`)."""

from __future__ import annotations

import argparse

from mstar_core.scaffold import CAPABILITY_CHOICES, DEFAULT_CAPABILITIES, check_capabilities, write_skeleton


def register(sub: argparse._SubParsersAction) -> None:
    default = ", ".join(DEFAULT_CAPABILITIES)
    p = sub.add_parser(
        "new-backend",
        help=f"write a plugin distribution skeleton (a plain-PyTorch {default} wrapper unless --capability names "
        "others) that passes `mstar check` as generated",
        description=f"Write a plugin distribution for a new attention backend NAME into DIR. By default it provides "
        f"{default} alone (the dense path's wrapper); --capability CAP, repeated, writes a wrapper for each "
        f"capability named instead (of {', '.join(CAPABILITY_CHOICES)}). It holds pyproject.toml with the "
        "mstar.backends entry point, the BackendSpec (the current plugin API version, providing exactly those "
        "capabilities), a probe, a plain-PyTorch wrapper module per capability and a test that runs the "
        "conformance suite. Install it (pip install -e DIR) and `mstar check NAME` passes; then replace each "
        "wrapper's run loop with your kernel. DIR must not exist or be empty.",
    )
    p.add_argument("name", help="backend name: lowercase letters, digits, underscores (e.g. mykernel)")
    p.add_argument("dir", help="directory to create")
    p.add_argument("--capability", action="append", dest="capabilities", choices=CAPABILITY_CHOICES, default=None,
                   metavar="CAP", help=f"write a wrapper for this capability (repeat for several): "
                   f"{', '.join(CAPABILITY_CHOICES)}; default: {default}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    files = write_skeleton(args.name, args.dir, args.capabilities)
    provided = ", ".join(check_capabilities(args.capabilities))
    print(f"wrote the {args.name} plugin distribution ({provided}) to {args.dir}:")
    for f in files:
        print(f"  {f}")
    print(f"next: pip install -e {args.dir} && mstar check {args.name}")
    return 0
