"""What a backend declares: the capabilities it provides (as lazily loaded ``"module:attr"``
wrapper references), the devices, architectures, dtypes and head dims it runs, and a probe.
Capabilities are data, refusals are reasons (lists of strings, empty = can run)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.capabilities import CAPABILITIES
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


@dataclass(frozen=True)
class HeadDims:
    """Which head dims a backend runs: exactly ``values`` if given, else every multiple of
    ``multiple_of`` up to ``maximum`` (None: no bound)."""

    values: tuple[int, ...] | None = None
    multiple_of: int = 1
    maximum: int | None = None

    def reasons(self, head_dim: int) -> list[str]:
        if self.values is not None:
            if head_dim not in self.values:
                return [f"head_dim {head_dim} is not supported (supported: {self})"]
            return []
        if head_dim <= 0 or head_dim % self.multiple_of or (self.maximum is not None and head_dim > self.maximum):
            return [f"head_dim {head_dim} is not supported (supported: {self})"]
        return []

    def __str__(self) -> str:
        if self.values is not None:
            return ", ".join(map(str, self.values))
        if self.multiple_of == 1 and self.maximum is None:
            return "any"
        if self.multiple_of == 1:
            return f"up to {self.maximum}"
        step = f"multiples of {self.multiple_of}"
        return f"{step} up to {self.maximum}" if self.maximum is not None else step


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
    # Order among backends that no built-in auto list names (higher first, ties by name); see
    # selection.auto_order and docs/ARCHITECTURE.md.
    priority: int = 0
    # The plugin contract version this backend was written for (registry.api). A spec that
    # leaves it out is held to 1.0, the first versioned contract.
    api_version: str = "1.0"
    description: str = ""
    install_hint: str = ""
    distribution: str | None = None
    version: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.replace("_", "").replace("-", "").isalnum():
            raise InputError(f"backend name must be a non-empty identifier, got {self.name!r}")
        parse_api_version(self.api_version, f"backend {self.name!r}: api_version")
        if not is_int(self.priority):
            raise InputTypeError(f"backend {self.name!r}: priority must be an int (higher is tried first), "
                            f"got {self.priority!r}")
        unknown = sorted(set(self.provides) - set(CAPABILITIES))
        if unknown:
            raise InputError(f"backend {self.name!r} provides unknown capabilities {unknown}; "
                             f"known: {list(CAPABILITIES)}")
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
        # Plain copies so a plugin's later mutation cannot change them.
        object.__setattr__(self, "provides", dict(self.provides))
        object.__setattr__(self, "features", {c: tuple(n) for c, n in self.features.items()})

    def load(self, capability: str) -> Any:
        """Import and return the wrapper for ``capability`` (the kernel library loads here)."""
        if capability not in self.provides:
            raise UnknownName(f"backend {self.name!r} does not provide {capability!r}; "
                              f"it provides {list(self.provides)}")
        return load_ref(self.provides[capability])

    def supports(self, capability: str) -> tuple[str, ...]:
        """The features ``capability`` supports here (none if not declared)."""
        return self.features.get(capability, ())

    def declared_reasons(
        self, capabilities: Sequence[str] = (), dtype: torch.dtype | None = None, head_dim: int | None = None,
        features: AttentionFeatures | None = None,
    ) -> list[str]:
        """Reasons from declared data alone: capabilities, dtype, head_dim, features."""
        reasons = []
        missing = [c for c in capabilities if c not in self.provides]
        if missing:
            reasons.append(f"does not provide {', '.join(missing)} (provides: {', '.join(self.provides)})")
        if dtype is not None and dtype not in self.dtypes:
            supported = ", ".join(map(dtype_name, self.dtypes))
            reasons.append(f"dtype {dtype_name(dtype)} is not supported (supported: {supported})")
        if head_dim is not None:
            reasons.extend(self.head_dims.reasons(head_dim))
        if features is not None:
            reasons.extend(self.feature_reasons(capabilities, features))
        return reasons

    def feature_reasons(self, capabilities: Sequence[str], features: AttentionFeatures) -> list[str]:
        """One reason per requested feature some requested capability lacks, naming both (a
        feature is asked only of the capabilities it reaches: ``AttentionFeatures.lacking``)."""
        lacking = {c: features.lacking(c, self.supports(c)) for c in capabilities if c in self.provides}
        reasons = []
        for feature in features.requested():
            caps = [c for c, missing in lacking.items() if feature in missing]
            if caps:
                reasons.append(f"does not support feature {feature} ({FEATURES[feature]}) in {', '.join(caps)}")
        return reasons

    @property
    def label(self) -> str:
        """``distribution version`` for listings."""
        return f"{self.distribution or '?'} {self.version or '?'}"
