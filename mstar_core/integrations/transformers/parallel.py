"""A transformers model over tensor-parallel ranks: the group it is sharded over, and mstar's own
head sharding of a model every rank holds whole.

A model loaded with transformers' tensor parallelism (``from_pretrained(...,
distributed_config=DistributedConfig(tp_size=N))``) holds DTensor weights whose mesh names its
group: each rank's attention already sees its heads, and mstar serves it as it is. A model that
every rank holds whole (random weights from one seed, a GGUF file, a model built in memory) is
sharded here by the model's own ``tp_plan``: its ``colwise`` linear layers keep their slice of the
output features, its ``rowwise`` ones their slice of the input features and an all-reduce, and
what the plan gathers or replicates (embeddings, LM head, per-head norms) stays whole. Plain
tensors, so the step can be captured in a CUDA graph and traced by ``torch.compile``.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.nn import functional

from mstar_core.distributed import TensorParallel, check_shardable
from mstar_core.errors import InputError, InputTypeError, StateError, UnsupportedModel
from mstar_core.integrations.transformers.probe import ModelAttention

log = logging.getLogger(__name__)

MARK = "_mstar_tensor_parallel"  # the attribute a model sharded by mstar carries its group in
SHARDED = {"colwise": 0, "rowwise": 1}  # plan style -> the Linear weight dimension it splits
# Styles that keep the module whole on every rank: the output is the same, at the cost of its memory.
WHOLE = frozenset({"colwise_gather_output", "colwise_rep", "embedding_rowwise", "embedding_colwise",
                   "replicated_with_grad_allreduce", "replicate"})


@dataclass(frozen=True)
class Sharding:
    """How a model is split: over ``tp``, by ``by`` (``"transformers"`` or ``"mstar"``)."""

    tp: TensorParallel
    by: str


def model_sharding(model: Any) -> Sharding | None:
    """The group ``model`` is sharded over, or None when it is whole."""
    mark = getattr(model, MARK, None)
    if isinstance(mark, TensorParallel):
        return Sharding(mark, "mstar")
    from torch.distributed.tensor import DTensor, Shard

    for p in model.parameters():
        if isinstance(p, DTensor) and any(isinstance(x, Shard) for x in p.placements):
            mesh = p.device_mesh
            if mesh.ndim != 1:
                raise UnsupportedModel(f"{type(model).__name__}'s weights are sharded over a {mesh.ndim}-D device "
                                       f"mesh {mesh.mesh_dim_names}; mstar serves tensor parallelism alone (one mesh "
                                       "dimension)")
            return Sharding(TensorParallel.from_group(mesh.get_group()), "transformers")
    return None


def _storage_bytes(model: Any) -> int:
    """The bytes of the distinct storages behind the model's parameters (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def compact_shards(model: Any) -> tuple[int, int]:
    """Give every DTensor weight whose local shard is a view of a larger tensor a storage of its
    own (transformers' sharded loading keeps the whole tensor a colwise or embedding shard was cut
    from, so each rank would hold up to the whole layer); ties stay tied. Returns the parameters'
    storage bytes before and after."""
    from torch.distributed.tensor import DTensor

    before = _storage_bytes(model)
    done: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if not isinstance(p, DTensor):
                    continue
                if id(p) not in done:
                    local = p.to_local()
                    if local.untyped_storage().nbytes() <= local.numel() * local.element_size():
                        continue
                    new = DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False,
                                             shape=p.shape, stride=p.stride())
                    done[id(p)] = torch.nn.Parameter(new, requires_grad=p.requires_grad)
                module._parameters[name] = done[id(p)]
    return before, _storage_bytes(model)


def group_for(model: Any, tp: int | TensorParallel | None, who: str = "generate") -> tuple[TensorParallel | None, bool]:
    """The ranks ``model`` runs over for ``tp``, and whether mstar must shard it there
    (:func:`shard`): None, the group it is sharded over (or none); an int, that many ranks of
    the default process group; a :class:`TensorParallel`, its group. Checks what needs no shard:
    the value, the head counts and the plan's layers against the rank count, the group's size."""
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, (int, TensorParallel))):
        raise InputTypeError(f"{who}: tp must be a rank count, a TensorParallel or None (the model's own sharding), "
                             f"got {tp!r}")
    if isinstance(tp, int) and tp < 1:
        raise InputError(f"{who}: tp must be a rank count >= 1, got {tp}")
    have = model_sharding(model)
    if tp is None:
        return (None if have is None else have.tp), False
    size = tp if isinstance(tp, int) else tp.world_size
    if have is not None:
        if have.tp.world_size != size:
            raise InputError(f"{who}: tp={size}, but {type(model).__name__} is sharded over {have.tp.world_size} "
                             f"ranks (by {have.by}); pass tp={have.tp.world_size} or None")
        if isinstance(tp, TensorParallel) and _ranks(tp) != _ranks(have.tp):
            raise InputError(f"{who}: tp is a group of ranks {_ranks(tp)}, but {type(model).__name__} is sharded over "
                             f"ranks {_ranks(have.tp)} (by {have.by}); pass that group or None")
        return have.tp, False
    if size == 1:
        return None, False
    check_shardable(size, *head_counts(model.config), who=who)  # before asking for a process group
    _targets(model, size, who)
    group = TensorParallel.from_group() if isinstance(tp, int) else tp
    if group.world_size != size:
        raise InputError(f"{who}: tp={size}, but the process group has {group.world_size} ranks (start one process "
                         "per rank: torchrun --nproc-per-node N)")
    return group, True


def _ranks(tp: TensorParallel) -> list[int]:
    """The global ranks of ``tp``'s group."""
    import torch.distributed as dist

    return dist.get_process_group_ranks(tp.group or dist.group.WORLD)


def per_rank(attention: ModelAttention, world: int) -> ModelAttention:
    """What a whole model's layers will ask for once sharded over ``world`` ranks: their heads'
    share."""
    layers = tuple(replace(x, qo_heads=x.qo_heads // world, kv_heads=x.kv_heads // world) for x in attention.layers)
    return replace(attention, layers=layers)


def head_counts(config: Any) -> tuple[int, int]:
    """``(query heads, KV heads)`` of the whole model, from its transformers config."""
    c = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    q = int(c.num_attention_heads)
    return q, int(getattr(c, "num_key_value_heads", None) or q)


def _targets(model: Any, world: int, who: str) -> list[tuple[str, torch.nn.Linear, str]]:
    """The linear layers the plan splits, with their style; refuses what mstar cannot split."""
    name = type(model).__name__
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise UnsupportedModel(f"{who}: {name} has no tensor-parallel plan (its tp_plan is empty), so mstar does not "
                               "know which layers to split; serve it on one rank")
    other = sorted({s for s in plan.values() if s not in SHARDED and s not in WHOLE})
    if other:
        raise UnsupportedModel(f"{who}: {name}'s tp_plan uses styles {other}, which mstar's own sharding does not "
                               f"apply (it splits {sorted(SHARDED)} linear layers and keeps {sorted(WHOLE)} whole); "
                               "load it with transformers' tensor parallelism: from_pretrained(..., "
                               "distributed_config=DistributedConfig(tp_size=N))")
    modules = dict(model.named_modules())
    out = []
    for pattern, style in plan.items():
        if style not in SHARDED:
            continue
        rx = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for n, m in modules.items():
            if not rx.fullmatch(n):
                continue
            if type(m) is not torch.nn.Linear:
                raise UnsupportedModel(f"{who}: {name}'s {n} is a {type(m).__name__}; its plan splits it {style}, "
                                       "and mstar splits plain torch.nn.Linear layers only")
            out.append((n, m, style))
    if not out:
        raise UnsupportedModel(f"{who}: no layer of {name} matches its tp_plan's colwise or rowwise entries")
    sizes = {n: m.weight.shape[SHARDED[style]] for n, m, style in out}
    uneven = {n: size for n, size in sizes.items() if size % world}
    if uneven:
        g = math.gcd(*sizes.values())
        n, size = next(iter(uneven.items()))
        raise InputError(f"{who}: cannot split {n} ({size} features) over {world} ranks (rank counts that split "
                         f"every layer of the plan: {', '.join(str(d) for d in range(1, g + 1) if g % d == 0)})")
    return out


def _check_replicas(model: Any, tp: TensorParallel, who: str) -> None:
    """Refuse to shard unless every rank holds the same weights (each keeps its slice of its own
    copy): one float64 sum per tensor, compared bit for bit."""
    named = [(n, p) for n, p in model.named_parameters()]
    sums = torch.stack([p.detach().sum(dtype=torch.float64).cpu() for _, p in named]).view(torch.int64).tolist()
    ranges = tp.ranges("the model's weights", dict(zip((n for n, _ in named), sums, strict=True)))
    bad = [n for n, (a, b) in ranges.items() if a != b]
    if bad:
        raise StateError(f"{who}: the ranks hold different weights ({len(bad)} tensors differ, first {bad[0]}); each "
                         "rank keeps its slice of its own copy, so every rank must load the same model (random "
                         "weights: the same seed)")


class _RowwiseForward:
    """A row-split linear layer's forward: this rank's partial product, summed over the ranks,
    then the bias once."""

    def __init__(self, module: torch.nn.Linear, tp: TensorParallel, name: str) -> None:
        self.module, self.tp, self.what = module, tp, f"the all-reduce after {name}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(functional.linear(x, self.module.weight), self.what)
        return y if self.module.bias is None else y + self.module.bias


def shard(model: Any, tp: TensorParallel, who: str = "generate") -> None:
    """Split a model that every rank holds whole by its ``tp_plan``, in place (see the module
    docstring). Everything is checked before a weight changes: the head counts and layer widths
    divide by the rank count, the plan's styles are ones mstar applies, the ranks' weights agree."""
    world = tp.world_size
    q, kv = head_counts(model.config)
    check_shardable(world, q, kv, who=who)
    targets = _targets(model, world, who)
    _check_replicas(model, tp, who)
    with torch.no_grad():
        for name, m, style in targets:
            dim = SHARDED[style]
            m.weight = torch.nn.Parameter(tp.shard(m.weight.data, dim), requires_grad=False)
            if style == "colwise":
                m.out_features //= world
                if m.bias is not None:
                    m.bias = torch.nn.Parameter(tp.shard(m.bias.data, 0), requires_grad=False)
            else:
                m.in_features //= world
                m.forward = _RowwiseForward(m, tp, name)  # type: ignore[method-assign,assignment]
    setattr(model, MARK, tp)
    log.info("%s sharded by mstar over %d ranks (rank %d): %d linear layers split by its tp_plan, %d query / %d KV "
             "heads a rank", type(model).__name__, world, tp.rank, len(targets), q // world, kv // world)


def check_heads(model: Any, qo_heads: int, kv_heads: int, tp: TensorParallel | None) -> None:
    """Refuse a sharded model whose layers do not call attention with their rank's share of the
    heads (an attention module that takes its head counts from the config, not its projections)."""
    if tp is None:
        return
    q, kv = head_counts(model.config)
    w = tp.world_size
    if (qo_heads * w, kv_heads * w) != (q, kv):
        raise UnsupportedModel(f"{type(model).__name__} sharded over {w} ranks calls attention with {qo_heads} query / "
                               f"{kv_heads} KV heads on rank {tp.rank}, not its share {q // w} / {kv // w} of {q} / "
                               f"{kv}: its attention does not shard by heads")
