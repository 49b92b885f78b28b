"""Compiled decode steps: a model's forward under ``torch.compile``, once per graph bucket.

The runner compiles the tensor part of a forward (:class:`CompiledForward`): ``inputs(ctx,
tokens)`` reads what the step's plans hold, on the host, every step; ``body(*inputs)`` is the
model over tensors alone, and mstar's per-layer calls inside it are custom ops
(:mod:`mstar_core.ops`) that find the bound step's plan when they run. So the compiled graph has
no Python state of a step in it and one graph serves every step of a bucket (``dynamic=False``:
each bucket is its own static graph, as its CUDA graph is).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.errors import CompileError, InputError, InputTypeError
from mstar_core.first_use import first_use
from mstar_core.step import StepContext

log = logging.getLogger(__name__)

BACKENDS = ("inductor", "aot_eager", "eager")  # what CI and the docs exercise; torch knows more


@dataclass(frozen=True)
class CompileOptions:
    """How a step's forward is compiled. ``required`` False: a model that cannot be compiled runs
    uncompiled, with a warning that names the reason; True: that is an error."""

    backend: str = "inductor"
    mode: str | None = None  # torch.compile's mode (None: its default)
    required: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise InputTypeError(f"CompileOptions: backend must be a torch.compile backend name such as "
                                 f"{', '.join(BACKENDS)}; got {self.backend!r}")
        if self.backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise InputError(f"CompileOptions: torch.compile has no backend {self.backend!r}; it has "
                             f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))}")
        if self.mode is not None and not isinstance(self.mode, str):
            raise InputTypeError(f"CompileOptions: mode must be a str or None, got {self.mode!r}")
        if not isinstance(self.required, bool):
            raise InputTypeError(f"CompileOptions: required must be a bool, got {self.required!r}")


def compile_options(compile: bool | None, backend: str = "inductor", who: str = "mstar") -> CompileOptions | None:
    """``compile`` as the engine and the CLI take it: True (compile, or fail), None (compile where the
    model allows, else warn and run uncompiled), False (no compile)."""
    if compile is not None and not isinstance(compile, bool):
        raise InputTypeError(f"{who}: compile must be True, False or None (where the model allows), got {compile!r}")
    if compile is False:
        return None
    return CompileOptions(backend=backend, required=compile is True)


@dataclass(frozen=True)
class CompiledForward:
    """The part of a forward the runner compiles (module docstring)."""

    inputs: Callable[[StepContext, torch.Tensor], tuple[torch.Tensor, ...]]
    body: Callable[..., torch.Tensor]
    options: CompileOptions = field(default_factory=CompileOptions)
    name: str = "the model"  # what the log lines call it

    def __call__(self, ctx: StepContext, tokens: torch.Tensor) -> torch.Tensor:
        """The forward uncompiled: ``body(*inputs(ctx, tokens))``."""
        return self.body(*self.inputs(ctx, tokens))


def make_room(graphs: int) -> None:
    """Dynamo keeps at most ``recompile_limit`` graphs per function (8 by default) and falls back to
    running it uncompiled past that: a runner compiles one per bucket, for each model it serves."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        have = getattr(cfg, name, None)
        if have is not None and have < graphs:
            raised = max(graphs, 2 * have)  # doubled: said a few times in a process, not at every bucket
            log.info("torch._dynamo.config.%s raised from %d to %d (one compiled graph per bucket)", name, have,
                     raised)
            setattr(cfg, name, raised)


class StepCompiler:
    """One runner's compiled body: compiled on its first call per bucket (announced like a
    kernel library's JIT, timed), then called for every graph step of that bucket."""

    _graphs = 0  # compiled graphs this process asked Dynamo to keep (make_room)

    def __init__(self, forward: CompiledForward) -> None:
        o = forward.options
        self.forward = forward
        self._fn: Any = torch.compile(forward.body, fullgraph=True, dynamic=False, backend=o.backend, mode=o.mode)
        self.seconds: dict[int, float] = {}  # bucket -> seconds its compile took
        self.failed: dict[int, str] = {}  # bucket -> why it runs uncompiled

    def __call__(self, ctx: StepContext, tokens: torch.Tensor) -> torch.Tensor:
        if ctx.bucket is not None and ctx.bucket in self.failed:
            return self.forward(ctx, tokens)
        return self._fn(*self.forward.inputs(ctx, tokens))

    def compile(self, bucket: int, run: Callable[[], None]) -> None:
        """Compile for ``bucket`` by running its step once (``run``: the forward of a planned
        dummy step). A failure is a :class:`CompileError` where compiling was required; else the
        bucket runs uncompiled, with a warning naming the reason."""
        if self.failed:  # the model could not be compiled for an earlier bucket: not tried again
            self.failed[bucket] = next(iter(self.failed.values()))
            return
        StepCompiler._graphs += 1
        make_room(StepCompiler._graphs + 8)
        o = self.forward.options
        what = f"torch.compile ({o.backend}) of {self.forward.name}'s decode step for {bucket} rows"
        t0 = time.perf_counter()
        try:
            with first_use(("torch.compile", id(self), bucket), what,
                           "tracing and code generation take seconds to a minute per bucket; torch's compile caches "
                           "make a later process faster",
                           detail=lambda: "torch caches what it compiled for later processes"):
                run()
        except Exception as e:
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if o.required:
                raise CompileError(f"{what} failed ({reason}); pass compile=None to run such a model uncompiled, "
                                   "or compile=False") from e
            log.warning("%s failed, so its steps run uncompiled: %s", what, reason)
            self.failed[bucket] = reason
            return
        self.seconds[bucket] = time.perf_counter() - t0

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        """What was compiled, for the warm-up log line and reports."""
        o = self.forward.options
        done = f"compiled ({o.backend}) for buckets {sorted(self.seconds)} in {self.total_seconds:.1f} s"
        if self.failed:
            done += f"; uncompiled for buckets {sorted(self.failed)} ({next(iter(self.failed.values()))})"
        return done
