"""The manager's stream map: every call that sets, removes or clears an entry moves ``version`` on
by one (a step admitted at version v trusts its stream objects while v is still there), and the
map holds what a plain dict would after the same calls."""

import pytest

from mstar_core import CacheStream
from mstar_core.kv.streams import StreamMap


def stream(rid: str, label: str = "t") -> CacheStream:
    return CacheStream(rid, label)


def test_a_new_stream_holds_nothing_and_has_no_table_row():
    s = CacheStream("a", "t")
    assert (s.pages, s.length, s.generation, s.in_flight, s.table_row, s.chain) == ([], 0, 0, False, -1, None)
    assert CacheStream("b", "t").pages is not s.pages  # each stream its own page list


A, B, C = ("a", "t"), ("b", "t"), ("c", "t")


def setitem(m, d):
    m[C] = d[C] = stream("c")


def setitem_replacing(m, d):
    m[A] = d[A] = stream("a")


def delitem(m, d):
    del m[A]
    del d[A]


def pop(m, d):
    assert m.pop(A) is d.pop(A)


def pop_with_default(m, d):
    assert m.pop(C, None) is d.pop(C, None) is None


def popitem(m, d):
    assert m.popitem() == d.popitem()


def setdefault(m, d):
    new = stream("c")
    assert m.setdefault(C, new) is d.setdefault(C, new) is new


def update(m, d):
    new = {C: stream("c"), A: stream("a")}
    m.update(new)
    d.update(new)


def update_from_pairs(m, d):
    pairs = [(C, stream("c"))]
    m.update(pairs)
    d.update(pairs)


def ior(m, d):
    new = {C: stream("c")}
    m |= new
    d |= new


def clear(m, d):
    m.clear()
    d.clear()


@pytest.mark.parametrize("change", [setitem, setitem_replacing, delitem, pop, pop_with_default, popitem, setdefault,
                                    update, update_from_pairs, ior, clear], ids=lambda f: f.__name__)
def test_each_change_moves_the_version_by_one_and_the_map_holds_what_a_dict_would(change):
    m = StreamMap()
    assert m.version == 0
    m[A], m[B] = stream("a"), stream("b")
    assert m.version == 2
    d = dict(m)
    change(m, d)
    assert m.version == 3
    assert list(m.items()) == list(d.items())  # same keys, same objects, same order
    assert isinstance(m, StreamMap)


def test_reads_leave_the_version_alone():
    m = StreamMap({A: stream("a")})  # built from a mapping: dict.__init__, not __setitem__
    v = m.version
    assert m.get(A) is m[A] and A in m and list(m) == [A] and len(m) == 1 and m.get(B) is None
    assert m.version == v


def test_versions_are_per_map():
    m, other = StreamMap(), StreamMap()
    m[A] = stream("a")
    assert (m.version, other.version) == (1, 0)
