"""``Resource``: the lifecycle every KV manager and attention manager shares (DESIGN.md).

Per request: ``ingest_request`` (idempotent), ``reset_request``, ``remove_request``. Per step,
over a node's resources in ``depends_on()`` order: ``admit`` -> ``plan`` -> forward -> ``commit``,
with ``rollback_admit`` undoing exactly what this step's admit took when another resource
refused. The defaults here are right for a resource that needs no such hook.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.errors import InputError
from mstar_core.features import PLAIN, AttentionFeatures
from mstar_core.step import AdmitOutcome, Step, StepContext


@dataclass(frozen=True)
class BuildInfo:
    """What a node knows when it builds its resources: device, dtype, the model's shape, and
    the resources already built (by name), for those this one ``depends_on``."""

    device: torch.device
    dtype: torch.dtype = torch.float32
    num_layers: int = 1
    num_qo_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64
    built: Mapping[str, Resource] = field(default_factory=dict)
    # What the model's attention asks for (FP8 KV, soft-cap, sinks, per-layer windows, ...):
    # the KV manager stores accordingly, the attention managers select and plan with it.
    features: AttentionFeatures = PLAIN

    def dependency(self, name: str, owner: str) -> Resource:
        """The already-built resource ``name`` that ``owner`` builds over."""
        try:
            return self.built[name]
        except KeyError:
            raise InputError(f"{owner}.build: needs resource {name!r} built first; "
                             f"built so far: {sorted(self.built)}") from None


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = tuple(_DTYPES)  # the names as_dtype takes


def spec_required(spec: Mapping[str, Any], key: str, owner: str) -> Any:
    """``spec[key]``, or an error naming the missing key and the keys given."""
    if key not in spec:
        raise InputError(f"{owner}.build: spec needs {key!r}; got keys {sorted(spec)}")
    return spec[key]


def as_dtype(value: torch.dtype | str) -> torch.dtype:
    """A dtype given as ``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"`` (config files
    hold strings)."""
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise InputError(f"dtype {value!r} is not supported; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A ``--dtype`` option: ``"auto"`` is bfloat16 on CUDA and float32 elsewhere; any other name
    goes through :func:`as_dtype`."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return as_dtype(name)


class Resource:
    """Base of every step resource. Subclasses override what they need."""

    name: str = "resource"  # key in ctx.plan_results; instances may override

    @classmethod
    def build(cls, spec: Mapping[str, Any], info: BuildInfo) -> Resource:
        """Construct from a config ``spec`` and the node's ``info``."""
        raise NotImplementedError(f"{cls.__name__} does not support build(spec, info)")

    # -- per request -------------------------------------------------------------------------
    def ingest_request(self, rid: str, overrides: Mapping[str, Any] | None = None) -> None:
        """Must be idempotent: a request may be ingested once per partition it spans."""

    def reset_request(self, rid: str, free: bool = False) -> None:
        """Forget what ``rid`` computed so far (e.g. dummy ids after graph capture)."""

    def remove_request(self, rid: str) -> None:
        """Release everything ``rid`` holds. Removing an unknown request is a no-op."""

    # -- per step ----------------------------------------------------------------------------
    def admit(self, step: Step, ctx: StepContext) -> AdmitOutcome:
        """Reserve what ``step`` needs; refuse (as a value) when something is short."""
        return AdmitOutcome.ok()

    def rollback_admit(self, step: Step, ctx: StepContext) -> None:
        """Undo exactly what this step's ``admit`` took."""

    def plan(self, step: Step, ctx: StepContext) -> Any:
        """An immutable plan, opaque to the runner; stored in ``ctx.plan_results[self.name]``."""
        return None

    def commit(self, step: Step, ctx: StepContext) -> None:
        """Record the step's consumption after the forward ran."""

    # -- the step a forward runs ---------------------------------------------------------------
    # Plans are per step: while a runner runs a step's forward it binds that step's plan here,
    # so what the layers read (``current``) is the step being run, not the latest one planned
    # (``prepare(A); prepare(B); launch(A)`` and a step nested in a forward stay correct).
    def enter_plan(self, plan: Any) -> None:
        """Make ``plan`` (this resource's entry of a step's ``ctx.plan_results``) the one the
        layers read until the matching ``exit_plan``. Nests."""
        self.__dict__.setdefault("_bound_plans", []).append(plan)

    def exit_plan(self) -> None:
        self.__dict__["_bound_plans"].pop()

    def bound_plan(self) -> Any:
        """The plan of the step whose forward is running (innermost), None outside one."""
        stack = self.__dict__.get("_bound_plans")
        return stack[-1] if stack else None

    # -- identity and ordering ---------------------------------------------------------------
    def fingerprint(self) -> bytes | None:
        """What this resource adds to the prefix cache's root hash; None where it cannot change
        what a page holds."""
        return None

    def depends_on(self) -> tuple[str, ...]:
        """Names of resources that must be admitted and planned before this one."""
        return ()

    # -- capture -----------------------------------------------------------------------------
    def can_capture(self) -> bool:
        """Whether a step using this resource can be captured in a CUDA graph."""
        return False

    @property
    def supports_preplan(self) -> bool:
        """Whether ``plan`` for step N+1 may run while step N is in flight."""
        return False

    @property
    def force_double_buffer(self) -> bool:
        """Whether this resource needs double-buffered staging even off the pre-plan path
        (it stages a layout into a reused host buffer and copies it asynchronously)."""
        return False

    def build_accelerator_graph_buffers(self, slots: int, max_bs: int, max_seq_len: int) -> None:
        """Size what captured replays read. Grow-only: may be called many times."""

    def post_warmup_validate(self) -> None:
        """Check invariants after warm-up / capture; raise loudly when violated."""

    def cleanup(self) -> None:
        """Release device memory and host state."""
