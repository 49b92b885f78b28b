"""A pool of fixed-size per-request KV slots with sink + window retention.

Unlike the paged ``KVManager`` there is nothing to reserve per step and nothing to release: a
request takes a slot when it first runs and keeps it until removed (or reset while a step of it
is in flight: see the lifecycle below), the window is a ring overwritten in place, and a step's
layout is a small integer table computed on the host from the positions the step declares
(:mod:`.positions`, the ``"bounded"`` step part).

Storage per layer is ``[max_slots, rows, H, cap, 2D]``, ``cap = sink + window``, K and V side by
side in the last dim. A request's first ``sink`` tokens stay at cache indices ``0 .. sink - 1``;
every later position ``p`` goes to ``sink + (p - sink) % window``. Retained keys keep the
stream positions they were written at.

What a query at position ``p`` of a step starting at ``start`` sees (the full rule, with
``rel_bias`` and prefixes, is in :mod:`mstar_core.kernels.bounded_attention`): its prefix source
if any, the sinks, the ring (positions ``start - window .. start - 1``; within ``p -
query_window .. p`` when the config sets a query window), and its own step's keys causally. A
step longer than the window attends to all of its own keys, then writes only its sink positions
and its last ``window`` positions: the others would be overwritten within the step anyway.

Lifecycle: ``admit`` takes slots for requests new to the pool (refusing, as a value, when too
few are free); ``rollback_admit`` frees exactly those; ``plan`` builds the table; ``attend``
(every layer) computes attention then writes the step's keys; ``commit`` advances each stream.
Every slot is in exactly one place: held by a request, free, or parked. A request reset or
removed while a step of it is in flight no longer holds its slot, but the slot is not free
either: that step's forward may still write it (``attend`` writes by the plan's table, and a
replayed graph does so without the host seeing it), so it is parked, keyed by the request and
the epoch the step's admit recorded, until the step lands (its commit, which drops its span,
or its rollback) and then goes back to the free list. A request reset (``free=False``) that way
stays ingested without a slot and takes a fresh one, at length 0, at its next admit (refused,
as a value, when none is free). A step that never lands keeps its slot parked. With no step in
flight nothing is parked: a reset keeps the slot (length 0), a remove frees it at once.

What a step took is recorded in its ``StepContext`` and released exactly once:

- ``admit`` records, per request, the request's epoch (a manager-wide number, new whenever the
  request takes a slot or is reset) and whether it took its slot fresh. It is all or nothing:
  an admit that raises (bad input, or any exception midway) leaves slots, lengths, epochs and
  marks as they were. One context may gather admits of several different requests (the
  per-request cycle), then plan / commit them request by request.
- A request has at most one step in flight (admitted, neither committed nor rolled back):
  admitting it again, in another context or the same one, is an error. A reset or remove ends
  it: the request's slot is parked (above). The stale step's commit drops its span; its commit
  or rollback, whichever comes first (it consumes the record), returns the parked slot to the
  free list, once. The stale step's ``attend`` still runs: it reads and writes only the parked
  slot, which no one else holds, and sets no mark. A second admit of the request in the stale
  step's own context (whose record is keyed by request) is an error until that step lands.
- ``plan`` needs this context's live admit of every request it plans. ``commit`` consumes the
  record of its requests and raises where there is none (never admitted, committed already,
  rolled back); ``rollback_admit`` without a record does nothing (a runner may roll back twice).
- ``attend`` marks a slot whose ring it overwrote until the step commits; a mark is set only
  where the plan's request still holds that slot in the plan's epoch, and taking, resetting,
  parking or freeing a slot clears it, so a mark never outlives its request.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core import ops
from mstar_core.errors import InputError, InputIndexError, InputTypeError, StateError, UnknownName
from mstar_core.kernels.bounded_attention import Impl, bounded_attention, bounded_write, pick_impl
from mstar_core.kernels.bounded_attention import table as tb
from mstar_core.kv.bounded.config import BoundedKVConfig, RowLayout
from mstar_core.kv.bounded.plan import BoundedPlan, host_table
from mstar_core.kv.bounded.positions import BoundedStep, bounded_part
from mstar_core.resource import BuildInfo, Resource, as_dtype, spec_required
from mstar_core.step import AdmitOutcome, Shortage, Step, StepContext, is_int

log = logging.getLogger(__name__)

__all__ = ["BoundedKVManager", "BoundedPlan"]


@dataclass
class _Admitted:
    """What admits into one context did: the requests that took a slot fresh, and each admitted
    request's epoch (to recognise a reset or re-admission before commit / rollback). A request
    is in ``epochs`` from its admit until its commit or rollback consumes the record."""

    fresh: list[str] = field(default_factory=list)
    epochs: dict[str, int] = field(default_factory=dict)
    planned: set[str] = field(default_factory=set)  # the admitted requests a plan covered
    admits: dict[str, int] = field(default_factory=dict)  # each request's admit number


class BoundedKVManager(Resource):
    """Per-request sink + window slots. See the module docstring."""

    name = "bounded"

    def __init__(self, config: BoundedKVConfig, device: torch.device | str,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype if kv_dtype is not None else torch.get_default_dtype()
        self.impl: Impl = "auto"  # "reference" / "triton" force a kernel
        self.sm_scale: float | None = None  # None: 1/sqrt(head_dim)
        # Zeroed once so a never-written entry is finite; reset_request never zeroes again.
        self.storage = torch.zeros((config.num_layers, *config.layer_shape), dtype=self.kv_dtype, device=self.device)
        self.op_handle = ops.register(self)  # what a compiled graph names this manager by
        self._free: list[int] = list(range(config.max_slots - 1, -1, -1))  # pop() gives the lowest
        self._slot: dict[str, int] = {}
        self._length: dict[str, int] = {}
        self._requests: dict[str, dict[str, Any]] = {}
        self._current: BoundedPlan | None = None
        # Graph staging: one table buffer per staging slot; buffers replaced by a larger one
        # stay alive and keep being written, since graphs captured earlier read them.
        self._graph_tables: list[torch.Tensor] = []
        self._retired: list[list[torch.Tensor]] = []
        # slot -> the start of a step whose keys ``attend`` wrote into the ring but which was never
        # committed: the ring no longer holds the keys that slot's committed length says.
        self._uncommitted_writes: dict[int, int] = {}
        self._marked: BoundedPlan | None = None  # the plan whose writes were last marked (once, not per layer)
        # rid -> a manager-wide unique number, new whenever the request takes a slot or is reset:
        # a step admitted before that is recognised as stale at its commit / rollback.
        self._epoch: dict[str, int] = {}
        # (request, admit number) of every admit not yet landed (parked ones too): a plan is live
        # only while its own admit is (an epoch lasts across a request's steps: it cannot tell
        # a landed step from the next one).
        self._live_admits: set[tuple[str, int]] = set()
        self._admit_serials = itertools.count(1)
        self._epochs = itertools.count(1)
        # rid -> the epoch of its step in flight (admitted, neither committed nor rolled back).
        self._in_flight: dict[str, int] = {}
        # (rid, epoch of its step in flight) -> the slot it held when reset or removed: that
        # step may still write it, so it is neither held nor free until the step lands.
        self._parked: dict[tuple[str, int], int] = {}
        # Counts the events that can end a step's time in flight (commit, rollback, reset, remove):
        # ``attend`` checks that its plan is live once per plan and count, not once per layer.
        self._landings = 0
        self._seen_live: tuple[BoundedPlan, int] | None = None

    # Attention features (mstar_core.features) the bounded kernels implement: none yet. Their
    # reference and Triton kernels take no soft-cap, sink logits or FP8 slots; asking for one is
    # refused at build rather than computed without it.
    FEATURES: tuple[str, ...] = ()

    @classmethod
    def build(cls, spec: Mapping[str, Any], info: BuildInfo) -> BoundedKVManager:
        lacking = info.features.lacking("bounded", cls.FEATURES)
        if lacking:
            raise InputError(
                f"{cls.__name__}.build: the bounded kernels (reference and Triton) do not support feature(s) "
                f"{', '.join(lacking)} requested by the model's features ({info.features}); they support "
                f"{', '.join(cls.FEATURES) or 'none'}")
        qw = spec.get("query_window")
        cfg = BoundedKVConfig(
            num_layers=int(spec.get("num_layers", info.num_layers)),
            max_slots=int(spec_required(spec, "max_slots", cls.__name__)),
            rows=int(spec.get("rows", 1)),
            num_heads=int(spec.get("num_heads", info.num_kv_heads)),
            head_dim=int(spec.get("head_dim", info.head_dim)),
            sink=int(spec.get("sink", 0)),
            window=int(spec_required(spec, "window", cls.__name__)),
            query_window=None if qw is None else int(qw),
        )
        mgr = cls(cfg, info.device, as_dtype(spec.get("kv_dtype", info.dtype)))
        mgr.name = spec.get("name", cls.name)
        mgr.impl = spec.get("impl", "auto")
        mgr.sm_scale = spec.get("sm_scale")
        return mgr

    # -- requests ----------------------------------------------------------------------------
    @property
    def requests(self) -> tuple[str, ...]:
        return tuple(self._requests)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def parked_slots(self) -> dict[tuple[str, int], int]:
        """``(request, epoch of its stale step) -> slot``: slots of requests reset or removed with
        a step in flight, waiting for that step to land (a copy)."""
        return dict(self._parked)

    def slot_of(self, rid: str) -> int | None:
        return self._slot.get(rid)

    def length(self, rid: str) -> int:
        """Tokens committed to ``rid``'s stream."""
        return self._length.get(rid, 0)

    def ingest_request(self, rid: str, overrides: Mapping[str, Any] | None = None) -> None:
        """Must be idempotent: the conductor sends one NewRequest per partition, so a worker
        serving several partitions of a request ingests it once for each, possibly after a node
        has already run a step for it. A second ingest changes nothing (slot and length stay)."""
        self._requests.setdefault(rid, dict(overrides or {}))

    def _give_back(self, slot: int) -> None:
        self._uncommitted_writes.pop(slot, None)
        self._free.append(slot)
        self._free.sort(reverse=True)

    def _release(self, rid: str) -> None:
        """``rid`` no longer holds a slot (nor a length, epoch or step in flight). Its slot goes
        back to the free list, or, with a step in flight, is parked until that step lands."""
        self._landings += 1
        self._epoch.pop(rid, None)
        epoch = self._in_flight.pop(rid, None)
        slot = self._slot.pop(rid, None)
        self._length.pop(rid, None)
        if slot is None:
            return
        if epoch is None:
            self._give_back(slot)
        else:
            self._uncommitted_writes.pop(slot, None)
            self._parked[(rid, epoch)] = slot

    def _unpark(self, rid: str, epoch: int) -> None:
        """A step of ``rid`` admitted in ``epoch`` landed (commit or rollback) after its request
        was reset or removed: the slot parked for it goes back, once."""
        slot = self._parked.pop((rid, epoch), None)
        if slot is not None:
            log.debug("%s: stale step of request %r landed; its parked slot %d goes back", self.name, rid, slot)
            self._give_back(slot)

    def reset_request(self, rid: str, free: bool = False) -> None:
        """Nothing to zero: a slot's contents are only read where a later position says they
        were written. The stream restarts at position 0 in the same slot; ``free=True`` also
        gives the slot back and forgets the request (it must be ingested again). With a step of
        the request in flight, its slot is parked instead (the module docstring): the request
        (unless ``free``) stays ingested and takes a fresh slot at its next admit."""
        if free:
            self._release(rid)
            self._requests.pop(rid, None)
        elif rid in self._in_flight:
            self._release(rid)  # parked: the stale step may still write it
        elif rid in self._length:
            self._length[rid] = 0
            self._epoch[rid] = next(self._epochs)
            self._uncommitted_writes.pop(self._slot[rid], None)  # position 0 retains nothing

    def remove_request(self, rid: str) -> None:
        """Free the request's slot (parked, with a step in flight) and forget it; an unknown
        ``rid`` is a no-op."""
        if rid not in self._requests and rid not in self._slot:
            log.debug("remove_request(%r): unknown request, nothing to do", rid)
            return
        self._release(rid)
        self._requests.pop(rid, None)

    # -- step --------------------------------------------------------------------------------
    def _part(self, step: Step) -> BoundedStep:
        part = bounded_part(step)
        unknown = [r for r in part.request_ids if r not in self._requests]
        if unknown:
            raise UnknownName(f"{self.name}: requests {unknown} were never ingested; "
                              f"ingested: {sorted(self._requests)}")
        return part

    def admit(self, step: Step, ctx: StepContext) -> AdmitOutcome:
        """Take a slot for each request new to the pool, all or nothing; a refusal names the
        shortage (total, then each request that would need a slot). Raises for a request that
        already has a step in flight. An exception leaves the manager and ``ctx`` as they were:
        the new state is built on copies and swapped in at the end."""
        part = self._part(step)
        rids = part.request_ids
        busy = [r for r in rids if r in self._in_flight]
        if busy:
            raise StateError(
                f"{self.name}: request(s) {busy} already have a step in flight (admitted, neither committed "
                f"nor rolled back); commit or roll back that step before admitting again"
            )
        old = self._record(ctx)
        # A step of a request reset or removed since, admitted in this very context and not landed
        # yet: a second admit here would overwrite its record (keyed by request), and its parked
        # slot would never go back.
        stale = [r for r in rids if old is not None and r in old.epochs]
        if stale:
            raise StateError(
                f"{self.name}: request(s) {stale} have a step admitted in this context and reset or removed "
                f"since, neither committed nor rolled back; commit or roll back that step before admitting again"
            )
        fresh = [rid for rid in rids if rid not in self._slot]
        free = len(self._free)
        if len(fresh) > free:
            return AdmitOutcome.refuse(
                Shortage(self.name, "slots", len(fresh), free),
                *(Shortage(self.name, "slots", 1, free, rid) for rid in fresh),
            )
        free_slots, slots, lengths, epochs = list(self._free), dict(self._slot), dict(self._length), dict(self._epoch)
        marks, in_flight = dict(self._uncommitted_writes), dict(self._in_flight)
        rec = _Admitted() if old is None else _Admitted(list(old.fresh), dict(old.epochs), set(old.planned),
                                                         dict(old.admits))
        serial, live = next(self._admit_serials), set(self._live_admits)
        for rid in fresh:
            slot = free_slots.pop()
            slots[rid], lengths[rid], epochs[rid] = slot, 0, next(self._epochs)
            marks.pop(slot, None)  # a fresh slot starts clean, whatever happened to it before
        for rid in rids:
            in_flight[rid] = rec.epochs[rid] = epochs[rid]
            rec.admits[rid] = serial
            live.add((rid, serial))
        # One context may gather several admits (the per-request cycle) of different
        # requests: merge (a request already recorded here was refused above).
        rec.fresh = [r for r in rec.fresh if r not in fresh] + fresh
        ctx.admitted[self.name] = rec  # the one write that may fail (ctx is the caller's): first
        self._free, self._slot, self._length, self._epoch = free_slots, slots, lengths, epochs
        self._uncommitted_writes, self._in_flight, self._live_admits = marks, in_flight, live
        return AdmitOutcome.ok()

    def _record(self, ctx: StepContext) -> _Admitted | None:
        rec = ctx.admitted.get(self.name)
        if rec is not None and not isinstance(rec, _Admitted):
            raise InputTypeError(f"{self.name}: ctx.admitted[{self.name!r}] is a {type(rec).__name__}, not this "
                            f"manager's admit record: two resources share the name {self.name!r}?")
        return rec

    def _admitted(self, ctx: StepContext, rids: tuple[str, ...], what: str) -> _Admitted | None:
        """This context's admit record, covering every request of ``rids``; an error naming the
        requests otherwise (``what`` formatted with them), before anything changes."""
        rec = self._record(ctx)
        missing = [r for r in rids if rec is None or r not in rec.epochs]
        if missing:
            raise StateError(
                f"{self.name}: {what.format(missing)} without a live admit in this context "
                "(never admitted, committed already, or rolled back): a step is admitted once and commits once"
            )
        return rec

    def _live(self, rec: _Admitted | None, rid: str) -> bool:
        """Whether ``rid`` is still as the admit recorded in ``rec`` found it (not reset, or
        removed and re-admitted, since); never without a record."""
        return rec is not None and rec.epochs.get(rid) is not None and rec.epochs[rid] == self._epoch.get(rid)

    def _forget_admitted(self, ctx: StepContext, rids: set[str]) -> None:
        self._landings += 1
        rec = self._record(ctx)
        if rec is None:
            return
        rec.fresh[:] = [r for r in rec.fresh if r not in rids]
        rec.planned -= rids
        for r in rids:
            rec.epochs.pop(r, None)
            self._live_admits.discard((r, rec.admits.pop(r, -1)))
        if not rec.fresh and not rec.epochs:
            del ctx.admitted[self.name]

    def rollback_admit(self, step: Step, ctx: StepContext) -> None:
        """Free the slots this step's admit took fresh (a slot a request already held stays with
        it) and end the step's time in flight; a request reset or removed since gets its parked
        slot back to the free list. Without an admit record (never admitted, already committed
        or rolled back): nothing to do."""
        rec = self._record(ctx)
        if rec is None:
            return
        mine = {r for r in bounded_part(step).request_ids if r in rec.epochs}
        for rid in [r for r in rec.epochs if r in mine]:
            if not self._live(rec, rid):  # reset or removed since: only its parked slot is this step's
                log.debug("%s: rollback_admit: request %r changed since admit", self.name, rid)
                self._unpark(rid, rec.epochs[rid])
                continue
            self._in_flight.pop(rid, None)
            if rid in rec.fresh:
                self._release(rid)
        self._forget_admitted(ctx, mine)

    def plan(self, step: Step, ctx: StepContext) -> BoundedPlan:
        """The step's table (ret is immutable and opaque to the runner; it only goes to
        ``ctx.plan_results``). Every request must have been admitted in ``ctx`` and be
        unchanged since (not reset or removed)."""
        part = self._part(step)
        rec = self._admitted(ctx, part.request_ids, "plan before admit: request(s) {}")
        assert rec is not None or not part.positions
        stale = [r for r in part.request_ids if not self._live(rec, r)]
        if stale:
            raise StateError(
                f"{self.name}: request(s) {stale} were reset or removed after this step's admit; "
                f"roll the step back and admit it again"
            )
        rows: list[tuple[int, RowLayout, int]] = []
        for p in part.positions:
            slot = self._slot.get(p.request_id)
            if slot is None:  # cannot happen for a live admit; kept as a loud guard
                raise StateError(f"{self.name}: plan before admit: request {p.request_id!r} holds no slot")
            length = self._length[p.request_id]
            if slot in self._uncommitted_writes:
                raise StateError(
                    f"{self.name}: request {p.request_id!r}: a step from position {self._uncommitted_writes[slot]} "
                    f"wrote its keys into the ring and was never committed, so the ring no longer holds what "
                    f"its committed length ({length}) says; reset_request({p.request_id!r}) and recompute"
                )
            if p.start is not None and p.start != length:
                raise InputError(
                    f"{self.name}: request {p.request_id!r} declares start {p.start}, but its stream "
                    f"holds {length} committed tokens"
                )
            slen = 0 if p.source is None else (tb.ALL_SOURCE if p.source_len is None else p.source_len)
            rows.append((slot, self.config.row_layout(length, p.num_tokens, slen, p.commit), p.source_code))
        frozen = tuple(rows)
        plan = BoundedPlan(
            table=self._stage(host_table(frozen), ctx),
            rows=frozen,
            max_retained=max((lay.retained for _, lay, _ in frozen), default=0),
            max_span=max((lay.num_tokens for _, lay, _ in frozen), default=0),
            reads_source=any(src >= 0 for _, _, src in frozen),
            reads_row_source=any(src == tb.ROW_SOURCE for _, _, src in frozen),
            owners=() if rec is None else tuple((r, rec.epochs[r]) for r in part.request_ids),
            admits=() if rec is None else tuple(rec.admits[r] for r in part.request_ids),
        )
        if rec is not None:
            rec.planned.update(part.request_ids)
        self._current = plan
        return plan

    def is_live(self, plan: BoundedPlan) -> bool:
        """Whether ``plan``'s step is still in flight for every request it covers (admitted, neither
        committed nor rolled back; a request reset since keeps its parked slot until then): what
        ``attend`` may read and write through."""
        return all((rid, n) in self._live_admits for (rid, _), n in zip(plan.owners, plan.admits, strict=True))

    def _stage(self, host: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The table on the device. An eager step (``ctx.bucket`` None) gets a fresh tensor,
        shared with no other plan. A graph step is staged into the table buffer of its staging
        slot ``ctx.slot`` -- the one its graph was captured reading -- padded with no-op rows
        (so a replay for a larger bucket does nothing more); it stays valid until the next
        plan into that slot, which is why consecutive graph steps alternate slots."""
        B = host.shape[0]
        if ctx.bucket is None:
            return host.to(self.device)
        if not self._graph_tables:
            raise StateError(f"{self.name}: a graph step (bucket {ctx.bucket}) "
                             "needs build_accelerator_graph_buffers first")
        if not 0 <= ctx.slot < len(self._graph_tables):
            raise InputError(f"{self.name}: staging slot {ctx.slot} out of range: {len(self._graph_tables)} slots")
        i = ctx.slot
        size = self._graph_tables[i].shape[0]
        if max(B, ctx.bucket) > size:
            raise InputError(f"{self.name}: graph step of {B} requests for bucket {ctx.bucket}; the table buffers "
                             f"hold {size} (build_accelerator_graph_buffers max_bs)")
        padded = torch.tensor(tb.NOOP_ROW, dtype=torch.int32).repeat(size, 1)
        padded[:B] = host
        for buf in (*self._retired[i], self._graph_tables[i]):
            buf.copy_(padded[: buf.shape[0]].to(self.device, non_blocking=False))
        return self._graph_tables[i][:B]

    @property
    def current(self) -> BoundedPlan:
        """What ``attend`` uses when given none: the plan of the step whose forward a runner is
        running (:meth:`Node.bound`), else the latest plan."""
        plan = self.bound_plan()
        if plan is None:
            plan = self._current
        if plan is None:
            raise StateError(f"{self.name}: no step is planned: admit and plan a step before attend")
        return plan

    def commit(self, step: Step, ctx: StepContext) -> None:
        """Record the step's consumption: committed streams advance by their tokens. Consumes the
        admit record of the step's requests; a request without one (never admitted, committed
        already or rolled back) is an error, raised before anything changes. A request reset or
        removed since its admit has its span dropped, and its parked slot goes back."""
        part = bounded_part(step)
        rec = self._admitted(ctx, part.request_ids, "commit of request(s) {}")
        assert rec is not None or not part.positions
        unplanned = [r for r in part.request_ids if rec is not None and r not in rec.planned]
        if unplanned:
            raise StateError(f"{self.name}: commit of request(s) {unplanned}, admitted but never planned: plan the "
                             "step (and run its forward) before commit, or roll it back")
        for p in part.positions:
            rid = p.request_id
            if rec is None or not self._live(rec, rid):
                log.info("%s: commit: request %r was reset or removed after admit; its span is dropped",
                         self.name, rid)
                if rec is not None:
                    self._unpark(rid, rec.epochs[rid])
                continue
            self._in_flight.pop(rid, None)
            if p.commit:
                self._length[rid] += p.num_tokens
                self._uncommitted_writes.pop(self._slot[rid], None)
        # Only this step's requests: in the per-request cycle one
        # context may still hold the fresh slots of requests whose turn has not come.
        self._forget_admitted(ctx, set(part.request_ids))

    # -- data --------------------------------------------------------------------------------
    def layer(self, layer_idx: int) -> torch.Tensor:
        """One layer's slots, ``[max_slots, rows, H, cap, 2D]``."""
        return self.storage[self._layer_index(layer_idx, "layer")]

    def _layer_index(self, layer_idx: object, where: str) -> int:
        """``layer_idx`` checked: an int in ``0 .. num_layers - 1`` (no negative indexing: -1 must
        not silently address the last layer)."""
        n = self.config.num_layers
        if not is_int(layer_idx):
            raise InputTypeError(f"{self.name}.{where}: layer_idx must be an int in 0..{n - 1}, "
                            f"got {type(layer_idx).__name__} {layer_idx!r}")
        i = int(layer_idx)
        if not 0 <= i < n:
            raise InputIndexError(f"{self.name}.{where}: layer_idx {i} out of range: {n} layers (0..{n - 1})")
        return i

    def _check_tensors(self, **tensors: torch.Tensor | None) -> None:
        """Each given tensor is a tensor on the cache's device."""
        dev = self.storage.device
        for name, t in tensors.items():
            if t is None and name not in ("q", "k", "v"):
                continue
            if not isinstance(t, torch.Tensor):
                raise InputTypeError(f"{self.name}.attend: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != dev:
                raise InputError(f"{self.name}.attend: {name} is on {t.device}, the cache on {dev}: "
                                 f"q, k, v, source, row_source storage and rel_bias must be on the cache's device")

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        source: torch.Tensor | None = None,
        plan: BoundedPlan | None = None,
        rel_bias: torch.Tensor | None = None,
        ieee: bool = False,
        row_source: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention for ``q``, ``k``, ``v`` ``[B * rows, H, T, D]`` over each row's retained
        keys (``source [sources, rows, H, L, 2D]`` is this layer's source prefixes, each row's
        picked by its ``StreamPosition.source``) and this step's own, then this step's keys into
        the slots. Returns ``[B * rows, T, H, D]``. ``plan`` defaults to the step's. ``rel_bias``
        is a per-distance score term (``kernels.bounded_attention``); with a query window it is
        ``[B * rows, H, T, window + 1]``. Rows whose source is -1 read theirs from
        ``row_source = (storage [slots, rows, H, L, 2D], slots [>= B])``. ``q`` may have a
        multiple of the cache's heads (GQA). Under ``torch.compile`` (with ``plan`` None: the bound
        step's) this is the op ``mstar::bounded_attend`` (:mod:`mstar_core.ops`)."""
        if torch.compiler.is_compiling() and plan is None:
            rs, slots = (None, None) if row_source is None else row_source
            return ops.bounded_attend(q, k, v, self.storage, self.op_handle, layer_idx, source, rel_bias, ieee, rs,
                                      slots)
        return self.attend_eager(self.storage, layer_idx, q, k, v, source, plan, rel_bias, ieee, row_source)

    def attend_eager(self, storage: torch.Tensor, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, source: torch.Tensor | None, plan: BoundedPlan | None,
                     rel_bias: torch.Tensor | None, ieee: bool,
                     row_source: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """:meth:`attend` outside a compiled graph, over ``storage``: the slots, or the copy of
        them a compiled graph passed."""
        layer_idx = self._layer_index(layer_idx, "attend")
        if plan is not None and not isinstance(plan, BoundedPlan):
            raise InputTypeError(f"{self.name}.attend: plan must be a BoundedPlan or None, got {type(plan).__name__}")
        if row_source is not None and (not isinstance(row_source, tuple) or len(row_source) != 2):
            raise InputTypeError(f"{self.name}.attend: row_source must be a (storage, slots) tuple, "
                                 f"got {type(row_source).__name__}")
        self._check_tensors(q=q, k=k, v=v, source=source, rel_bias=rel_bias,
                            row_source_storage=None if row_source is None else row_source[0])
        plan = self.current if plan is None else plan
        seen = self._seen_live
        if (seen is None or seen[0] is not plan or seen[1] != self._landings) and not self.is_live(plan):
            raise StateError(f"{self.name}.attend: no step is planned: this plan's step (requests "
                             f"{[r for r, _ in plan.owners]}) was committed or rolled back; admit and plan a step "
                             "before attend")
        self._seen_live = (plan, self._landings)  # once per plan, not per layer, until a step lands
        cfg = self.config
        B = plan.batch
        if q.dim() != 4 or q.shape[0] != B * cfg.rows:
            raise InputError(f"{self.name}.attend: q must be [B * rows = {B * cfg.rows}, H, T, D], "
                             f"got {tuple(q.shape)}")
        if q.shape[2] < plan.max_span:
            raise InputError(f"{self.name}.attend: T = {q.shape[2]} is shorter than the step's longest span "
                             f"{plan.max_span}")
        if tuple(k.shape[1:2]) != (cfg.num_heads,) or k.shape[3] != cfg.head_dim:
            raise InputError(f"{self.name}.attend: k must be [B * rows, {cfg.num_heads}, T, {cfg.head_dim}], "
                             f"got {tuple(k.shape)}")
        self._check_sources(plan, source, row_source)
        layer = storage[layer_idx]
        geo = dict(sink=cfg.sink, window=cfg.window)
        out = bounded_attention(
            q, k, v, layer, plan.table, **geo, query_window=cfg.query_window,
            source=source if plan.reads_source else None,
            row_source=row_source if plan.reads_row_source else None,
            rel_bias=rel_bias, sm_scale=self.sm_scale, ieee=ieee, impl=self.impl,
        )
        bounded_write(layer, k, v, plan.table, **geo, impl=self.impl)
        if plan is not self._marked:  # every layer writes the same slots: mark them at the first
            self._marked = plan
            # Only where the row's request still holds that slot in the plan's epoch: a request
            # reset or removed since (its slot maybe free, or another's) gets no mark. Padding rows
            # (past the owners) are never marked.
            for (slot, lay, _), (rid, epoch) in zip(plan.rows, plan.owners, strict=False):
                if lay.commit and lay.num_tokens and self._slot.get(rid) == slot and self._epoch.get(rid) == epoch:
                    self._uncommitted_writes[slot] = lay.start
        return out

    def _check_sources(self, plan: BoundedPlan, source: torch.Tensor | None,
                       row_source: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        # Host-side checks from the plan's mirror: the kernels trust the table. Row-source slot
        # indices are checked when they are on the host; on the device, reading them would
        # synchronise every layer (and cannot happen inside a graph capture), so they are trusted.
        host_slots = None
        if row_source is not None and row_source[1].device.type == "cpu":
            host_slots = row_source[1].tolist()
        for b, (slot, lay, src) in enumerate(plan.rows):
            if src == tb.NO_SOURCE:
                continue
            if src == tb.ROW_SOURCE and host_slots is not None and row_source is not None:
                n = row_source[0].shape[0]
                if b >= len(host_slots) or not 0 <= host_slots[b] < n:
                    got = host_slots[b] if b < len(host_slots) else "none"
                    raise InputError(f"{self.name}.attend: row_source slots[{b}] = {got} is out of range: "
                                     f"its storage holds {n} entries (0..{n - 1})")
            store = source if src >= 0 else (row_source[0] if row_source is not None else None)
            what = f"source[{src}]" if src >= 0 else "row_source"
            if store is None:
                raise InputError(f"{self.name}.attend: the plan reads {what} (slot {slot}) but none was given")
            if src >= store.shape[0]:
                raise InputError(f"{self.name}.attend: source index {src} out of range: {store.shape[0]} sources")
            if lay.source_len > store.shape[3]:
                raise InputError(f"{self.name}.attend: source_len {lay.source_len} exceeds {what}'s length "
                                 f"{store.shape[3]}")

    # -- capture -----------------------------------------------------------------------------
    def can_capture(self) -> bool:
        # The Triton path makes no host synchronisation; the reference does (nonzero()).
        return pick_impl(self.device, self.impl) == "triton"

    def build_accelerator_graph_buffers(self, slots: int, max_bs: int, max_seq_len: int) -> None:
        """Size whatever the captured replays will read: one ``[max_bs, NUM_COLS]`` table per
        staging slot (``max_seq_len`` does not matter: a slot's size is fixed).

        Called once per runner that captures against this node, so repeatable and grow-only: a
        larger ask allocates a larger buffer, and the smaller one stays alive and keeps being
        written, because graphs captured earlier read it."""
        if slots < 1 or max_bs < 1:
            raise InputError(f"{self.name}: need slots >= 1 and max_bs >= 1, got slots={slots}, max_bs={max_bs}")
        noop = torch.tensor(tb.NOOP_ROW, dtype=torch.int32)
        while len(self._graph_tables) < slots:
            size = self._graph_tables[0].shape[0] if self._graph_tables else max_bs
            self._graph_tables.append(noop.repeat(size, 1).to(self.device))
            self._retired.append([])
        for i, buf in enumerate(self._graph_tables):
            if buf.shape[0] < max_bs:
                self._retired[i].append(buf)
                self._graph_tables[i] = noop.repeat(max_bs, 1).to(self.device)

    def post_warmup_validate(self) -> None:
        """Fail loudly when slot accounting is broken."""
        held, parked = list(self._slot.values()), list(self._parked.values())
        every = held + self._free + parked
        if len(every) != self.config.max_slots or set(every) != set(range(self.config.max_slots)):
            raise StateError(
                f"{self.name}: slot accounting broken: {len(held)} held ({len(set(held))} distinct), "
                f"{len(self._free)} free ({len(set(self._free))} distinct), {len(parked)} parked "
                f"({len(set(parked))} distinct), {self.config.max_slots} slots"
            )
        live = [k for k in self._parked if self._epoch.get(k[0]) == k[1]]
        if live:
            raise StateError(f"{self.name}: slots parked for steps whose requests are unchanged since admit: {live}")
        stray = [r for r in self._slot if r not in self._requests]
        if stray:
            raise StateError(f"{self.name}: slots held by requests never ingested: {stray}")
        loose = sorted(set(self._uncommitted_writes) - set(held))
        if loose:
            raise StateError(f"{self.name}: uncommitted-write marks on slots no request holds: {loose}")
        adrift = [r for r, e in self._in_flight.items() if self._epoch.get(r) != e]
        if adrift:
            raise StateError(f"{self.name}: steps in flight for requests reset or without a slot: {adrift}")
        sizes = {b.shape[0] for b in self._graph_tables}
        if len(sizes) > 1:
            raise StateError(f"{self.name}: graph table buffers differ in size: {sorted(sizes)}")

    def cleanup(self) -> None:
        self._slot.clear()
        self._length.clear()
        self._requests.clear()
        self._free = list(range(self.config.max_slots - 1, -1, -1))
        self._graph_tables.clear()
        self._retired.clear()
        self._uncommitted_writes.clear()
        self._marked = None
        self._seen_live = None
        self._epoch.clear()
        self._in_flight.clear()
        self._live_admits.clear()
        self._parked.clear()
        self.storage = self.storage.new_empty(0)
        self._current = None
