import pytest
import torch

from mstar_core import (
    AdmitOutcome,
    CommitError,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    Resource,
    Shortage,
    Step,
    StepContext,
)
from mstar_core.node import order_resources

from ..helpers import Logged, small_kv, step


class R(Resource):
    def __init__(self, name, deps=(), refuse=False):
        self.name, self._deps, self.refuse = name, deps, refuse
        self.log = []

    def depends_on(self):
        return self._deps

    def admit(self, step, ctx):
        self.log.append("admit")
        return AdmitOutcome.refuse(Shortage(self.name, "slots", 1, 0, "x")) if self.refuse else AdmitOutcome.ok()

    def rollback_admit(self, step, ctx):
        self.log.append("rollback")


def test_order_follows_dependencies():
    a, b, c = R("a", ("b",)), R("b", ("c",)), R("c")
    assert [r.name for r in order_resources([a, b, c])] == ["c", "b", "a"]


def test_cycle_and_missing_dependency_are_named():
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        order_resources([R("a", ("b",)), R("b", ("a",))])
    with pytest.raises(ValueError, match="'a' depends on 'zz'"):
        order_resources([R("a", ("zz",))])


def test_refusal_rolls_back_every_earlier_admit():
    kv = small_kv(max_pages=4)
    refuser = R("slots", ("kv",), refuse=True)
    node = Node([refuser, kv])
    node.ingest_request("x")
    res = node.step(Step(KVStep((KVSpan("x", "t", 9),))), lambda ctx: pytest.fail("forward must not run"))
    assert not res.outcome and "slots: needs 1 slots for request 'x', 0 free" in res.outcome.reason()
    assert kv.num_free_pages == 4 and refuser.log == ["admit"]


def test_a_refusal_rolls_back_the_earlier_admits_and_frees_the_streams():
    """When a resource refuses, every resource admitted before it in the step is rolled back —
    the KV manager's pages go back and its streams are no longer in flight, so the same step can
    be admitted again at once — and the refusing one is not rolled back."""
    log = []
    kv = small_kv(max_pages=8, page_size=4)
    gate = Logged("gate", log, deps=("kv", "mid"), refuse=True)
    node = Node([gate, Logged("mid", log, deps=("kv",)), kv])
    node.ingest_request("a")
    st = step(("a", "t", 6))
    out = node.admit(st, StepContext())
    assert not out and "gate: needs 1 tickets" in out.reason()
    assert log == [("admit", "mid"), ("admit", "gate"), ("rollback", "mid")]
    assert kv.num_free_pages == 8 and ("a", "t") not in kv.streams
    gate.refuse = False
    ctx = StepContext()
    assert node.admit(st, ctx)  # nothing of the refused step is left in flight
    node.rollback_admit(st, ctx)


def test_a_refusal_rolls_back_in_reverse_dependency_order():
    """The rollback after a refusal runs over the admitted resources in reverse dependency order
    (the resource that depends on another is undone first)."""
    log = []
    node = Node([Logged("d", log, deps=("c",), refuse=True), Logged("b", log, deps=("a",)),
                 Logged("c", log, deps=("b",)), Logged("a", log)])
    assert not node.admit(step(), StepContext())
    assert log == [("admit", "a"), ("admit", "b"), ("admit", "c"), ("admit", "d"),
                   ("rollback", "c"), ("rollback", "b"), ("rollback", "a")]


class _FailingCommitKV(KVManager):
    fail = True

    def commit(self, step, ctx):
        if self.fail:
            raise OSError("commit lost")
        super().commit(step, ctx)


def test_the_resource_whose_commit_raises_is_rolled_back_itself():
    """A commit that raises leaves that resource's admit undone too (not only the resources
    after it): its pages go back, its streams are not in flight, and the step can run again."""
    kv = _FailingCommitKV(KVConfig(2, 2, 8, 4, 8, 4), "cpu", torch.float64)
    log = []
    node = Node([kv, Logged("after", log, deps=("kv",))])
    node.ingest_request("a")
    st = step(("a", "t", 6))
    with pytest.raises(CommitError) as err:
        node.step(st, lambda ctx: None)
    assert err.value.failed == "kv" and err.value.committed == () and err.value.rolled_back == ("kv", "after")
    assert kv.num_free_pages == 8 and ("a", "t") not in kv.streams
    kv.fail = False
    assert node.step(st, lambda ctx: None).outcome
    assert kv.stream("a", "t").length == 6
