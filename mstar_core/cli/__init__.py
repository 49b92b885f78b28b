"""The ``mstar`` command: ``demo``, ``generate``, ``backends``, ``check``, ``new-backend``,
``bench``, ``warmup``; each sub-command lives in its own module exposing ``register(subparsers)``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from mstar_core import first_use
from mstar_core.cli import backends, bench, check, demo, generate, new_backend, warmup
from mstar_core.cli.progress import Progress
from mstar_core.errors import MstarError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mstar", description="Attention backends for an inference engine.")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log selection and steps, and print an error's traceback (-vv: debug)")
    sub = p.add_subparsers(dest="command", required=True)
    demo.register(sub)
    generate.register(sub)
    backends.register(sub)
    check.register(sub)
    new_backend.register(sub)
    bench.register(sub)
    warmup.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # A kernel library compiling on first use (FlashInfer: 20-120 s) shows as a counting line on
    # stderr, not as a hang.
    progress = Progress()
    first_use.add_listener(progress)
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away is met here, inside the try, not at exit
        return rc
    except BrokenPipeError:
        # stdout's reader closed it early (`mstar backends | head`): nothing more can be said
        # there, so exit quietly. Later writes (the interpreter flushes stdout at exit) go to
        # devnull instead of raising again.
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # a stdout with no descriptor (main() embedded)
            return 1
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        return 1
    except MstarError as e:
        # mstar's own errors (bad input, an unknown backend, a plugin failing in strict mode) are
        # the user's to fix: one line, with the notes that say where it came from (the backend
        # and wrapper of a kernel's exception); -v adds the traceback.
        if args.verbose:
            traceback.print_exception(e, file=sys.stderr)
        notes = "".join(f"\n  {n}" for n in getattr(e, "__notes__", ()))
        hint = "" if args.verbose else " (mstar -v ... prints the traceback)"
        print(f"mstar {args.command}: error: {e}{notes}{hint if notes else ''}", file=sys.stderr)
        return 2
    except Exception as e:
        # Anything else is a bug in mstar or in a backend: the whole traceback, and say so.
        traceback.print_exception(e, file=sys.stderr)
        print(f"mstar {args.command}: internal error ({type(e).__name__}): this is a bug in mstar or in a backend "
              "plugin, not in your input; please report it with the traceback above", file=sys.stderr)
        return 1
    finally:
        first_use.remove_listener(progress)
