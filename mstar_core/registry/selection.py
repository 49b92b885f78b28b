"""Choosing a backend: by name (from the argument, ``MSTAR_ATTENTION_BACKEND``, or config) or
``"auto"`` (a priority list per capability). A name either gives a working backend or raises
one error that says why not and which backends can run here."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.capabilities import PAGED
from mstar_core.config import ConfigSource, did_you_mean, load_config
from mstar_core.config import short as _short
from mstar_core.errors import BackendUnavailable, InputError, InputTypeError
from mstar_core.features import PLAIN, AttentionFeatures
from mstar_core.registry.device import as_device, describe
from mstar_core.registry.discovery import ENV_ALLOWLIST, FIRST_PARTY, install_hint
from mstar_core.registry.registry import Registry, get_registry
from mstar_core.registry.spec import CAPABILITIES, BackendSpec, dtype_name
from mstar_core.step import is_int

log = logging.getLogger("mstar.registry")

ENV_BACKEND = "MSTAR_ATTENTION_BACKEND"
AUTO = "auto"

# Who auto tries first, per capability. A backend no list names (a third-party plugin) is tried
# after the listed kernel backends and before the reference, ordered by its declared priority.
AUTO_PRIORITY: dict[str, tuple[str, ...]] = {
    "paged_prefill": ("flashinfer", "reference"),
    "paged_decode": ("flashinfer", "reference"),
    "mixed": ("flashinfer", "reference"),
    # the dense rule (dense_or_flashinfer): FA3 where it has a kernel, AITER on ROCm,
    # FlashInfer's ragged prefill elsewhere on CUDA, the reference otherwise.
    "prefixed_ragged": ("fa3", "rocm", "flashinfer", "reference"),
    "bounded": ("reference",),
}
FALLBACK = "reference"


@dataclass(frozen=True)
class Selection:
    """The outcome of a selection: the backend, its loaded wrapper per requested capability,
    and why every other candidate auto looked at was passed over."""

    name: str
    backend: BackendSpec
    classes: Mapping[str, Any]
    rejected: Mapping[str, list[str]] = field(default_factory=dict)
    requested: str = AUTO
    source: str = "default"  # "argument", "env MSTAR_ATTENTION_BACKEND", "config", "default"

    @property
    def capturable(self) -> tuple[str, ...]:
        return tuple(c for c in self.classes if c in self.backend.capturable)


def config_backend(config: ConfigSource) -> str | None:
    """``attention.backend`` from a mapping or a TOML file holding the same table (checked
    strictly: :func:`mstar_core.config.load_config`)."""
    return load_config(config).backend


def resolve_requested(requested: str | None, config: ConfigSource,
                      honor_env: bool = True) -> tuple[str, str]:
    """(name, where it came from). ``MSTAR_ATTENTION_BACKEND`` overrides the configured name --
    ``requested`` (a manager spec's ``"backend"``, ``--backend``) or config's
    ``attention.backend`` (both are configuration) -- and the log says what it overrode; without
    it ``requested`` wins, then config, then "auto"."""
    if requested is not None:
        if not isinstance(requested, str):
            raise InputTypeError(f"requested backend must be a backend name string or {AUTO!r} (or None: config, "
                            f"then {AUTO!r}), got {type(requested).__name__} {_short(requested)}")
        configured: str | None = requested.strip()
        where = "argument"
    else:
        configured, where = load_config(config).backend, "config"
        configured = configured.strip() if configured is not None else None
    env = os.environ.get(ENV_BACKEND, "").strip() if honor_env else ""
    if env:
        if configured is not None and configured not in (env, AUTO):
            log.warning("%s=%s overrides the %s's backend %r", ENV_BACKEND, env, where, configured)
        else:
            log.info("%s=%s overrides the %s (which names %s)", ENV_BACKEND, env, where,
                     repr(configured) if configured else "no backend")
        return env, f"env {ENV_BACKEND}"
    if configured is not None:
        return configured, where
    return AUTO, "default"


def auto_order(capabilities: Sequence[str], registry: Registry,
               backends: Mapping[str, BackendSpec] | None = None) -> list[str]:
    """Candidates in the order auto tries them, among ``backends`` (default: the registry's)
    that provide every one of ``capabilities``: the first capability's list, then any other
    listed name, then unlisted plugins by declared priority (higher first, ties by name), then
    the reference."""
    backends = registry.backends if backends is None else backends
    order: list[str] = []
    for cap in capabilities:
        for name in AUTO_PRIORITY.get(cap, ()):
            if name != FALLBACK and name not in order:
                order.append(name)
    listed = set(order) | {FALLBACK}
    extra = [s for s in backends.values() if s.name not in listed]
    order += [s.name for s in sorted(extra, key=lambda s: (-s.priority, s.name))]
    order.append(FALLBACK)
    return [n for n in order if (s := backends.get(n)) is not None and provides_all(s, capabilities)]


def provides_all(spec: BackendSpec, capabilities: Sequence[str]) -> bool:
    """Whether ``spec`` provides every one of ``capabilities`` (only such a backend is a
    candidate, or is listed among those passed over)."""
    return all(c in spec.provides for c in capabilities)


def format_rejected(rejected: Mapping[str, Sequence[str]]) -> str:
    """``name: reason; reason | name: reason`` for logs and errors."""
    return " | ".join(f"{n}: {'; '.join(r)}" for n, r in rejected.items())


@dataclass(frozen=True)
class Request:
    """What one selection asks for (``dtype``/``head_dim`` None: not checked)."""

    capabilities: tuple[str, ...]
    device: torch.device
    dtype: torch.dtype | None
    head_dim: int | None
    features: AttentionFeatures = PLAIN

    def reasons(self, registry: Registry, spec: BackendSpec) -> list[str]:
        return registry.reasons(spec, self.capabilities, self.device, self.dtype, self.head_dim, self.features)

    def __str__(self) -> str:
        parts = [f"device {describe(self.device)}"]
        if self.dtype is not None:
            parts.append(f"dtype {dtype_name(self.dtype)}")
        if self.head_dim is not None:
            parts.append(f"head_dim {self.head_dim}")
        parts.append(f"capabilities {', '.join(self.capabilities)}")
        if self.features.requested():
            parts.append(f"features {', '.join(self.features.requested())}")
        return ", ".join(parts)


def runnable(registry: Registry, request: Request, backends: Mapping[str, BackendSpec]) -> list[str]:
    """Names of the ``backends`` that could serve this request (declared data and probes)."""
    return [n for n, spec in backends.items() if not request.reasons(registry, spec)]


def select_backend(
    capabilities: Sequence[str] = PAGED,
    requested: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = torch.float32,
    head_dim: int | None = 64,
    config: ConfigSource = None,
    registry: Registry | None = None,
    honor_env: bool = True,
    features: AttentionFeatures | None = None,
) -> Selection:
    """Pick the backend for ``capabilities`` on ``device``; ``dtype``/``head_dim`` None skip
    those checks; ``features`` (None: plain attention) are refused by a backend that does not
    declare them for every requested capability, with a reason naming the feature.
    ``MSTAR_ATTENTION_BACKEND``, when set, overrides both ``requested`` and ``config``'s
    ``attention.backend``; without it ``requested``, then config, then "auto".
    ``honor_env=False`` is for callers that ask what a rule itself picks (``dense_or_flashinfer``,
    the auto column of ``mstar backends``). Raises ``BackendUnavailable``."""
    if isinstance(capabilities, str):
        raise InputTypeError(f"capabilities must be a sequence of capability names, got the string {capabilities!r} "
                        f"(write ({capabilities!r},)); known: {list(CAPABILITIES)}")
    if requested is not None and not isinstance(requested, str):
        raise InputTypeError(f"requested backend must be a backend name string or {AUTO!r} (or None: config, "
                        f"then {AUTO!r}), got {type(requested).__name__} {_short(requested)}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InputTypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {type(dtype).__name__} "
                        f"{_short(dtype)}")
    if head_dim is not None and not is_int(head_dim):
        raise InputTypeError(f"head_dim must be an int or None, got {type(head_dim).__name__} {_short(head_dim)}")
    if registry is not None and not isinstance(registry, Registry):
        raise InputTypeError(f"registry must be a Registry or None, got {type(registry).__name__}")
    if features is not None and not isinstance(features, AttentionFeatures):
        raise InputTypeError(f"features must be an AttentionFeatures or None, got {type(features).__name__} "
                        f"{_short(features)}")
    capabilities = tuple(capabilities)
    unknown = [c for c in capabilities if c not in CAPABILITIES]
    if unknown or not capabilities:
        raise InputError(f"capabilities must be a non-empty subset of {list(CAPABILITIES)}, got {list(capabilities)}")
    registry = registry or get_registry()
    device = as_device(device)
    request = Request(capabilities, device, dtype, head_dim, features or PLAIN)
    config = load_config(config)
    name, source = resolve_requested(requested, config, honor_env)
    backends = registry.view(config.pins)
    if name == AUTO:
        return _select_auto(registry, request, source, backends)
    return _select_named(registry, name, source, request, backends)


def unregistered_reason(registry: Registry, name: str, known: Sequence[str]) -> str:
    """Why no backend is called ``name``: no plugin this registry loaded registers it (an
    allowlist may have left it out), and how to install it or the known name it is closest to."""
    if not name:
        return "an empty name names no backend; give a backend name or 'auto'"
    allow = registry.allowlist
    why = ("no installed plugin registers it" if allow is None else
           f"no plugin loaded here registers it ({ENV_ALLOWLIST} allows only: {', '.join(sorted(allow)) or 'none'})")
    hint = install_hint(name)
    if hint is not None:
        listed = "" if allow is None else f"; installed already: add {FIRST_PARTY[name][0]} to {ENV_ALLOWLIST}"
        return f"{why}; {hint}{listed}"
    return why + did_you_mean(name, [*known, *(n for n in FIRST_PARTY if n not in known)])


def _select_named(registry: Registry, name: str, source: str, request: Request,
                  backends: Mapping[str, BackendSpec]) -> Selection:
    known = list(backends)
    where = str(request)
    spec = backends.get(name)
    if spec is None:
        ok = runnable(registry, request, backends)
        failed = registry.failure_for(name)
        if name in registry.conflicts:
            why = registry.conflict_reason(name)
        elif failed:
            why = f"its plugin failed: {failed}"
        else:
            why = unregistered_reason(registry, name, known)
        raise BackendUnavailable(
            f"attention backend {name!r} (from {source}) is unknown: {why}. "
            f"Known backends: {', '.join(known) or 'none'}; these can run here ({where}): {', '.join(ok) or 'none'} "
            f"(or use 'auto').",
            requested=name, reasons={name: [why]}, available=ok, known=known)
    reasons = request.reasons(registry, spec)
    classes: dict[str, Any] = {}
    if not reasons:
        classes, reasons = registry.wrappers(spec, request.capabilities)
    if reasons:
        ok = [n for n in runnable(registry, request, backends) if n != name]
        raise BackendUnavailable(
            f"attention backend {name!r} ({spec.label}, from {source}) cannot run here ({where}): "
            f"{'; '.join(reasons)}. Backends that can: {', '.join(ok) or 'none'}; known backends: {', '.join(known)}.",
            requested=name, reasons={name: reasons}, available=ok, known=known)
    log.info("attention backend %r (%s, from %s) for %s", name, spec.label, source, where)
    return Selection(name, spec, classes, {}, name, source)


def _select_auto(registry: Registry, request: Request, source: str, backends: Mapping[str, BackendSpec]) -> Selection:
    where = str(request)
    capabilities = request.capabilities
    rejected: dict[str, list[str]] = {}
    # Names several distributions claim and no pin settled: never picked, listed with why where
    # one of the claimants provides what is asked (the others would not be candidates anyway).
    unsettled = {n: [registry.conflict_reason(n)] for n, claims in registry.conflicts.items()
                 if n not in backends and any(provides_all(c, capabilities) for c in claims)}
    # Every backend that provides the capabilities is in the order: what is rejected below is
    # every candidate, and a backend that does not provide them is never listed.
    for name in auto_order(capabilities, registry, backends):
        spec = backends[name]
        reasons = request.reasons(registry, spec)
        classes: dict[str, Any] = {}
        if not reasons:
            classes, reasons = registry.wrappers(spec, capabilities)
        if reasons:
            rejected[name] = reasons
            continue
        rejected.update(unsettled)
        passed = format_rejected(rejected) or "none"
        log.info("auto picked attention backend %r (%s) for %s; rejected: %s", name, spec.label, where, passed)
        return Selection(name, spec, classes, rejected, AUTO, source)
    rejected.update(unsettled)
    detail = format_rejected(rejected) or f"no registered backend provides {', '.join(capabilities)}"
    raise BackendUnavailable(
        f"no attention backend can run here ({where}). Reasons: {detail}. "
        f"Known backends: {', '.join(backends) or 'none'}.",
        requested=AUTO, reasons=rejected, available=[], known=list(backends))
