"""A small step runner: a node's resources in ``depends_on()`` order, driven through
admit -> plan -> forward -> commit. It exists so the resources run end to end; it is not a
serving front end."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from mstar_core.errors import CommitError, InputError, UnknownName
from mstar_core.resource import Resource
from mstar_core.step import AdmitOutcome, Step, StepContext

log = logging.getLogger(__name__)
T = TypeVar("T")


def order_resources(resources: Sequence[Resource]) -> list[Resource]:
    """Topological order over ``depends_on()``; a cycle or a missing dependency is an error
    that names it."""
    by_name: dict[str, Resource] = {}
    for r in resources:
        if r.name in by_name:
            raise InputError(f"two resources are named {r.name!r}")
        by_name[r.name] = r
    for r in resources:
        for dep in r.depends_on():
            if dep not in by_name:
                raise InputError(f"resource {r.name!r} depends on {dep!r}, which this node does not hold "
                                 f"(it holds {sorted(by_name)})")
    ordered: list[Resource] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(r: Resource, path: tuple[str, ...]) -> None:
        if state.get(r.name) == 2:
            return
        if state.get(r.name) == 1:
            raise InputError(f"dependency cycle: {' -> '.join((*path, r.name))}")
        state[r.name] = 1
        for dep in r.depends_on():
            visit(by_name[dep], (*path, r.name))
        state[r.name] = 2
        ordered.append(r)

    for r in resources:
        visit(r, ())
    return ordered


@dataclass(frozen=True)
class StepResult(Generic[T]):
    outcome: AdmitOutcome
    ctx: StepContext
    output: T | None


class Node:
    """Resources of one model node, and the per-step lifecycle over them."""

    def __init__(self, resources: Sequence[Resource]) -> None:
        self.resources = order_resources(resources)
        self._steps = 0

    def __getitem__(self, name: str) -> Resource:
        for r in self.resources:
            if r.name == name:
                return r
        raise UnknownName(f"no resource {name!r}; this node holds {[r.name for r in self.resources]}")

    def ingest_request(self, rid: str, overrides: Mapping[str, Any] | None = None) -> None:
        for r in self.resources:
            r.ingest_request(rid, overrides)

    def remove_request(self, rid: str) -> None:
        for r in reversed(self.resources):
            r.remove_request(rid)

    def reset_request(self, rid: str, free: bool = False) -> None:
        for r in reversed(self.resources):
            r.reset_request(rid, free)

    def admit(self, step: Step, ctx: StepContext) -> AdmitOutcome:
        """Admit every resource; on a refusal (or an exception) roll back what this step took.
        A refusal is returned; an exception is re-raised after the rollback."""
        done: list[Resource] = []
        try:
            for r in self.resources:
                outcome = r.admit(step, ctx)
                if not outcome:
                    self._rollback(step, ctx, done)
                    log.info("step refused by %s: %s", r.name, outcome.reason())
                    return outcome
                done.append(r)
        except BaseException:
            self._rollback(step, ctx, done)
            raise
        return AdmitOutcome.ok()

    def rollback_admit(self, step: Step, ctx: StepContext) -> None:
        """Undo an admitted step that will not run (every resource, in reverse order)."""
        self._rollback(step, ctx, self.resources)

    @staticmethod
    def _rollback(step: Step, ctx: StepContext, admitted: Sequence[Resource]) -> None:
        """Reverse dependency order. Every resource is rolled back even if one raises: the
        first error is re-raised after the others gave back what they took."""
        first: BaseException | None = None
        for r in reversed(admitted):
            try:
                r.rollback_admit(step, ctx)
            except BaseException as e:
                log.error("rollback_admit of %s raised %s: %s", r.name, type(e).__name__, e)
                first = first or e
        if first is not None:
            raise first

    def plan(self, step: Step, ctx: StepContext) -> None:
        """Plan every resource into ``ctx.plan_results``; an exception rolls the admit back, so a
        step that cannot be planned leaves nothing reserved."""
        try:
            for r in self.resources:
                ctx.plan_results[r.name] = r.plan(step, ctx)
        except BaseException:
            self.rollback_admit(step, ctx)
            raise

    def commit(self, step: Step, ctx: StepContext) -> None:
        """Commit every resource in order. If one raises, the resources after it (and it) are
        rolled back, so no stream is left in flight, and a :class:`CommitError` says which
        resources had committed already."""
        done: list[str] = []
        for i, r in enumerate(self.resources):
            try:
                r.commit(step, ctx)
            except BaseException as e:
                rest = self.resources[i:]
                self._rollback(step, ctx, rest)
                if not isinstance(e, Exception):
                    raise  # KeyboardInterrupt & co. keep their type; the rollback still ran
                raise CommitError(r.name, done, [x.name for x in rest], e) from e
            done.append(r.name)

    @contextmanager
    def bound(self, ctx: StepContext) -> Iterator[StepContext]:
        """Run a forward of the step ``ctx`` planned: inside, every resource's layers read this
        step's plan (``ctx.plan_results``), whatever was planned since. ``step`` and the graph
        runner do this; a caller driving admit/plan/commit by hand wraps its forward in it."""
        entered: list[Resource] = []
        try:
            for r in self.resources:
                if r.name in ctx.plan_results:
                    r.enter_plan(ctx.plan_results[r.name])
                    entered.append(r)
            yield ctx
        finally:
            for r in reversed(entered):
                r.exit_plan()

    def step(self, step: Step, forward: Callable[[StepContext], T]) -> StepResult[T]:
        """admit -> plan -> forward -> commit. A refusal comes back in the result; an exception
        in plan or forward rolls the admit back before it propagates."""
        ctx = StepContext(step_index=self._steps)
        outcome = self.admit(step, ctx)
        if not outcome:
            return StepResult(outcome, ctx, None)
        self.plan(step, ctx)
        try:
            with self.bound(ctx):
                output = forward(ctx)
            self.commit(step, ctx)
        except BaseException:
            # A resource that committed finds no admit record to roll back; the others give
            # back what the step took, even when what was raised came before commit began.
            self.rollback_admit(step, ctx)
            raise
        self._steps += 1
        return StepResult(outcome, ctx, output)

    def prefix_root(self, model: str | bytes) -> bytes:
        """What a prefix cache keys this node's pages under (``KVManager.admit_prefix``'s
        ``root``): every resource's fingerprint, in order, and ``model``, the caller's identity of
        the weights. Pages are never found under another root."""
        if isinstance(model, str):
            model = model.encode()
        if not isinstance(model, bytes) or not model:
            raise InputError(f"prefix_root: model must be a non-empty str or bytes naming the weights, got {model!r}")
        parts = [model]
        for r in self.resources:
            fp = r.fingerprint()
            if fp is not None:
                parts.append(r.name.encode() + b"=" + fp)
        return b"".join(len(p).to_bytes(4, "big") + p for p in parts)  # length-prefixed: no two lists alike

    def post_warmup_validate(self) -> None:
        for r in self.resources:
            r.post_warmup_validate()

    def cleanup(self) -> None:
        for r in reversed(self.resources):
            r.cleanup()
