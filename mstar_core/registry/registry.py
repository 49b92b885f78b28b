"""The registry: discovers plugins once, holds every backend's spec, and answers "can backend X
run here, and if not why" with probe results cached per device."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import pluggy
import torch

from ..features import AttentionFeatures
from . import discovery, hookspecs
from .device import as_device, compute_capability, device_arch, device_available_reasons, device_key, device_kind
from .discovery import LoadedPlugin, PluginError, PluginFailure
from .spec import BackendSpec, load_ref

log = logging.getLogger("mstar.registry")
T = TypeVar("T")


class Registry:
    """Every backend this process can see.

    ``Registry()`` discovers the entry points now (``discover=False`` starts empty: tests and
    embedders ``register`` by hand). ``strict`` (default: ``MSTAR_STRICT_PLUGINS``) re-raises
    the first plugin failure instead of recording it; ``allowlist`` (default: ``MSTAR_PLUGINS``)
    limits which entry points load, by entry-point or distribution name.
    """

    def __init__(
        self,
        *,
        discover: bool = True,
        strict: bool | None = None,
        allowlist: Iterable[str] | None | type[Ellipsis] = ...,  # ...: read MSTAR_PLUGINS
    ) -> None:
        self._backends: dict[str, BackendSpec] = {}
        self.failures: list[PluginFailure] = []
        self.plugins: list[LoadedPlugin] = []
        if strict is not None and not isinstance(strict, bool):
            raise TypeError(f"Registry(strict=...) takes True, False or None (read {discovery.ENV_STRICT}), "
                            f"got {strict!r}")
        self.strict = discovery.strict_from_env() if strict is None else strict
        if isinstance(allowlist, str):
            raise TypeError(f"Registry(allowlist=...) takes an iterable of plugin names, got the string {allowlist!r} "
                            f"(write [{allowlist!r}])")
        self.allowlist = discovery.allowlist_from_env() if allowlist is ... else (
            None if allowlist is None else frozenset(allowlist))
        self._probe_cache: dict[tuple[str, str], tuple[str, ...]] = {}
        # Answers derived from probes (dense_or_flashinfer's selections): they live and die with
        # this registry and are forgotten with the probe cache (see ``derived``).
        self._derived: dict[Any, Any] = {}
        self._lock = threading.Lock()
        if discover:
            self.discover()

    # -- discovery ---------------------------------------------------------------------------
    def discover(self) -> None:
        """Load every allowed entry point, each in isolation."""
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        matched: set[str] = set()
        for ep in discovery.entry_points():
            dist, version = discovery.distribution_of(ep)
            if self.allowlist is not None and not discovery.is_builtin(ep):
                hit = {ep.name, dist} & self.allowlist
                if not hit:
                    log.debug("skipping plugin %r (%s): not in %s", ep.name, dist, discovery.ENV_ALLOWLIST)
                    continue
                matched |= hit
            self._load_one(pm, ep, dist, version)
        if self.allowlist:
            for name in sorted(self.allowlist - matched - set(discovery.BUILTIN)):
                msg = (f"{discovery.ENV_ALLOWLIST} names {name!r}, but no installed plugin has that entry-point "
                       f"or distribution name (group {discovery.GROUP!r})")
                log.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _fail(self, ep_name: str, dist: str, version: str, stage: str, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        failure = PluginFailure(ep_name, dist, version, stage, text)
        self.failures.append(failure)
        log.warning("%s", failure)
        if self.strict:
            if isinstance(error, BaseException):
                raise error
            raise PluginError(str(failure))

    def _load_one(self, pm: pluggy.PluginManager, ep, dist: str, version: str) -> None:
        try:
            module = ep.load()
            pm.register(module, name=f"{dist}:{ep.name}")
        except Exception as e:
            self._fail(ep.name, dist, version, "load", e)
            return
        impls = [i for i in pm.hook.mstar_register_backends.get_hookimpls() if i.plugin_name == f"{dist}:{ep.name}"]
        if not impls:
            self._fail(ep.name, dist, version, "register", f"{ep.value} defines no @hookimpl mstar_register_backends")
            return
        staged: list[BackendSpec] = []

        def register(spec: BackendSpec) -> None:
            if not isinstance(spec, BackendSpec):
                raise TypeError(f"register() takes a BackendSpec, got {type(spec).__name__}")
            staged.append(spec)

        try:
            for impl in impls:
                impl.function(*[{"register": register}[a] for a in impl.argnames])
        except Exception as e:
            # Nothing of a plugin whose hook raised is kept: half a registration is worse than none.
            self._fail(ep.name, dist, version, "register", e)
            return
        names = []
        for spec in staged:
            if self._add(spec, dist, version, ep.name):
                names.append(spec.name)
        self.plugins.append(LoadedPlugin(ep.name, dist, version, ep.value, tuple(names)))

    def _add(self, spec: BackendSpec, dist: str, version: str, ep_name: str) -> bool:
        first = self._backends.get(spec.name)
        if first is not None:
            self._fail(ep_name, dist, version, "duplicate",
                       f"backend {spec.name!r} is already registered by {first.label}; this one is ignored")
            return False
        from dataclasses import replace

        self._backends[spec.name] = replace(spec, distribution=spec.distribution or dist, version=spec.version or version)
        return True

    def register(self, spec: BackendSpec, *, distribution: str = "?", version: str = "?") -> None:
        """Add a backend by hand (tests, an embedding application). A taken name raises."""
        if spec.name in self._backends:
            raise PluginError(f"backend {spec.name!r} is already registered by {self._backends[spec.name].label}")
        self._add(spec, distribution, version, spec.name)

    # -- lookup ------------------------------------------------------------------------------
    @property
    def backends(self) -> Mapping[str, BackendSpec]:
        """By name (sorted, so listings do not depend on entry-point order)."""
        return {n: self._backends[n] for n in sorted(self._backends)}

    def names(self) -> list[str]:
        return sorted(self._backends)

    def get(self, name: str) -> BackendSpec | None:
        return self._backends.get(name)

    def failure_for(self, name: str) -> PluginFailure | None:
        """The failure of a plugin whose entry point carries ``name`` (so "fa3 is unknown" can say
        the fa3 plugin failed to load, rather than that it does not exist)."""
        return next((f for f in self.failures if f.entry_point == name and f.stage != "duplicate"), None)

    # -- can it run --------------------------------------------------------------------------
    def probe(self, name: str, device: torch.device | str | None = None) -> tuple[str, ...]:
        """The backend's own probe on ``device``, cached per (backend, device)."""
        spec = self._backends[name]
        device = as_device(device)
        key = (name, device_key(device))
        with self._lock:
            if key in self._probe_cache:
                return self._probe_cache[key]
        reasons = _run_probe(spec, device)
        with self._lock:
            self._probe_cache[key] = reasons
        return reasons

    def derived(self, key: Any, compute: Callable[[], T]) -> T:
        """``compute()``'s answer, cached with the probe results it is derived from (computed
        outside the lock: it may probe)."""
        with self._lock:
            if key in self._derived:
                return self._derived[key]
        value = compute()
        with self._lock:
            return self._derived.setdefault(key, value)

    def clear_probe_cache(self) -> None:
        """Forget probe results and what was derived from them (after installing a kernel library)."""
        with self._lock:
            self._probe_cache.clear()
            self._derived.clear()

    def device_reasons(self, name: str, device: torch.device | str | None = None) -> list[str]:
        """Reasons from the device alone: kind, availability, architecture, then the probe."""
        spec = self._backends[name]
        device = as_device(device)
        kind = device_kind(device)
        reasons: list[str] = []
        if kind not in spec.devices:
            reasons.append(f"runs on {'/'.join(spec.devices)}, not on {kind}")
        else:
            reasons.extend(device_available_reasons(device))
            if not reasons:
                reasons.extend(_arch_reasons(spec, device))
        for r in self.probe(name, device):
            if r not in reasons:
                reasons.append(r)
        return reasons

    def reasons(
        self,
        name: str,
        capabilities: Sequence[str] = (),
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
        features: AttentionFeatures | None = None,
    ) -> list[str]:
        """Every reason ``name`` cannot serve this request; empty when it can."""
        spec = self._backends[name]
        return self.device_reasons(name, device) + spec.declared_reasons(capabilities, dtype, head_dim, features)


def _arch_reasons(spec: BackendSpec, device: torch.device) -> list[str]:
    if device.type == "cpu":
        return []
    arch = device_arch(device)
    if spec.archs is not None and arch not in spec.archs:
        return [f"no kernel for {arch or 'this GPU'} (kernels for: {', '.join(spec.archs)})"]
    cc = compute_capability(device)
    if spec.min_compute_capability is not None and cc is not None and cc < spec.min_compute_capability:
        need = "sm{}{}".format(*spec.min_compute_capability)
        return [f"no kernel for {arch} ({need} or newer is required)"]
    return []


def _run_probe(spec: BackendSpec, device: torch.device) -> tuple[str, ...]:
    if spec.probe is None:
        return ()
    try:
        fn = load_ref(spec.probe) if isinstance(spec.probe, str) else spec.probe
        return tuple(str(r) for r in fn(device))
    except Exception as e:  # a probe that crashes says the backend cannot run; it never propagates
        log.warning("probe of backend %r raised %s: %s", spec.name, type(e).__name__, e)
        return (f"probe failed ({type(e).__name__}: {e})",)


_default: Registry | None = None
_default_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, discovered on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Registry()
        return _default


def reset_registry() -> None:
    """Forget the process-wide registry (tests; after installing a plugin at runtime)."""
    global _default
    with _default_lock:
        _default = None
