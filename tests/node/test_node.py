import pytest

from mstar_core import AdmitOutcome, KVSpan, KVStep, Node, Resource, Shortage, Step
from mstar_core.node import order_resources

from ..helpers import small_kv


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
