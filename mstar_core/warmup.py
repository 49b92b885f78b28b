"""Compile (or load) ahead of serving every kernel a configuration will use, so that no request
waits for a first-use compile (FlashInfer JIT-compiles each kernel family for 20-120 s).

A backend that compiles on first use declares ``BackendSpec.warmup``: a ``"module:attr"`` function
``(config, device, capabilities) -> list[WarmedKernel | str]`` (a string is a note for the report,
e.g. that a prebuilt-kernel package would have saved the compiles) that drives its own wrappers through a tiny
plan and run of every variant the configuration needs, so exactly the modules a real step would
build are built. A backend without one has nothing to prepare (its kernels are prebuilt, or it is
plain PyTorch).

    from mstar_core.warmup import WarmupConfig, warmup
    report = warmup(WarmupConfig(torch.bfloat16, head_dim=128, page_size=16, num_qo_heads=32,
                                 num_kv_heads=8, windows=(-1, 4096)), backend="flashinfer", device="cuda")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.capabilities import GROUPS
from mstar_core.errors import BackendUnavailable, InputError, InputTypeError
from mstar_core.features import AttentionFeatures
from mstar_core.registry.device import as_device, describe
from mstar_core.registry.spec import dtype_name, load_ref
from mstar_core.step import SCALE_RANGE, is_int, is_positive_finite

WARMABLE = tuple(c for g in GROUPS for c in g)  # every capability but bounded


@dataclass(frozen=True)
class WarmupConfig:
    """What selects a kernel: dtype, head dim, page size, heads (GQA group size picks decode's
    tensor-core path), the attention windows the layers use (``window_left``; -1: full attention)
    and the logit soft-cap of the paged path (None: none; the wrappers take ``logits_soft_cap``,
    the dense path has none). Backends are warmed with their default options (FlashInfer: backend
    "auto", as the managers use unless told otherwise)."""

    dtype: torch.dtype = torch.bfloat16
    head_dim: int = 128
    page_size: int = 16
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    windows: tuple[int, ...] = (-1,)
    soft_cap: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise InputTypeError(f"dtype must be a torch.dtype, e.g. torch.bfloat16; got {self.dtype!r}")
        for name in ("head_dim", "page_size", "num_qo_heads", "num_kv_heads"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise InputError(f"WarmupConfig.{name} must be a positive integer, got {v!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise InputError(f"WarmupConfig: num_qo_heads {self.num_qo_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        w_in = self.windows
        if isinstance(w_in, (Mapping, str, bytes)) or not isinstance(w_in, (Sequence, AbstractSet)):
            raise InputTypeError(f"WarmupConfig.windows must be a sequence (or set) of window_left values, each -1 "
                                 f"(full attention) or >= 0; got {type(w_in).__name__} {w_in!r}")
        windows = tuple(w_in)
        if not windows or any(not is_int(w) or w < -1 for w in windows):
            raise InputError(f"WarmupConfig.windows must hold window_left values, each -1 (full attention) or >= 0; "
                             f"got {self.windows!r}")
        object.__setattr__(self, "windows", tuple(sorted(set(windows))))
        cap = self.soft_cap
        if cap is not None and not is_positive_finite(cap):  # the rule every scale and soft-cap follows
            raise InputError(f"WarmupConfig.soft_cap must be {SCALE_RANGE}, or None; got {cap!r}")

    @property
    def features(self) -> AttentionFeatures:
        """What the configuration asks of attention, as every selection judges it (``mstar
        backends --layer-windows/--soft-cap`` and a build alike): the windows as per-layer
        windows (several distinct ones ask for the ``layer_windows`` feature), the soft-cap."""
        return AttentionFeatures(soft_cap=self.soft_cap, layer_windows=self.windows)

    def describe(self) -> str:
        parts = [dtype_name(self.dtype), f"head_dim {self.head_dim}", f"page {self.page_size}",
                 f"{self.num_qo_heads}/{self.num_kv_heads} heads",
                 "windows " + ", ".join("full" if w < 0 else str(w) for w in self.windows)]
        if self.soft_cap is not None:
            parts.append(f"soft-cap {self.soft_cap:g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class WarmedKernel:
    """One variant a warm-up ran: which capability, which variant, how long it took and what the
    backend says it did ("compiled 2 modules: ..." / "nothing compiled: ...")."""

    backend: str
    capability: str
    variant: str
    seconds: float
    detail: str = ""


@dataclass(frozen=True)
class WarmupReport:
    config: WarmupConfig
    device: str
    kernels: tuple[WarmedKernel, ...] = ()
    # one line per backend that had nothing to prepare, or per group no backend could run
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def seconds(self) -> float:
        return sum(k.seconds for k in self.kernels)

    def lines(self) -> list[str]:
        out = [f"warm-up for {self.config.describe()} on {self.device}:"]
        for k in self.kernels:
            out.append(f"  {k.backend} {k.capability} [{k.variant}]: {k.seconds:.2f} s; {k.detail}")
        out += [f"  {n}" for n in self.notes]
        out.append(f"total {self.seconds:.1f} s")
        return out


def per_backend(sel: Any, caps: Sequence[str]) -> list[tuple[Any, tuple[str, ...]]]:
    """(backend spec, the capabilities of ``caps`` it serves) of a selection, in pick order."""
    out: dict[str, tuple[Any, list[str]]] = {}
    for cap in caps:
        spec = sel.backend_for(cap)
        out.setdefault(spec.name, (spec, []))[1].append(cap)
    return [(spec, tuple(served)) for spec, served in out.values()]


def warmup(
    config: WarmupConfig, backend: str | Mapping[str, str] | None = "auto", device: torch.device | str = "cuda",
    capabilities: Sequence[str] | None = None,
) -> WarmupReport:
    """Prepare every kernel ``config`` uses on ``device``. ``backend`` "auto" (or None) -- or a
    capability table, capability -> name (``"default"``: the others) -- selects as a build would,
    per group (paged steps; the dense path), for ``config.features``; a name warms that backend
    alone. ``capabilities`` limits what is warmed (default: all the selected
    backends provide). A group no backend can run is a note; when that is every group, nothing
    would be warmed and :class:`BackendUnavailable` says why."""
    from mstar_core.registry import (  # plugins load here
        get_registry,
        resolve_requested,
        select_backend,
    )

    dev = as_device(device)
    wanted = tuple(capabilities) if capabilities is not None else WARMABLE
    bad = [c for c in wanted if c not in WARMABLE]
    if bad or not wanted:
        raise InputError(f"capabilities to warm must be a non-empty subset of {list(WARMABLE)} (bounded compiles "
                         f"nothing on first use: PyTorch, or Triton's own cache), got {list(wanted)}")
    name, _ = resolve_requested(backend, None)  # $MSTAR_ATTENTION_BACKEND overrides, as in a build
    # "auto", or a capability table (each capability its entry, else auto): selected per group
    auto = not isinstance(name, str) or name == "auto"
    named = None if auto else get_registry().get(str(name))
    features = config.features
    kernels: list[WarmedKernel] = []
    notes: list[str] = []
    missed: list[BackendUnavailable] = []  # the groups no backend can run here (auto)
    selected = 0
    for group in GROUPS:
        caps = tuple(c for c in group if c in wanted)
        if named is not None:  # a named backend: the part of the group it provides
            caps = tuple(c for c in caps if c in named.provides)
        if not caps:
            continue
        try:
            sel = select_backend(capabilities=caps, requested=name, device=dev, dtype=config.dtype,
                                 head_dim=config.head_dim, features=features)
        except BackendUnavailable as e:
            if auto:
                notes.append(f"{', '.join(caps)}: not warmed: no backend can run it here ({e})")
                missed.append(e)
                continue
            raise
        selected += 1
        for spec, served in per_backend(sel, caps):  # each pick warms the capabilities it serves
            if spec.warmup is None:
                notes.append(f"{spec.name} ({', '.join(served)}): nothing to prepare; it compiles nothing on first use")
                continue
            fn = load_ref(spec.warmup) if isinstance(spec.warmup, str) else spec.warmup
            for item in fn(config, dev, served):
                (notes if isinstance(item, str) else kernels).append(item)
    if missed and not selected:  # no group asked for has a backend here: nothing was warmed
        raise BackendUnavailable(
            f"warmup: nothing was warmed on {describe(dev)}: " + " | ".join(str(e) for e in missed)
            + ("; device cpu runs the reference backend" if dev.type != "cpu" else ""),
            requested=name if isinstance(name, str) else "auto",
            reasons={k: v for e in missed for k, v in e.reasons.items()})
    if named is not None and not kernels and not notes:
        raise InputError(f"backend {name!r} provides none of {', '.join(wanted)} (it provides "
                         f"{', '.join(named.provides)})")
    return WarmupReport(config, str(dev), tuple(kernels), tuple(notes))
