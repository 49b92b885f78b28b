"""The registry: discovers plugins once, holds every backend's spec, and answers "can backend X
run here, and if not why" with probe results cached per device."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from types import EllipsisType
from typing import Any, TypeVar

import pluggy
import torch

from mstar_core.config import check_pins, did_you_mean
from mstar_core.errors import InputError, InputTypeError, PluginError, UnknownName
from mstar_core.features import AttentionFeatures
from mstar_core.registry import discovery, hookspecs
from mstar_core.registry.api import incompatibility
from mstar_core.registry.device import (
    as_device,
    compute_capability,
    device_arch,
    device_key,
    device_kind,
    device_unavailable,
)
from mstar_core.registry.discovery import LoadedPlugin, PluginFailure
from mstar_core.registry.measured import MeasuredTable
from mstar_core.registry.spec import BackendSpec, load_ref

log = logging.getLogger("mstar.registry")
T = TypeVar("T")
# A backend's provides, imported: capability -> wrapper, capability -> why it failed, the failure.
Resolved = tuple[dict[str, Any], dict[str, str], "PluginFailure | None"]


def _stamp(spec: BackendSpec, distribution: str, version: str) -> BackendSpec:
    """``spec`` with the distribution and version that registered it, where it names none itself."""
    return replace(spec, distribution=spec.distribution or distribution, version=spec.version or version)


class Registry:
    """Every backend this process can see.

    ``Registry()`` discovers the entry points now (``discover=False`` starts empty: tests and
    embedders ``register`` by hand). ``strict`` (default: ``MSTAR_STRICT_PLUGINS``) raises
    :class:`PluginError`, naming the plugin, at the first plugin failure instead of recording
    it; ``allowlist`` (default: ``MSTAR_PLUGINS``) limits which entry points load, by
    entry-point or distribution name; ``pins`` (default: ``MSTAR_BACKEND_PINS``) maps a backend
    name to the distribution that serves it when several register that name.
    """

    def __init__(
        self,
        *,
        discover: bool = True,
        strict: bool | None = None,
        allowlist: Iterable[str] | None | EllipsisType = ...,  # ...: read MSTAR_PLUGINS
        pins: Mapping[str, str] | None = None,  # None: read MSTAR_BACKEND_PINS
    ) -> None:
        # name -> every spec registered under it, one per distribution (a name two distributions
        # claim is a conflict: served only where a pin picks one).
        self._claims: dict[str, list[BackendSpec]] = {}
        self.failures: list[PluginFailure] = []
        self.plugins: list[LoadedPlugin] = []
        if strict is not None and not isinstance(strict, bool):
            raise InputTypeError(f"Registry(strict=...) takes True, False or None (read {discovery.ENV_STRICT}), "
                            f"got {strict!r}")
        self.strict = discovery.strict_from_env() if strict is None else strict
        if isinstance(allowlist, str):
            raise InputTypeError(f"Registry(allowlist=...) takes an iterable of plugin names, "
                                 f"got the string {allowlist!r} (write [{allowlist!r}])")
        self.allowlist = discovery.allowlist_from_env() if allowlist is ... else (
            None if allowlist is None else frozenset(allowlist))
        self.pins: dict[str, str] = discovery.pins_from_env() if pins is None else check_pins(
            pins, "Registry(pins=...)")
        self._probe_cache: dict[tuple[str, str | None, str], tuple[str, ...]] = {}
        self._measured: dict[tuple[str, str | None], MeasuredTable | None] = {}
        # (name, distribution) -> (capability -> loaded wrapper, reasons): provides resolved once.
        self._resolved: dict[tuple[str, str | None], Resolved] = {}
        # Answers derived from probes (dense_or_flashinfer's selections): they live and die with
        # this registry and are forgotten with the probe cache (see ``derived``).
        self._derived: dict[Any, Any] = {}
        self._lock = threading.RLock()
        if discover:
            self.discover()

    # -- discovery ---------------------------------------------------------------------------
    def discover(self) -> None:
        """Load every allowed entry point, each in isolation; then check the pins and, in strict
        mode, refuse a name two distributions claim that no pin settles."""
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
            # Said once, through the log like every other discovery problem; with no logging
            # configured, Python's last-resort handler still prints it on stderr.
            for name in sorted(self.allowlist - matched - set(discovery.BUILTIN)):
                log.warning("%s names %r, but no installed plugin has that entry-point or distribution name "
                            "(group %r)", discovery.ENV_ALLOWLIST, name, discovery.GROUP)
        for name in self.conflicts:  # strict mode refuses them where a selection meets them (view)
            log.warning("%s", self.conflict_reason(name))
        # A pin for a name nobody registers is harmless; view() checks every pin of the registry's
        # and raises when a pinned distribution does not register its name.
        if any(name in self._claims for name in self.pins):
            self.view({})

    def _fail(self, ep_name: str, dist: str, version: str, stage: str, error: BaseException | str,
              backends: Sequence[str] = ()) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        failure = PluginFailure(ep_name, dist, version, stage, text, tuple(dict.fromkeys(backends)))
        self.failures.append(failure)
        if self.strict:
            # One way to fail in strict mode: a PluginError naming the plugin, the cause chained.
            raise PluginError(f"strict mode: {failure}") from (error if isinstance(error, BaseException) else None)
        log.warning("%s", failure)

    def _load_one(self, pm: pluggy.PluginManager, ep, dist: str, version: str) -> None:
        try:
            module = ep.load()
            pm.register(module, name=f"{dist}:{ep.name}")
        except Exception as e:
            self._fail(ep.name, dist, version, "load", e, discovery.intended_backends(ep.module))
            return
        impls = [i for i in pm.hook.mstar_register_backends.get_hookimpls() if i.plugin_name == f"{dist}:{ep.name}"]
        if not impls:
            self._fail(ep.name, dist, version, "register", f"{ep.value} defines no @hookimpl mstar_register_backends",
                       discovery.intended_backends(ep.module))
            return
        staged: list[BackendSpec] = []

        def register(spec: BackendSpec) -> None:
            if not isinstance(spec, BackendSpec):
                raise InputTypeError(f"register() takes a BackendSpec, got {type(spec).__name__}")
            staged.append(spec)

        try:
            for impl in impls:
                impl.function(*[{"register": register}[a] for a in impl.argnames])
            problem = self._claim_problem(staged, dist)
        except Exception as e:
            # Nothing of a plugin whose hook raised is kept: half a registration is worse than none.
            self._fail(ep.name, dist, version, "register", e,
                       [s.name for s in staged] + list(discovery.intended_backends(ep.module)))
            return
        if problem:
            self._fail(ep.name, dist, version, "register", problem, [s.name for s in staged])
            return
        for spec in staged:
            self._claims.setdefault(spec.name, []).append(_stamp(spec, dist, version))
        self.plugins.append(LoadedPlugin(ep.name, dist, version, ep.value, tuple(s.name for s in staged)))

    def _claim_problem(self, staged: Sequence[BackendSpec], dist: str) -> str | None:
        """Why a plugin's registrations cannot be kept whole, or None."""
        names = [s.name for s in staged]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            return f"it registers backend {', '.join(map(repr, twice))} more than once"
        for name in names:
            owner = discovery.RESERVED.get(name)
            if owner is not None and dist != owner:
                return f"backend name {name!r} is reserved for {owner}'s built-in backend"
            for other in self._claims.get(name, ()):
                if other.distribution == dist:
                    return f"backend {name!r} is already registered by {other.label} (the same distribution)"
        return None

    def register(self, spec: BackendSpec, *, distribution: str = "?", version: str = "?") -> None:
        """Add a backend by hand (tests, an embedding application). A taken name raises."""
        if spec.name in self._claims:
            raise PluginError(f"backend {spec.name!r} is already registered by {self._claims[spec.name][0].label}")
        self._claims[spec.name] = [_stamp(spec, distribution, version)]

    # -- lookup ------------------------------------------------------------------------------
    @property
    def backends(self) -> Mapping[str, BackendSpec]:
        """By name (sorted, so listings do not depend on entry-point order): every backend whose
        name one distribution registers, or a pin settles."""
        return self.view({})

    @property
    def conflicts(self) -> Mapping[str, tuple[BackendSpec, ...]]:
        """Names several distributions register that no pin (``MSTAR_BACKEND_PINS`` or the
        registry's ``pins``) settles: neither is picked by that name."""
        return {n: tuple(c) for n, c in sorted(self._claims.items()) if len(c) > 1 and n not in self.pins}

    def view(self, pins: Mapping[str, str]) -> dict[str, BackendSpec]:
        """The backends a selection sees with ``pins`` (a config's ``attention.pins``) under the
        registry's own (``MSTAR_BACKEND_PINS`` wins, as the environment does over config for the
        backend's name): each name's one registration, or the pinned distribution's. A pin
        naming a distribution that does not register that name raises, naming who does; in
        strict mode a conflict these pins leave unsettled raises :class:`PluginError`."""
        pins = {**pins, **self.pins}
        out: dict[str, BackendSpec] = {}
        for name in sorted(self._claims):
            claims = self._claims[name]
            pinned = pins.get(name)
            if pinned is None:
                if len(claims) == 1:
                    out[name] = claims[0]
                elif self.strict:
                    raise PluginError(f"strict mode: {self.conflict_reason(name)}")
                continue
            match = [c for c in claims if c.distribution == pinned]
            if not match:
                raise InputError(f"backend {name!r} is pinned to distribution {pinned!r}, which does not register it; "
                                 f"registered by: {', '.join(c.label for c in claims)}")
            out[name] = match[0]
        return out

    def conflict_reason(self, name: str) -> str:
        labels = " and ".join(c.label for c in self._claims[name])
        return (f"backend name {name!r} is registered by {len(self._claims[name])} distributions ({labels}); "
                f"neither serves it until one is pinned: {discovery.ENV_PINS}={name}=DISTRIBUTION, or "
                f"pins = {{{name} = \"DISTRIBUTION\"}} in the config's [attention] table")

    def names(self) -> list[str]:
        return list(self.backends)

    def get(self, name: str) -> BackendSpec | None:
        return self.backends.get(name)

    def failure_for(self, name: str) -> PluginFailure | None:
        """The failure of a plugin that meant to register ``name`` (its entry point's name, a
        name it registered before failing, or one its source passes to ``BackendSpec``), so
        "fa3 is unknown" can say the fa3 plugin failed, rather than that it does not exist."""
        return next((f for f in self.failures if name == f.entry_point or name in f.backends), None)

    def _spec(self, backend: str | BackendSpec) -> BackendSpec:
        if isinstance(backend, BackendSpec):
            return backend
        spec = self.get(backend)
        if spec is None:
            raise UnknownName(f"no usable backend {backend!r}: "
                           + (self.conflict_reason(backend) if backend in self.conflicts else
                              f"known: {', '.join(self.names())}{did_you_mean(str(backend), self.names())}"))
        return spec

    # -- can it run --------------------------------------------------------------------------
    def probe(self, backend: str | BackendSpec, device: torch.device | str | None = None) -> tuple[str, ...]:
        """The backend's own probe on ``device``, cached per (backend, device)."""
        spec = self._spec(backend)
        device = as_device(device)
        key = (spec.name, spec.distribution, device_key(device))
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
        """Forget probe results, resolved wrappers and what was derived from them (after
        installing a kernel library)."""
        with self._lock:
            self._probe_cache.clear()
            self._resolved.clear()
            self._derived.clear()

    def measured(self, backend: str | BackendSpec) -> MeasuredTable | None:
        """The backend's measured kernel times (``BackendSpec.measured``), loaded once; None
        where it declares none or its table cannot be read (logged: auto then ignores it)."""
        spec = self._spec(backend)
        if spec.measured is None:
            return None
        key = (spec.name, spec.distribution)
        with self._lock:
            if key in self._measured:
                return self._measured[key]
        table: MeasuredTable | None = None
        try:
            table = load_ref(spec.measured)()
            if not isinstance(table, MeasuredTable):
                raise InputTypeError(f"returned {type(table).__name__}, not a MeasuredTable")
        except Exception as e:  # a table that cannot be read must not break selection
            log.warning("backend %r: its measured table %s cannot be read (%s: %s); auto ignores it", spec.name,
                        spec.measured, type(e).__name__, e)
            table = None
        with self._lock:
            self._measured[key] = table
        return table

    def wrappers(self, backend: str | BackendSpec, capabilities: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
        """``(capability -> loaded wrapper, reasons)`` for ``capabilities``: every ``provides``
        reference of the backend is imported once (the kernel library loads here); one that
        fails is a reason naming it -- in strict mode a :class:`PluginError` naming the plugin."""
        spec = self._spec(backend)
        key = (spec.name, spec.distribution)
        with self._lock:
            resolved = self._resolved.get(key)
        if resolved is None:
            resolved = self._resolve(spec)
            with self._lock:
                resolved = self._resolved.setdefault(key, resolved)
                if resolved[2] is not None and resolved[2] not in self.failures:
                    self.failures.append(resolved[2])  # listed by `mstar backends` with the others
        classes, failed, failure = resolved
        if failure is not None and self.strict:  # every call, not only the first: the answer is cached
            raise PluginError(f"strict mode: {failure}")
        return {c: classes[c] for c in capabilities if c in classes}, [failed[c] for c in capabilities if c in failed]

    def _resolve(self, spec: BackendSpec) -> Resolved:
        classes: dict[str, Any] = {}
        failed: dict[str, str] = {}
        for cap, ref in spec.provides.items():
            try:
                classes[cap] = load_ref(ref)
            except Exception as e:  # a wrapper module that fails to import, an attribute that is not there
                failed[cap] = f"its {cap} wrapper {ref} cannot be loaded ({type(e).__name__}: {e})"
        if not failed:
            return classes, failed, None
        plugin = next((p for p in self.plugins if spec.name in p.backends and p.distribution == spec.distribution),
                      None)
        failure = PluginFailure(plugin.entry_point if plugin else spec.name, spec.distribution or "?",
                                spec.version or "?", "provides", "; ".join(failed.values()), (spec.name,))
        return classes, failed, failure

    def reasons(
        self,
        backend: str | BackendSpec,
        capabilities: Sequence[str] = (),
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
        features: AttentionFeatures | None = None,
    ) -> list[str]:
        """Why the backend cannot serve ``capabilities`` on ``device`` (None: the CPU) at
        ``dtype``, ``head_dim`` and ``features`` (None: not judged); empty when it can. With no
        capabilities and nothing else: whether it runs on the device at all. In order: its plugin
        API version (an incompatible backend is judged on nothing else: neither probed nor
        imported), the device kind, availability and architecture, its probe, then -- only where
        those pass -- whether the wrappers of the requested capabilities it provides (none: every
        one) import; then what its declared data refuses (:meth:`BackendSpec.declared_refusals`)."""
        spec = self._spec(backend)
        incompatible = incompatibility(spec.api_version)
        if incompatible is not None:
            return [incompatible]
        device = as_device(device)
        reasons = _device_refusals(spec, device)
        reasons += [r for r in self.probe(spec, device) if r not in reasons]
        if not reasons:
            provided = tuple(c for c in capabilities if c in spec.provides)
            reasons = self.wrappers(spec, provided or tuple(spec.provides))[1]
        return reasons + spec.declared_refusals(capabilities, dtype, head_dim, features)


def _device_refusals(spec: BackendSpec, device: torch.device) -> list[str]:
    """Why ``spec`` cannot run on ``device`` from its kind, availability and architecture."""
    kind = device_kind(device)
    if kind not in spec.devices:
        return [f"runs on {'/'.join(spec.devices)}, not on {kind}"]
    missing = device_unavailable(device)
    if missing is not None:
        return [missing]
    no_kernel = _no_kernel(spec, device)
    return [] if no_kernel is None else [no_kernel]


def _no_kernel(spec: BackendSpec, device: torch.device) -> str | None:
    """Why ``spec`` has no kernel for the GPU ``device`` is (``archs``, ``min_compute_capability``)."""
    if device.type == "cpu":
        return None
    arch = device_arch(device)
    if spec.archs is not None and arch not in spec.archs:
        return f"no kernel for {arch or 'this GPU'} (kernels for: {', '.join(spec.archs)})"
    cc = compute_capability(device)
    if spec.min_compute_capability is not None and cc is not None and cc < spec.min_compute_capability:
        need = "sm{}{}".format(*spec.min_compute_capability)
        return f"no kernel for {arch} ({need} or newer is required)"
    return None


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
