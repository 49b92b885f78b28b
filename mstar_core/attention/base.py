"""``AttentionManager``: a resource that plans attention once per step and runs it per layer."""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.errors import InputError, InputTypeError, StateError
from mstar_core.resource import Resource


class AttentionManager(Resource):
    """Base of the paged and dense attention managers.

    ``build(spec, info)`` receives the wrapper class(es) the backend selection chose. A layer
    is written once for every backend::

        if attn.requires_kv_write:
            kv.write_kv(k, v, layer_idx=i, label=label)
        out = attn.run(q, label, kv.layer_view(i), k=k, v=v, layer_idx=i)
    """

    name = "attn"
    # The backend the wrappers come from (the selection's name, given by ``build`` or the
    # caller): named, with the wrapper, in a note on any exception a wrapper raises.
    backend_name: str | None = None
    kv: Any  # the KV manager whose plans this one's plans carry (``plan.kv_plan``)
    _current: Any = None  # the latest plan

    @property
    def requires_kv_write(self) -> bool:
        """Whether a layer must write this step's K/V through the KV resource before ``run``."""
        return True

    def depends_on(self) -> tuple[str, ...]:
        return ("kv",)

    @property
    def current(self) -> Any:
        """The plan of the step whose forward a runner is running (:meth:`Node.bound`), else the
        latest plan; refused once that plan's step (its ``kv_plan``) committed or rolled back."""
        plan = self.bound_plan()
        if plan is None:
            plan = getattr(self, "_current", None)
        if plan is None or not self.kv.is_live(plan.kv_plan):
            raise StateError(f"{type(self).__name__}: no step is planned (none yet, or its step was committed or "
                             "rolled back): admit and plan a step before run")
        return plan

    def run(
        self,
        q: torch.Tensor,
        label: str | None = None,
        kv_cache_layer: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        layer_idx: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's attention for ``label``'s packed queries ``[tokens, Hq, D]``; ``sinks``:
        the layer's sink logits ``[Hq]`` where the features ask for them."""
        raise NotImplementedError


def check_q(q: torch.Tensor, tokens: int, num_qo_heads: int, head_dim: int, dtype: torch.dtype, who: str) -> None:
    """Clear errors for the commonest misuse of ``run``: wrong shape or dtype of ``q``."""
    want = (tokens, num_qo_heads, head_dim)
    if tuple(q.shape) != want:
        raise InputError(f"{who}.run: q has shape {tuple(q.shape)}, expected {want} [tokens, Hq, D]")
    if q.dtype != dtype:
        raise InputTypeError(f"{who}.run: q has dtype {q.dtype}, expected {dtype} (the cache's dtype)")


def plan_kwargs(**kw: Any) -> dict[str, Any]:
    """Drop None values: wrappers take their own defaults for what the step leaves unset."""
    return {k: v for k, v in kw.items() if v is not None}


def blame(e: BaseException, backend: str | None, wrapper: Any, method: str) -> None:
    """Add a note to ``e`` naming the backend and wrapper method it came from (``wrapper``: the
    instance, or the class for its constructor); tracebacks and the CLI show it, and the
    exception itself is unchanged."""
    cls = wrapper if isinstance(wrapper, type) else type(wrapper)
    where = f"{cls.__module__}.{cls.__qualname__}.{method}"
    e.add_note(f"raised in {where} (attention backend {backend!r})" if backend else f"raised in {where}")
