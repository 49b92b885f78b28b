"""Choosing a backend: by name (from the argument, ``MSTAR_ATTENTION_BACKEND``, or config) or
``"auto"`` (each backend's declared priority per capability, then measured kernel times). A name
either gives a working backend or raises one error that says why not and which backends can run
here."""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mstar_core.capabilities import PAGED, PAGED_DECODE, PAGED_PREFILL
from mstar_core.config import DEFAULT_KEY, ConfigSource, check_backend_table, did_you_mean, load_config
from mstar_core.config import short as _short
from mstar_core.errors import BackendUnavailable, InputError, InputTypeError, UnknownName
from mstar_core.features import PLAIN, AttentionFeatures
from mstar_core.registry.device import as_device, describe, device_arch
from mstar_core.registry.discovery import ENV_ALLOWLIST, FIRST_PARTY, install_hint
from mstar_core.registry.measured import measured_order
from mstar_core.registry.registry import Registry, get_registry
from mstar_core.registry.spec import CAPABILITIES, BackendSpec, dtype_name
from mstar_core.step import is_int

log = logging.getLogger("mstar.registry")

ENV_BACKEND = "MSTAR_ATTENTION_BACKEND"
AUTO = "auto"

# The core's own backend: every capability on every device, so auto ends with it.
FALLBACK = "reference"


@dataclass(frozen=True)
class Selection:
    """The outcome of a selection: the backend picked for each requested capability
    (``picks``; one backend for all of them unless a capability was named apart or ``auto``
    found a better one for it), the loaded wrapper per capability, and why every other
    candidate was passed over."""

    name: str  # the backend serving every capability, or "a+b": each one serving some, in order
    backend: BackendSpec  # the first capability's backend
    classes: Mapping[str, Any]
    rejected: Mapping[str, list[str]] = field(default_factory=dict)
    requested: str = AUTO
    source: str = "default"  # "argument", "env MSTAR_ATTENTION_BACKEND", "config", "default"
    # capability -> its backend (empty: ``backend`` serves every one of ``classes``)
    picks: Mapping[str, BackendSpec] = field(default_factory=dict)
    # capability -> (name -> why auto passed it over for that capability)
    rejected_by: Mapping[str, Mapping[str, list[str]]] = field(default_factory=dict)
    # The capability whose wrapper runs uniform multi-token decode rows (features
    # decode_query_tokens > 1): "paged_decode" or "paged_prefill"; None: not asked.
    multi_token_wrapper: str | None = None
    # capability -> how measured kernel times ordered auto's candidates for it (the backends'
    # committed tables: registry.measured); absent where none did.
    measured: Mapping[str, str] = field(default_factory=dict)

    def backend_for(self, capability: str) -> BackendSpec:
        """The backend serving ``capability``."""
        return self.picks.get(capability, self.backend)

    def spec_for(self, capability: str) -> BackendSpec | None:
        """The spec of the backend serving ``capability`` (the reference has one too); None
        where this selection did not select ``capability``."""
        return self.backend_for(capability) if capability in self.classes else None

    def api_version(self, capability: str) -> str:
        """The plugin API version (``"1.0"``, ``"1.1"``, ...) the backend serving ``capability``
        declares: the contract its wrapper speaks. Raises ``UnknownName`` for a capability this
        selection did not select."""
        spec = self.spec_for(capability)
        if spec is None:
            raise UnknownName(f"this selection did not select {capability!r}; it selected "
                              f"{', '.join(self.classes)}")
        return spec.api_version

    @property
    def names(self) -> dict[str, str]:
        """capability -> the name of the backend serving it."""
        return {c: self.backend_for(c).name for c in self.classes}

    @property
    def summary(self) -> str:
        """The backend's name, or ``capability: name`` for each where several serve."""
        names = self.names
        if len(set(names.values())) <= 1:
            return self.name
        return ", ".join(f"{c}: {n}" for c, n in names.items())

    @property
    def capturable(self) -> tuple[str, ...]:
        return tuple(c for c in self.classes if c in self.backend_for(c).capturable)


BackendChoice = str | Mapping[str, str]


def config_backend(config: ConfigSource) -> BackendChoice | None:
    """``attention.backend`` from a mapping or a TOML file holding the same table (checked
    strictly: :func:`mstar_core.config.load_config`): a name, or capability -> name."""
    return load_config(config).backend


def _show(choice: BackendChoice | None) -> str:
    if choice is None or isinstance(choice, str):
        return repr(choice) if choice else "no backend"
    return "{" + ", ".join(f"{k} = {v!r}" for k, v in choice.items()) + "}"


def resolve_requested(requested: BackendChoice | None, config: ConfigSource,
                      honor_env: bool = True) -> tuple[BackendChoice, str]:
    """(name -- or capability -> name --, where it came from). ``MSTAR_ATTENTION_BACKEND``
    overrides the configured choice -- ``requested`` (a manager spec's ``"backend"``,
    ``--backend``) or config's ``attention.backend`` (both are configuration) -- and the log says
    what it overrode; without it ``requested`` wins, then config, then "auto"."""
    configured: BackendChoice | None
    if requested is not None:
        if isinstance(requested, Mapping):
            configured = check_backend_table(requested, "requested backend")
        elif not isinstance(requested, str):
            raise InputTypeError(f"requested backend must be a backend name string or {AUTO!r}, a mapping of "
                                 f"capability -> name, or None (config, then {AUTO!r}); got "
                                 f"{type(requested).__name__} {_short(requested)}")
        else:
            configured = requested.strip()
        where = "argument"
    else:
        configured, where = load_config(config).backend, "config"
        configured = configured.strip() if isinstance(configured, str) else configured
    env = os.environ.get(ENV_BACKEND, "").strip() if honor_env else ""
    if env:
        if configured is not None and configured not in (env, AUTO):
            log.warning("%s=%s overrides the %s's backend %s", ENV_BACKEND, env, where, _show(configured))
        else:
            log.info("%s=%s overrides the %s (which names %s)", ENV_BACKEND, env, where, _show(configured))
        return env, f"env {ENV_BACKEND}"
    if configured is not None:
        return configured, where
    return AUTO, "default"


def name_for(choice: BackendChoice, capability: str) -> str:
    """The backend name ``choice`` gives ``capability``: the name itself, or the table's entry
    (then its ``"default"``, then ``"auto"``)."""
    if isinstance(choice, str):
        return choice
    return choice.get(capability, choice.get(DEFAULT_KEY, AUTO))


def auto_order(capabilities: Sequence[str], registry: Registry,
               backends: Mapping[str, BackendSpec] | None = None) -> list[str]:
    """Candidates in the order auto tries them, among ``backends`` (default: the registry's)
    that provide every one of ``capabilities``: by declared priority for the first capability
    (``BackendSpec.priority_for``), then for the next, higher first, ties by name; the reference
    last."""
    backends = registry.backends if backends is None else backends
    fit = [s for s in backends.values() if provides_all(s, capabilities)]
    ranked = sorted((s for s in fit if s.name != FALLBACK),
                    key=lambda s: ([-s.priority_for(c) for c in capabilities], s.name))
    return [s.name for s in ranked] + [s.name for s in fit if s.name == FALLBACK]


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


def _serve(registry: Registry, request: Request, spec: BackendSpec) -> tuple[dict[str, Any], list[str]]:
    """``(capability -> wrapper, [])`` where ``spec`` can serve ``request``, else ``({}, why
    not)`` (:meth:`Registry.reasons`, the one judge)."""
    reasons = registry.reasons(spec, request.capabilities, request.device, request.dtype, request.head_dim,
                               request.features)
    return ({}, reasons) if reasons else (registry.wrappers(spec, request.capabilities)[0], [])


def runnable(registry: Registry, request: Request, backends: Mapping[str, BackendSpec]) -> list[str]:
    """Names of the ``backends`` that could serve this request (declared data and probes)."""
    return [n for n, spec in backends.items() if not _serve(registry, request, spec)[1]]


def select_backend(
    capabilities: Sequence[str] = PAGED,
    requested: BackendChoice | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = torch.float32,
    head_dim: int | None = 64,
    config: ConfigSource = None,
    registry: Registry | None = None,
    honor_env: bool = True,
    features: AttentionFeatures | None = None,
) -> Selection:
    """Pick a backend for each of ``capabilities`` on ``device``; ``dtype``/``head_dim`` None
    skip those checks; ``features`` (None: plain attention) are refused by a backend that does
    not declare them for the capability, with a reason naming the feature.

    ``requested`` (or config's ``attention.backend``) is a name -- every capability from that
    backend -- or ``"auto"``, or a mapping capability -> name (``"default"``: the others; else
    auto). Under auto each capability gets the first backend of its own order that can serve
    it, over mstar's paged KV layout. ``MSTAR_ATTENTION_BACKEND``, when set, overrides both
    ``requested`` and config; without it ``requested``, then config, then "auto".
    ``honor_env=False`` is for callers that ask what a rule itself picks (``dense_or_flashinfer``,
    the auto column of ``mstar backends``). Raises ``BackendUnavailable``."""
    if isinstance(capabilities, str):
        raise InputTypeError(f"capabilities must be a sequence of capability names, got the string {capabilities!r} "
                        f"(write ({capabilities!r},)); known: {list(CAPABILITIES)}")
    if requested is not None and not isinstance(requested, (str, Mapping)):
        raise InputTypeError(f"requested backend must be a backend name string or {AUTO!r}, a mapping of "
                             f"capability -> name, or None (config, then {AUTO!r}); got {type(requested).__name__} "
                             f"{_short(requested)}")
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
    choice, source = resolve_requested(requested, config, honor_env)
    backends = registry.view(config.pins)
    if isinstance(choice, str) and choice != AUTO:
        sel = _select_named(registry, choice, source, request, backends)
        wrapper = _route(request, {c: sel.backend for c in capabilities})
        return replace(sel, multi_token_wrapper=wrapper)
    return _select_each(registry, request, choice, source, backends)


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
    classes, reasons = _serve(registry, request, spec)
    if reasons:
        ok = [n for n in runnable(registry, request, backends) if n != name]
        raise BackendUnavailable(
            f"attention backend {name!r} ({spec.label}, from {source}) cannot run here ({where}): "
            f"{'; '.join(reasons)}. Backends that can: {', '.join(ok) or 'none'}; known backends: {', '.join(known)}.",
            requested=name, reasons={name: reasons}, available=ok, known=known)
    log.info("attention backend %r (%s, from %s) for %s", name, spec.label, source, where)
    return Selection(name, spec, classes, {}, name, source)


def _route(request: Request, picks: Mapping[str, BackendSpec]) -> str | None:
    """Which wrapper runs uniform multi-token decode rows under ``picks``: the decode pick's
    decode wrapper where it declares them there, else the prefill pick's prefill wrapper where
    that declares them (without a prefill pick: the decode pick's own); None when the features
    do not ask for them, or no pick runs them."""
    decode = picks.get(PAGED_DECODE)
    if request.features.decode_query_tokens == 1 or decode is None:
        return None
    if PAGED_DECODE in decode.multi_token_wrappers():
        return PAGED_DECODE
    prefill = picks.get(PAGED_PREFILL)
    if prefill is None:
        return next(iter(decode.multi_token_wrappers()), None)
    return PAGED_PREFILL if PAGED_PREFILL in prefill.multi_token_wrappers() else None


Candidate = tuple[BackendSpec, Any]


def candidate_order(registry: Registry, request: Request, backends: Mapping[str, BackendSpec]
                    ) -> tuple[list[str], str | None]:
    """Auto's order for ``request``'s one capability: :func:`auto_order`, then the backends with
    measured times on this GPU architecture first, fastest first (:mod:`.measured`); and why."""
    (cap,) = request.capabilities
    order = auto_order((cap,), registry, backends)
    if request.device.type != "cuda":
        return order, None
    tables = {n: t for n in order if (t := registry.measured(backends[n])) is not None}
    if len(tables) < 2:
        return order, None
    return measured_order(order, tables, cap, device_arch(request.device))


def _candidates(registry: Registry, request: Request, backends: Mapping[str, BackendSpec],
                rejected: dict[str, list[str]], order: Sequence[str]) -> Iterator[Candidate]:
    """(spec, wrapper) of every backend in ``order`` (:func:`candidate_order`'s) that can serve
    ``request``'s one capability, judged as they are reached (probes and imports only as far as
    needed); each one that cannot goes into ``rejected`` with its reasons."""
    (cap,) = request.capabilities
    for name in order:
        spec = backends[name]
        classes, reasons = _serve(registry, request, spec)
        if reasons:
            rejected[name] = reasons
            continue
        yield spec, classes[cap]


def _multi_token_picks(request: Request, picks: dict[str, Candidate], open_: Mapping[str, Iterator[Candidate]],
                       rejected_by: dict[str, dict[str, list[str]]]) -> str | None:
    """Change the picks so one of them runs multi-token decode rows, if some candidate can: the
    first picks as they are; else the first prefill candidate that runs them on its prefill
    wrapper; else the first decode candidate that runs them on its decode wrapper (only
    capabilities auto chose, ``open_``, change). Returns the wrapper that runs them."""
    route = _route(request, {c: spec for c, (spec, _) in picks.items()})
    if route is not None:
        return route
    for cap in (PAGED_PREFILL, PAGED_DECODE):
        if cap not in open_:
            continue
        for spec, wrapper in itertools.chain([picks[cap]], open_[cap]):
            if cap in spec.multi_token_wrappers():
                picks[cap] = (spec, wrapper)
                return cap
            rejected_by[cap][spec.name] = [f"does not run multi-token decode rows (feature multi_token_decode) on its "
                                           f"{cap} wrapper"]
    return None


def _select_each(registry: Registry, request: Request, choice: BackendChoice, source: str,
                 backends: Mapping[str, BackendSpec]) -> Selection:
    """Each capability from its own pick: the backend ``choice`` names for it, or auto's first
    that can serve it; then multi-token decode rows placed (:func:`_multi_token_picks`)."""
    where = str(request)
    # Multi-token rows may run on the decode pick or on the prefill pick: judged across picks.
    plain = replace(request, features=replace(request.features, decode_query_tokens=1))
    picks: dict[str, Candidate] = {}
    open_: dict[str, Iterator[Candidate]] = {}
    rejected_by: dict[str, dict[str, list[str]]] = {}
    measured: dict[str, str] = {}
    for cap in request.capabilities:
        one = replace(plain, capabilities=(cap,))
        name = name_for(choice, cap)
        if name != AUTO:
            sel = _select_named(registry, name, f"{source}, for {cap}" if not isinstance(choice, str) else source, one,
                                backends)
            picks[cap] = (sel.backend, sel.classes[cap])
            continue
        rejected = rejected_by.setdefault(cap, {})
        order, why = candidate_order(registry, one, backends)
        if why is not None:
            measured[cap] = why
            log.info("auto order by measured kernel times: %s", why)
        it = _candidates(registry, one, backends, rejected, order)
        first = next(it, None)
        # Names several distributions claim and no pin settled: never picked, listed with why where
        # one of the claimants provides the capability.
        rejected.update({n: [registry.conflict_reason(n)] for n, claims in registry.conflicts.items()
                         if n not in backends and any(cap in c.provides for c in claims)})
        if first is None:
            merged = _merged(rejected_by)
            detail = format_rejected(rejected) or f"no registered backend provides {cap}"
            raise BackendUnavailable(
                f"no attention backend can run here ({where}): none serves {cap}. Reasons: {detail}. "
                f"Known backends: {', '.join(backends) or 'none'}.",
                requested=AUTO, reasons=merged, available=[], known=list(backends))
        picks[cap] = first
        open_[cap] = it
    wrapper = None
    if request.features.decode_query_tokens > 1 and PAGED_DECODE in picks:
        wrapper = _multi_token_picks(request, picks, open_, rejected_by)
        if wrapper is None:
            named = ", ".join(f"{c}: {spec.name}" for c, (spec, _) in picks.items()
                              if c in (PAGED_DECODE, PAGED_PREFILL))
            raise BackendUnavailable(
                f"no attention backend can run here ({where}): the features ask for "
                f"{request.features.decode_query_tokens} query tokens per decode row (multi_token_decode), and no "
                f"pick runs them ({named}: neither declares it on that wrapper). Reasons: "
                f"{format_rejected(_merged(rejected_by)) or 'none'}.",
                requested=AUTO, reasons=_merged(rejected_by), available=[], known=list(backends))
    specs = {c: spec for c, (spec, _) in picks.items()}
    for c, spec in specs.items():  # a pick kept where no candidate ran the rows is not passed over
        rejected_by.get(c, {}).pop(spec.name, None)
    distinct = list(dict.fromkeys(spec.name for spec in specs.values()))
    name = "+".join(distinct)
    requested = choice if isinstance(choice, str) else _show(choice)
    merged = _merged(rejected_by)
    if len(distinct) == 1 and isinstance(choice, str):  # auto for every capability, one backend serving all
        spec = specs[request.capabilities[0]]
        log.info("auto picked attention backend %r (%s) for %s; rejected: %s", name, spec.label, where,
                 format_rejected(merged) or "none")
    else:
        log.info("attention backends per capability for %s: %s; rejected: %s", where,
                 ", ".join(f"{c}: {spec.name} ({spec.label})" for c, spec in specs.items()),
                 " || ".join(f"{c}: {format_rejected(r)}" for c, r in rejected_by.items() if r) or "none")
    return Selection(name, specs[request.capabilities[0]], {c: w for c, (_, w) in picks.items()}, merged, requested,
                     source, specs, {c: dict(r) for c, r in rejected_by.items()}, wrapper, measured)


_IN_CAPABILITY = re.compile(r"(.*) in ((?:[a-z_]+)(?:, [a-z_]+)*)")


def _merged(rejected_by: Mapping[str, Mapping[str, list[str]]]) -> dict[str, list[str]]:
    """name -> every reason some capability passed it over for, once each; reasons that differ
    only in the capabilities they end by naming ("... in paged_decode") are one, naming each."""
    out: dict[str, dict[str, list[str]]] = {}  # name -> reason stem -> capabilities
    for rejected in rejected_by.values():
        for name, reasons in rejected.items():
            stems = out.setdefault(name, {})
            for r in reasons:
                m = _IN_CAPABILITY.fullmatch(r)
                if m is not None and all(c in CAPABILITIES for c in m.group(2).split(", ")):
                    caps = stems.setdefault(m.group(1) + " in ", [])
                    caps.extend(c for c in m.group(2).split(", ") if c not in caps)
                else:
                    stems.setdefault(r, [])
    return {name: [stem + ", ".join(caps) if caps else stem for stem, caps in stems.items()]
            for name, stems in out.items()}
