"""What a wrapper of each contract version receives (mstar_core.attention.calls): a keyword a
later MINOR added never reaches a wrapper written for an earlier one; 2.0 wrappers get the plan
object; plans are checked once, in the core."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mstar_core.attention import calls
from mstar_core.attention.plans import WrapperSize, paged_plan, ragged_plan

I32 = torch.int32


def _plan(kind: str = "paged_prefill", **kw: Any):
    qo = None if kind == "paged_decode" else torch.tensor([0, 3, 4], dtype=I32)
    return paged_plan(kind, qo, torch.tensor([0, 2, 3], dtype=I32), torch.tensor([5, 1, 7], dtype=I32),
                      torch.tensor([4, 2], dtype=I32), 16, torch.float32, **kw)


class Strict:
    """A 1.x wrapper that refuses any keyword it does not know, as contract 1.x asks."""

    known = frozenset({"causal", "dtype", "kv_lens", "window_left", "sm_scale", "logits_soft_cap", "kv_data_type"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        self.planned: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def plan(self, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - self.known)
        if unknown:
            raise TypeError(f"Strict.plan: unexpected keyword arguments {unknown}")
        self.planned = (args, kwargs)


class TakesPlans:
    def __init__(self, size: WrapperSize) -> None:
        self.size = size
        self.plans: list[Any] = []

    @classmethod
    def from_size(cls, size: WrapperSize) -> TakesPlans:
        return cls(size)

    def plan(self, plan: Any) -> None:
        self.plans.append(plan)


def test_a_1_0_wrapper_never_gets_sink_logits_a_1_1_one_does():
    p = _plan(sink_logits=True, sm_scale=0.5, logits_soft_cap=30.0)
    old = Strict()
    calls.plan_paged(old, p, "1.0")
    assert old.planned is not None
    assert old.planned[1] == {"causal": True, "dtype": torch.float32, "kv_lens": p.kv_lens, "window_left": -1,
                              "sm_scale": 0.5, "logits_soft_cap": 30.0}
    with pytest.raises(TypeError, match="sink_logits"):  # a strict 1.0 wrapper, had the core sent it
        calls.plan_paged(Strict(), p, "1.1")
    assert calls.paged_keywords(p, "1.1")["sink_logits"] is True
    assert "sink_logits" not in calls.paged_keywords(p, "1.0")


def test_a_2_0_wrapper_is_built_from_its_size_and_planned_with_the_checked_object():
    size = WrapperSize(8, 2, 64, torch.device("cpu"), 16)
    w = calls.build_wrapper(TakesPlans, "paged_prefill", size, "2.0")
    assert isinstance(w, TakesPlans) and w.size is size
    p = _plan()
    calls.plan_paged(w, p, "2.0")
    assert w.plans == [p]
    r = ragged_plan(torch.tensor([0, 2], dtype=I32), torch.tensor([0, 5], dtype=I32), 2, 5, torch.float32)
    calls.plan_ragged(w, r, "2.0")
    assert w.plans[-1] is r


def test_a_1_x_wrapper_is_built_with_its_positional_constructor():
    size = WrapperSize(8, 2, 64, torch.device("cpu"), 16, workspace_bytes=64, options={"backend": "fa2"})
    w = calls.build_wrapper(Strict, "paged_decode", size, "1.0")
    assert w.args[1:] == (8, 2, 64, 16) and w.kwargs == {"device": size.device, "backend": "fa2"}
    mixed = calls.build_wrapper(Strict, "mixed", WrapperSize(8, 2, 64, "cpu", 16, batch_size=4, max_total_tokens=9,
                                                              max_num_pages=12, max_prefill_rows=2), "1.1")
    assert mixed.args[2:] == (8, 2, 64, 16, 4, 9, 12, 2, torch.device("cpu"))
    ragged = calls.build_wrapper(Strict, "prefixed_ragged", size, "1.1")
    assert ragged.args == (8, 2, 64, torch.device("cpu")) and ragged.kwargs == {"backend": "fa2"}


def test_the_plan_is_checked_once_with_messages_naming_the_entry():
    p = _plan()
    assert (p.rows, p.tokens, p.max_q, p.max_kv, p.max_page, p.keys_cover_queries) == (2, 4, 3, 20, 7, True)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\] = 0 for a row with 1 pages; allowed: 1..16"):
        paged_plan("paged_prefill", torch.tensor([0, 1, 2], dtype=I32), torch.tensor([0, 2, 3], dtype=I32),
                   torch.tensor([5, 1, 7], dtype=I32), torch.tensor([4, 0], dtype=I32), 16, torch.float32)
    with pytest.raises(ValueError, match=r"kv_indices\[1\] = -1 is negative"):
        paged_plan("paged_decode", None, torch.tensor([0, 2], dtype=I32), torch.tensor([5, -1], dtype=I32),
                   torch.tensor([4], dtype=I32), 16, torch.float32)
    with pytest.raises(ValueError, match=r"kv_lens\[0\] = 3 disagrees"):
        _plan(kv_lens=torch.tensor([3, 2], dtype=I32))
    with pytest.raises(TypeError, match="qo_indptr must hold integers"):
        paged_plan("paged_prefill", torch.tensor([0.0, 1.0]), torch.tensor([0, 1], dtype=I32),
                   torch.tensor([0], dtype=I32), torch.tensor([1], dtype=I32), 16, torch.float32)
    # rows with fewer keys than queries are the contract's (their keyless queries give zeros)
    short = paged_plan("paged_prefill", torch.tensor([0, 5], dtype=I32), torch.tensor([0, 1], dtype=I32),
                       torch.tensor([0], dtype=I32), torch.tensor([2], dtype=I32), 16, torch.float32)
    assert not short.keys_cover_queries
    # so are decode rows without pages (zero keys, zeros out)
    empty = paged_plan("paged_decode", None, torch.tensor([0, 0, 2, 2], dtype=I32), torch.tensor([5, 1], dtype=I32),
                       torch.tensor([0, 4, 0], dtype=I32), 16, torch.float32)
    assert empty.kv_lens.tolist() == [0, 20, 0] and not empty.keys_cover_queries
    assert p.variant(8, True).window_left == 8 and p.variant(-1, False) is p


def test_a_page_table_starts_at_0_and_a_soft_cap_of_0_is_not_off():
    with pytest.raises(ValueError, match=r"kv_indptr must start at 0, got kv_indptr\[0\] = 2"):
        paged_plan("paged_decode", None, torch.tensor([2, 3], dtype=I32), torch.tensor([5, 1, 7], dtype=I32),
                   torch.tensor([4], dtype=I32), 16, torch.float32)
    with pytest.raises(ValueError, match=r"logits_soft_cap must be .* or None for no cap; got 0.0 \(0 does not "
                                         r"turn the cap off: pass None\)"):
        _plan(logits_soft_cap=0.0)
    assert _plan(logits_soft_cap=None).logits_soft_cap is None


@pytest.mark.parametrize("name", ["build_paged_attention", "summary", "PagedManager"])
def test_names_moved_from_grouped_keep_their_old_path_with_a_warning(name):
    from mstar_core.attention import grouped, paged

    with pytest.warns(DeprecationWarning, match=f"grouped.{name} moved to mstar_core.attention.paged.{name}"):
        assert getattr(grouped, name) is getattr(paged, name)
    with pytest.raises(AttributeError):
        grouped.no_such_name  # noqa: B018


def test_a_plan_without_pages_takes_empty_lists():
    p = paged_plan("paged_decode", None, [0, 0], [], [0], 16, torch.float32)
    assert p.kv_indices.dtype == torch.int32 and (p.rows, p.max_kv, p.keys_cover_queries) == (1, 0, False)


def test_a_backends_own_options_reach_its_wrappers_size():
    from mstar_core import PagedAttentionManager
    from mstar_core.backends import reference as R

    from ..helpers import REF_WRAPPERS, small_kv

    seen: list[WrapperSize] = []

    class Recording(R.ReferenceDecodeWrapper):
        @classmethod
        def from_size(cls, size):
            seen.append(size)
            return super().from_size(size)

    kv = small_kv(max_pages=8, page_size=4, dtype=torch.float32)
    attn = PagedAttentionManager(kv, "cpu", torch.float32, kv.config, {**REF_WRAPPERS, "paged_decode": Recording},
                                 backend_options={"backend": "fa2"})
    attn._wrapper(("text", "paged_decode", 0, None, 0))
    assert seen[-1].options == {"backend": "fa2"}
    with pytest.warns(DeprecationWarning, match=r"flashinfer_backend=\) is FlashInfer's own setting"):
        old = PagedAttentionManager(kv, "cpu", torch.float32, kv.config, REF_WRAPPERS, flashinfer_backend="fa3")
    assert old.backend_options == {"backend": "fa3"}
