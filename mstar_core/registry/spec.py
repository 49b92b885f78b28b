"""What a backend declares: the capabilities it provides (as lazily loaded ``"module:attr"``
wrapper references), the devices, architectures, dtypes and head dims it runs, and a probe.
Capabilities are data, refusals are reasons (lists of strings, empty = can run)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.capabilities import CAPABILITIES, PAGED, PAGED_DECODE, PAGED_PREFILL
from mstar_core.errors import InputError, InputTypeError, UnknownName
from mstar_core.features import FEATURES, AttentionFeatures
from mstar_core.registry.api import parse_api_version
from mstar_core.step import is_int

# "cuda" is an NVIDIA device, "rocm" an AMD one (torch calls both device type "cuda").
DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "rocm")

Probe = Callable[[torch.device], Sequence[str]]


def load_ref(ref: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute (dotted attrs allowed)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"expected a 'module:attr' reference, got {ref!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _renamed(old: str, new: str) -> None:
    # HeadDims and BackendSpec are mstar_core.plugin names: their methods keep working until 3.0.
    warnings.warn(f"{old} is renamed {new}; the old name goes at plugin API 3.0", DeprecationWarning, stacklevel=3)


@dataclass(frozen=True)
class HeadDims:
    """Which head dims a backend runs: exactly ``values`` if given, else every multiple of
    ``multiple_of`` up to ``maximum`` (None: no bound)."""

    values: tuple[int, ...] | None = None
    multiple_of: int = 1
    maximum: int | None = None

    def refusal(self, head_dim: int) -> str | None:
        """Why ``head_dim`` is not one of these; None when it is."""
        if self.values is not None:
            ok = head_dim in self.values
        else:
            ok = head_dim > 0 and not head_dim % self.multiple_of and (self.maximum is None or head_dim <= self.maximum)
        return None if ok else f"head_dim {head_dim} is not supported (supported: {self})"

    def reasons(self, head_dim: int) -> list[str]:
        """Deprecated: :meth:`refusal` as a list."""
        _renamed("HeadDims.reasons", "HeadDims.refusal")
        refused = self.refusal(head_dim)
        return [] if refused is None else [refused]

    def __str__(self) -> str:
        if self.values is not None:
            return ", ".join(map(str, self.values))
        if self.multiple_of == 1 and self.maximum is None:
            return "any"
        if self.multiple_of == 1:
            return f"up to {self.maximum}"
        step = f"multiples of {self.multiple_of}"
        return f"{step} up to {self.maximum}" if self.maximum is not None else step


# The paged KV layout mstar's cache stores, by the name a backend declares (``kv_layout``): a
# layer is ``[pages, 2, page_size, kv_heads, head_dim]``, keys at ``[:, 0]``, values at ``[:, 1]``.
PAGED_NHD = "nhd"
KV_LAYOUTS: dict[str, str] = {PAGED_NHD: "[pages, 2, page_size, kv_heads, head_dim], keys at [:, 0], values at [:, 1]"}


@dataclass(frozen=True)
class CapabilitySpec:
    """What one capability runs where it differs from its backend's declaration (plugin API
    1.1): ``dtypes`` and ``head_dims`` (None: the backend's)."""

    dtypes: tuple[torch.dtype, ...] | None = None
    head_dims: HeadDims | None = None

    def __post_init__(self) -> None:
        if self.dtypes is not None:
            if isinstance(self.dtypes, torch.dtype) or not all(isinstance(d, torch.dtype) for d in self.dtypes):
                raise InputTypeError(f"CapabilitySpec: dtypes must be a tuple of torch dtypes, got {self.dtypes!r}")
            object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if self.head_dims is not None and not isinstance(self.head_dims, HeadDims):
            raise InputTypeError(f"CapabilitySpec: head_dims must be a HeadDims, got {self.head_dims!r}")


# Fields plugin API 1.0 did not have: a spec that sets one declares api_version "1.1" or newer.
API_1_1_FIELDS = ("per_capability", "kv_layout", "measured", "excludes")

ProbeRef = str | Probe | None
WarmupRef = str | Callable[..., Any] | None


@dataclass(frozen=True)
class BackendSpec:
    """One attention backend, as a plugin registers it.

    ``provides`` maps capability -> ``"module:attr"`` of the wrapper class (or function, for
    ``bounded``); nothing is imported until a selection loads it. ``probe`` (a callable or a
    ``"module:attr"`` reference to one) takes the device and returns the reasons the backend
    cannot run there that the declared data does not cover: library missing, version too old,
    a tiny call that fails. Its answer is cached per device by the registry.

    ``distribution`` and ``version`` are filled in by the registry from the entry point.
    """

    name: str
    provides: Mapping[str, str]
    devices: tuple[str, ...] = DEVICE_KINDS
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    head_dims: HeadDims = field(default_factory=HeadDims)
    # GPU architectures with a kernel ("sm90", "gfx942"); None: any of the listed devices.
    archs: tuple[str, ...] | None = None
    # CUDA only: the oldest compute capability with a kernel, e.g. (8, 0).
    min_compute_capability: tuple[int, int] | None = None
    # Capabilities whose wrappers can be captured in a CUDA graph.
    capturable: tuple[str, ...] = ()
    # Attention features (mstar_core.features.FEATURES) supported, per capability; a capability
    # not named supports none. Selection refuses a request for one that is not declared.
    features: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    probe: ProbeRef = None
    # Backends that compile kernels on first use: "module:attr" (or the callable) of
    # ``warmup(config, device, capabilities) -> list[WarmedKernel | str]`` (mstar_core.warmup), which
    # prepares every kernel a configuration uses. None: nothing to prepare.
    warmup: WarmupRef = None
    # Where auto tries it, higher first: one int, or capability -> int (a capability left out: 0);
    # see priority_for and docs/ARCHITECTURE.md.
    priority: int | Mapping[str, int] = 0
    # The plugin contract version this backend was written for (registry.api). A spec that
    # leaves it out is held to 1.0, the first versioned contract.
    api_version: str = "1.0"
    # Plugin API 1.1: capability -> CapabilitySpec, the dtypes and head dims of a capability
    # that runs fewer (or others) than ``dtypes`` / ``head_dims`` say.
    per_capability: Mapping[str, CapabilitySpec] = field(default_factory=dict)
    # Plugin API 1.1: the paged KV layout its paged capabilities read (KV_LAYOUTS); a backend
    # reading another is never picked over mstar's cache.
    kv_layout: str = PAGED_NHD
    # Plugin API 1.1: "module:attr" of a zero-argument function returning the backend's
    # measured kernel times (registry.measured.MeasuredTable), which order auto's candidates.
    measured: str | None = None
    # Plugin API 1.1: capability -> feature combinations its wrapper does not run together (each
    # feature declared alone), e.g. {"paged_decode": (("sink_logits", "soft_cap"),)}: a request
    # of all of one combination is refused, and the kit does not ask for it.
    excludes: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    description: str = ""
    install_hint: str = ""
    distribution: str | None = None
    version: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.replace("_", "").replace("-", "").isalnum():
            raise InputError(f"backend name must be a non-empty identifier, got {self.name!r}")
        version = parse_api_version(self.api_version, f"backend {self.name!r}: api_version")
        newer = [f for f in API_1_1_FIELDS if getattr(self, f) != _DEFAULTS[f]]
        if newer and version < (1, 1):
            raise InputError(f"backend {self.name!r}: {', '.join(newer)} came with plugin API 1.1, but the spec "
                             f"declares api_version {self.api_version!r}; declare api_version='1.1'")
        if not isinstance(self.kv_layout, str) or not self.kv_layout:
            raise InputTypeError(f"backend {self.name!r}: kv_layout must be a layout name such as {PAGED_NHD!r} "
                                 f"({KV_LAYOUTS[PAGED_NHD]}), got {self.kv_layout!r}")
        if self.measured is not None and (not isinstance(self.measured, str) or ":" not in self.measured):
            raise InputTypeError(f"backend {self.name!r}: measured must be 'module:attr' of a function returning its "
                                 f"MeasuredTable, got {self.measured!r}")
        unknown = sorted(set(self.provides) - set(CAPABILITIES))
        if unknown:
            raise InputError(f"backend {self.name!r} provides unknown capabilities {unknown}; "
                             f"known: {list(CAPABILITIES)}")
        self._check_priority()
        for cap, ref in self.provides.items():
            if not isinstance(ref, str) or ":" not in ref:
                raise InputError(f"backend {self.name!r}: provides[{cap!r}] must be 'module:attr', got {ref!r}")
        bad = sorted(set(self.devices) - set(DEVICE_KINDS))
        if bad:
            raise InputError(f"backend {self.name!r}: unknown devices {bad}; known: {list(DEVICE_KINDS)}")
        bad = sorted(set(self.capturable) - set(self.provides))
        if bad:
            raise InputError(f"backend {self.name!r}: capturable names capabilities it does not provide: {bad}")
        bad = sorted(set(self.features) - set(self.provides))
        if bad:
            raise InputError(f"backend {self.name!r}: features names capabilities it does not provide: {bad}")
        for cap, names in self.features.items():
            if isinstance(names, str):
                raise InputTypeError(f"backend {self.name!r}: features[{cap!r}] must be a tuple of feature names, got "
                                 f"the string {names!r}")
            unknown = sorted(set(names) - set(FEATURES))
            if unknown:
                raise InputError(f"backend {self.name!r}: features[{cap!r}] names unknown features {unknown}; known: "
                                 f"{list(FEATURES)}")
        if not isinstance(self.excludes, Mapping):
            raise InputTypeError(f"backend {self.name!r}: excludes must map capability names to tuples of feature "
                                 f"combinations, got {type(self.excludes).__name__}")
        for cap, combos in self.excludes.items():
            if cap not in self.provides:
                raise InputError(f"backend {self.name!r}: excludes names {cap!r}, which it does not provide")
            for combo in combos:
                if isinstance(combo, str) or len(combo) < 2:
                    raise InputError(f"backend {self.name!r}: excludes[{cap!r}] entries are tuples of two or more "
                                     f"feature names, got {combo!r}")
                undeclared = [f for f in combo if f not in self.features.get(cap, ())]
                if undeclared:
                    declared = list(self.features.get(cap, ()))
                    raise InputError(f"backend {self.name!r}: excludes[{cap!r}] names {undeclared}, which "
                                     f"features[{cap!r}] does not declare (declared: {declared})")
        object.__setattr__(self, "excludes", {c: tuple(tuple(x) for x in v) for c, v in self.excludes.items()})
        if not isinstance(self.per_capability, Mapping):
            raise InputTypeError(f"backend {self.name!r}: per_capability must map capability names to "
                                 f"CapabilitySpec, got {type(self.per_capability).__name__}")
        bad = sorted(set(self.per_capability) - set(self.provides))
        if bad:
            raise InputError(f"backend {self.name!r}: per_capability names capabilities it does not provide: {bad}")
        for cap, decl in self.per_capability.items():
            if not isinstance(decl, CapabilitySpec):
                raise InputTypeError(f"backend {self.name!r}: per_capability[{cap!r}] must be a CapabilitySpec, "
                                     f"got {type(decl).__name__} {decl!r}")
        # Plain copies so a plugin's later mutation cannot change them.
        object.__setattr__(self, "per_capability", dict(self.per_capability))
        object.__setattr__(self, "provides", dict(self.provides))
        object.__setattr__(self, "features", {c: tuple(n) for c, n in self.features.items()})

    def _check_priority(self) -> None:
        if isinstance(self.priority, Mapping):
            if parse_api_version(self.api_version) < (2, 0):
                raise InputError(f"backend {self.name!r}: a priority per capability came with plugin API 2.0, but "
                                 f"the spec declares api_version {self.api_version!r}; declare api_version='2.0' or "
                                 "give one int")
            bad = sorted(set(self.priority) - set(self.provides))
            if bad:
                raise InputError(f"backend {self.name!r}: priority names capabilities it does not provide: {bad}")
            for cap, value in self.priority.items():
                if not is_int(value):
                    raise InputTypeError(f"backend {self.name!r}: priority[{cap!r}] must be an int (higher is tried "
                                         f"first), got {value!r}")
            object.__setattr__(self, "priority", dict(self.priority))
        elif not is_int(self.priority):
            raise InputTypeError(f"backend {self.name!r}: priority must be an int or a mapping capability -> int "
                                 f"(higher is tried first), got {self.priority!r}")

    def priority_for(self, capability: str) -> int:
        """Where ``auto`` tries it for ``capability``, higher first: its ``priority`` entry for
        the capability (0 where a mapping leaves it out), or its one int."""
        if isinstance(self.priority, Mapping):
            return int(self.priority.get(capability, 0))
        return int(self.priority)

    def load(self, capability: str) -> Any:
        """Import and return the wrapper for ``capability`` (the kernel library loads here)."""
        if capability not in self.provides:
            raise UnknownName(f"backend {self.name!r} does not provide {capability!r}; "
                              f"it provides {list(self.provides)}")
        return load_ref(self.provides[capability])

    def supports(self, capability: str) -> tuple[str, ...]:
        """The features ``capability`` supports here (none if not declared)."""
        return self.features.get(capability, ())

    def dtypes_for(self, capability: str) -> tuple[torch.dtype, ...]:
        """The dtypes ``capability`` runs: its ``per_capability`` entry's, else the backend's."""
        decl = self.per_capability.get(capability)
        return self.dtypes if decl is None or decl.dtypes is None else decl.dtypes

    def head_dims_for(self, capability: str) -> HeadDims:
        """The head dims ``capability`` runs: its ``per_capability`` entry's, else the backend's."""
        decl = self.per_capability.get(capability)
        return self.head_dims if decl is None or decl.head_dims is None else decl.head_dims

    def multi_token_wrappers(self) -> tuple[str, ...]:
        """Which of its wrappers run uniform multi-token decode rows (``multi_token_decode``):
        from API 1.1, the capabilities that declare it (paged_decode, paged_prefill); a 1.0 spec
        declared it on paged_decode for rows its prefill wrapper ran, so that is its prefill."""
        declared = [c for c in (PAGED_DECODE, PAGED_PREFILL) if "multi_token_decode" in self.supports(c)]
        if parse_api_version(self.api_version) < (1, 1):
            return (PAGED_PREFILL,) if PAGED_DECODE in declared and PAGED_PREFILL in self.provides else ()
        return tuple(declared)

    def declared_refusals(
        self, capabilities: Sequence[str] = (), dtype: torch.dtype | None = None, head_dim: int | None = None,
        features: AttentionFeatures | None = None,
    ) -> list[str]:
        """Why its declared data alone refuses this request (``Registry.reasons`` adds the device,
        probe and imports): capabilities, dtype, head_dim (each capability's own where
        ``per_capability`` declares one: the reason names it), the KV layout of the paged
        capabilities, features."""
        reasons: list[str] = []
        missing = [c for c in capabilities if c not in self.provides]
        if missing:
            reasons.append(f"does not provide {', '.join(missing)} (provides: {', '.join(self.provides)})")
        provided = [c for c in capabilities if c in self.provides]
        judged: list[str | None] = [*provided] or [None]  # none asked: the backend's own declaration
        for cap in judged:
            own = f" in {cap}" if cap in self.per_capability else ""
            dtypes = self.dtypes if cap is None else self.dtypes_for(cap)
            if dtype is not None and dtype not in dtypes:
                reasons.append(f"dtype {dtype_name(dtype)} is not supported{own} (supported: "
                               f"{', '.join(map(dtype_name, dtypes))})")
            dims = self.head_dims if cap is None else self.head_dims_for(cap)
            refused = None if head_dim is None else dims.refusal(head_dim)
            if refused is not None:
                reasons.append(refused.replace(" is not supported", f" is not supported{own}", 1))
        if self.kv_layout != PAGED_NHD and any(c in PAGED for c in provided):
            reasons.append(f"reads KV layout {self.kv_layout!r}; mstar's paged cache stores {PAGED_NHD!r} "
                           f"({KV_LAYOUTS[PAGED_NHD]})")
        if features is not None:
            reasons.extend(self._feature_refusals(capabilities, features))
        return list(dict.fromkeys(reasons))

    def _feature_refusals(self, capabilities: Sequence[str], features: AttentionFeatures) -> list[str]:
        """One reason per requested feature some requested capability lacks, naming both (a
        feature is asked only of the capabilities it reaches: ``AttentionFeatures.lacking``)."""
        lacking = {c: features.lacking(c, self.supports(c)) for c in capabilities if c in self.provides}
        if PAGED_DECODE in lacking:  # multi-token rows run on whichever wrapper declares them
            # (a 1.0 spec's declaration on paged_decode alone, with no prefill wrapper, runs them nowhere)
            runs = ("multi_token_decode",) if self.multi_token_wrappers() else ()
            own = tuple(f for f in self.supports(PAGED_DECODE) if f != "multi_token_decode")
            lacking[PAGED_DECODE] = features.lacking(PAGED_DECODE, (*own, *runs))
        reasons = []
        for feature in features.requested():
            caps = [c for c, missing in lacking.items() if feature in missing]
            if caps:
                reasons.append(f"does not support feature {feature} ({FEATURES[feature]}) in {', '.join(caps)}")
        asked = set(features.requested())
        together: dict[tuple[str, ...], list[str]] = {}
        for c in lacking:
            for combo in self.excludes.get(c, ()):
                if asked.issuperset(combo):
                    together.setdefault(combo, []).append(c)
        reasons += [f"does not support features {' with '.join(combo)} together in {', '.join(caps)}"
                    for combo, caps in together.items()]
        return reasons

    def declared_reasons(self, capabilities: Sequence[str] = (), dtype: torch.dtype | None = None,
                         head_dim: int | None = None, features: AttentionFeatures | None = None) -> list[str]:
        """Deprecated: :meth:`declared_refusals`."""
        _renamed("BackendSpec.declared_reasons", "BackendSpec.declared_refusals")
        return self.declared_refusals(capabilities, dtype, head_dim, features)

    def feature_reasons(self, capabilities: Sequence[str], features: AttentionFeatures) -> list[str]:
        """Deprecated: part of :meth:`declared_refusals`."""
        _renamed("BackendSpec.feature_reasons", "BackendSpec.declared_refusals")
        return self._feature_refusals(capabilities, features)

    @property
    def label(self) -> str:
        """``distribution version`` for listings."""
        return f"{self.distribution or '?'} {self.version or '?'}"


_DEFAULTS: dict[str, Any] = {"per_capability": {}, "kv_layout": PAGED_NHD, "measured": None, "excludes": {}}
