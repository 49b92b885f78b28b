"""Wrappers that each break one rule of ``mstar check`` (``mstar_core.testing.rules.RULES``) by the
smallest amount that rule should catch -- one slot read past a row's last key, one unit in the
last place of one input or of an earlier output, an error just past a dtype's stated tolerance --
and wrappers whose error sits just inside that tolerance. Each subclasses a correct reference
wrapper. ``test_kit_rules.py`` registers each as a third-party backend and checks that the kit
fails it naming the rule it breaks, and passes the ones inside the tolerance."""

from __future__ import annotations

import torch

from mstar_core.attention.checks import PLAN_KWARGS
from mstar_core.backends import reference as R

# The base tolerances docs/PLUGINS.md states ("How close is close"), written out: the kit's own
# table is what these wrappers test, so they must not read it.
STATED_TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def nudge(t: torch.Tensor) -> None:
    """Move the last element of ``t [tokens, heads, dim]`` by one unit in the last place, in place."""
    t[-1, -1, -1:].view(_INT_OF_SIZE[t.element_size()]).add_(1)


# -- oracle: an error at a set multiple of the dtype's stated tolerance --------------------------


def decode_off_by(factor: float) -> type:
    """A decode wrapper whose outputs are the reference's times ``1 + factor * tolerance``: a
    relative error of ``factor`` times the stated tolerance of q's dtype, in every row."""

    class DecodeScaledOutput(R.ReferenceDecodeWrapper):
        def run(self, q, kv_cache_layer, **kwargs):
            out = super().run(q, kv_cache_layer, **kwargs)
            return (out.double() * (1.0 + factor * STATED_TOLERANCE[q.dtype])).to(out.dtype)

    return DecodeScaledOutput


# -- shape, dtype: the right values in the wrong container ---------------------------------------


class DecodeLeadingDim(R.ReferenceDecodeWrapper):
    """The right values, shaped ``[1, tokens, Hq, D]``."""

    def run(self, q, kv_cache_layer, **kwargs):
        return super().run(q, kv_cache_layer, **kwargs).unsqueeze(0)


class DecodeWidensOutput(R.ReferenceDecodeWrapper):
    """The right values, in float64 (exactly float32's values for float32 queries)."""

    def run(self, q, kv_cache_layer, **kwargs):
        return super().run(q, kv_cache_layer, **kwargs).double()


# -- no-key, isolation: what one query or row must not see ----------------------------------------


class RaggedNoKeySeesFirstKey(R.ReferencePrefixedPrefillWrapper):
    """The causal limit clamped at key 0: a query that sees no key returns its row's first value."""

    def plan(self, cu_q, cu_k, max_q, max_k, causal=True, *args, **kwargs):
        super().plan(cu_q, cu_k, max_q, max_k, causal, *args, **kwargs)
        q, k = cu_q.tolist(), cu_k.tolist()
        self._blind = [(q[i], q[i] + max(0, (q[i + 1] - q[i]) - (k[i + 1] - k[i])), k[i])
                       for i in range(len(q) - 1)] if causal else []

    def run(self, q, k, v, **kwargs):
        out = super().run(q, k, v, **kwargs)
        group = self.num_qo_heads // self.num_kv_heads
        for a, b, k0 in self._blind:
            out[a:b] = v[k0].repeat_interleave(group, 0).to(out.dtype)
        return out


class RaggedRowEdgeLeak(R.ReferencePrefixedPrefillWrapper):
    """A tile straddling two rows: each row's first output element adds 0 times the previous
    row's last one, so only a NaN or inf there changes it."""

    def plan(self, cu_q, *args, **kwargs):
        super().plan(cu_q, *args, **kwargs)
        self._starts = cu_q.tolist()[1:-1]

    def run(self, q, k, v, **kwargs):
        out = super().run(q, k, v, **kwargs)
        for s in self._starts:
            out[s, 0, 0] += 0.0 * out[s - 1, -1, -1]
        return out


# -- stale-slots: one slot past the last key -------------------------------------------------------


class DecodeOneSlotPast(R.ReferenceDecodeWrapper):
    """Each row also reads the slot after its last key, where that slot is in its last page."""

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=torch.bfloat16, kv_lens=None,
             window_left=-1, **kwargs):
        spare = ((paged_kv_last_page_len > 0) & (paged_kv_last_page_len < self.page_size)).to(torch.int32)
        super().plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len + spare, dtype=dtype,
                     kv_lens=None if kv_lens is None else kv_lens + spare, window_left=window_left, **kwargs)


# -- inputs-unchanged: a write into q, or into the cache ------------------------------------------


class RaggedNudgesQ(R.ReferencePrefixedPrefillWrapper):
    """A scale applied to q in place and undone, leaving one element one unit in the last place off."""

    def run(self, q, k, v, **kwargs):
        out = super().run(q, k, v, **kwargs)
        nudge(q)
        return out


class DecodeClearsNextSlot(R.ReferenceDecodeWrapper):
    """Each run zeroes the slot after every row's last key in its last page (where the row's next
    token will go): a slot no row reads, in the cache it was given."""

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *args, **kwargs):
        super().plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *args, **kwargs)
        ends, last, pages = paged_kv_indptr.tolist(), paged_kv_last_page_len.tolist(), paged_kv_indices.tolist()
        self._next = [(pages[ends[r + 1] - 1], last[r]) for r in range(len(last)) if 0 < last[r] < self.page_size]

    def run(self, q, kv_cache_layer, **kwargs):
        out = super().run(q, kv_cache_layer, **kwargs)
        for page, slot in self._next:
            kv_cache_layer[page, :, slot] = 0.0
        return out


# -- deterministic, owned-output: one unit in the last place, later -------------------------------


class DecodeEveryOtherRunOff(R.ReferenceDecodeWrapper):
    """Every second run's output differs from the first's by one unit in the last place of one
    element (an atomic sum's order)."""

    def run(self, q, kv_cache_layer, **kwargs):
        out = super().run(q, kv_cache_layer, **kwargs)
        self._runs = getattr(self, "_runs", 0) + 1
        if self._runs % 2 == 0:
            nudge(out)
        return out


class DecodeWritesPreviousOutput(R.ReferenceDecodeWrapper):
    """Each run uses the previous run's output as scratch: one element moves by one unit in the
    last place."""

    def run(self, q, kv_cache_layer, **kwargs):
        previous = getattr(self, "_previous", None)
        if previous is not None:
            nudge(previous)
        self._previous = super().run(q, kv_cache_layer, **kwargs)
        return self._previous


# -- replan, refused-plan, unknown-keyword, independent-wrappers: what a plan keeps ---------------


class DecodeKeepsScale(R.ReferenceDecodeWrapper):
    """A plan without ``sm_scale`` keeps the previous plan's instead of the default."""

    def _plan(self, p):
        scale = self._sm_scale
        super()._plan(p)
        if p.sm_scale is None:
            self._sm_scale = scale


class DecodeKeepsPageTable(R.ReferenceDecodeWrapper):
    """A plan after the first keeps the first one's page table (its new rows' lengths taken)."""

    def _plan(self, p):
        first = self._planned
        super()._plan(p)
        if first is not None:
            self._planned = (*self._planned[:4], first[4], first[5])


class DecodeScaleBeforeChecks(R.ReferenceDecodeWrapper):
    """``plan`` takes the new ``sm_scale`` before checking its other arguments."""

    def plan(self, *args, **kwargs):
        self._sm_scale = kwargs.get("sm_scale")
        super().plan(*args, **kwargs)


class DecodeDropsUnknownKeywords(R.ReferenceDecodeWrapper):
    """``plan`` drops the keywords it does not know instead of refusing them."""

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=torch.bfloat16, kv_lens=None,
             window_left=-1, **kwargs):
        known = {k: v for k, v in kwargs.items() if k in PLAN_KWARGS}
        super().plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=dtype, kv_lens=kv_lens,
                     window_left=window_left, **known)


class DecodeScaleOnClass(R.ReferenceDecodeWrapper):
    """The scale kept on the class: every wrapper runs with the one planned last, by any instance."""

    scale: float | None = None

    def _plan(self, p):
        super()._plan(p)
        type(self).scale = p.sm_scale

    def run(self, q, kv_cache_layer, **kwargs):
        self._sm_scale = type(self).scale
        return super().run(q, kv_cache_layer, **kwargs)


# -- runs: a shape the contract allows, refused -----------------------------------------------------


class DecodeRaisesOnFullLastPage(R.ReferenceDecodeWrapper):
    """``plan`` raises where a row's keys fill its last page exactly (an assertion in its kernel)."""

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *args, **kwargs):
        if bool((paged_kv_last_page_len == self.page_size).any()):
            raise RuntimeError("a row's last page is full")
        super().plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *args, **kwargs)


# -- replay: capturable wrappers of each paged kind, and ones that break the replay rules -------


def paged_rows(indptr, indices, last_page_len, page_size):
    """Each row's pages and key count, from a paged plan's arrays."""
    ends, ids, last = indptr.tolist(), indices.tolist(), last_page_len.tolist()
    rows = []
    for r, tail in enumerate(last):
        n = ends[r + 1] - ends[r]
        rows.append((ids[ends[r]:ends[r + 1]], (n - 1) * page_size + tail if n else 0))
    return rows


class StaticDecode:
    """A capturable decode wrapper (plugin API 1.0) in plain PyTorch: ``run`` is one fixed-shape
    computation over each row's page table and length, which ``plan`` copies into buffers sized
    for ``batch_size`` rows of ``max_num_pages`` pages in graph mode (else for each plan's rows),
    so a captured ``run`` replays whatever was planned last."""

    graph_capturable = True

    def __init__(self, workspace_buffer, num_qo_heads, num_kv_heads, head_dim, page_size, batch_size=None,
                 max_num_pages=None, device="cpu", accelerator_graph=False, enable_nvtx=False, backend="auto"):
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = (num_qo_heads, num_kv_heads, head_dim,
                                                                               page_size)
        self.device = torch.device(device)
        self._graph = accelerator_graph
        if accelerator_graph:
            self._pages = torch.zeros((batch_size, max_num_pages), dtype=torch.long, device=self.device)
            self._lens = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, dtype=torch.bfloat16, kv_lens=None,
             window_left=-1, sm_scale=None, **kwargs):
        self._refuse_unknown(kwargs)
        rows = paged_rows(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, self.page_size)
        self._plan_rows(rows, window_left, sm_scale)

    def _refuse_unknown(self, kwargs):
        if kwargs:
            raise TypeError(f"{type(self).__name__}.plan got unexpected keyword arguments {sorted(kwargs)}")

    def _plan_rows(self, rows, window_left, sm_scale):
        """Each row (its pages, how many keys it sees) into the page-table buffers."""
        width = self._pages.shape[1] if self._graph else max([len(p) for p, _ in rows] + [1])
        pages = torch.zeros((self._pages.shape[0] if self._graph else len(rows), width), dtype=torch.long)
        lens = torch.zeros(pages.shape[0], dtype=torch.long)
        for r, (row_pages, seen) in enumerate(rows):
            pages[r, :len(row_pages)] = torch.tensor(row_pages, dtype=torch.long)
            lens[r] = seen
        self._set(pages.to(self.device), lens.to(self.device))
        self._window = window_left
        self._scale = 1.0 / self.head_dim ** 0.5 if sm_scale is None else sm_scale

    def _set(self, pages, lens):
        if self._graph:  # in place: the captured run reads these buffers
            self._pages.copy_(pages)
            self._lens.copy_(lens)
        else:
            self._pages, self._lens = pages, lens

    def run(self, q, kv_cache_layer, **kwargs):
        rows, width = self._pages.shape
        hkv, d = self.num_kv_heads, self.head_dim
        kv = kv_cache_layer[self._pages].transpose(1, 2).reshape(rows, 2, width * self.page_size, hkv, d)
        pos = torch.arange(width * self.page_size, device=q.device)
        valid = pos[None] < self._lens[:, None]
        if self._window >= 0:
            valid &= pos[None] >= self._lens[:, None] - 1 - self._window
        k, v = (kv[:, i].masked_fill(~valid[:, :, None, None], 0.0).float() for i in (0, 1))
        qg = q.float().reshape(rows, hkv, -1, d)
        s = torch.einsum("bhgd,bkhd->bhgk", qg, k) * self._scale
        p = torch.softmax(s.masked_fill(~valid[:, None, None], float("-inf")), dim=-1).nan_to_num(0.0)
        return torch.einsum("bhgk,bkhd->bhgd", p, v).reshape(rows, self.num_qo_heads, d).to(q.dtype)


class StaticDecodeRebinds(StaticDecode):
    """``plan`` binds new page-table buffers in graph mode too: a graph captured before replays
    the plan it was captured with."""

    def _set(self, pages, lens):
        self._pages, self._lens = pages, lens


class StaticPrefill(StaticDecode):
    """A capturable paged prefill wrapper in the same form: each query token a row of its own over
    its row's pages, seeing the keys up to its causal limit, in buffers sized for
    ``max_total_tokens`` tokens in graph mode."""

    def __init__(self, workspace_buffer, num_qo_heads, num_kv_heads, head_dim, page_size, batch_size=None,
                 max_num_pages=None, device="cpu", accelerator_graph=False, enable_nvtx=False, backend="auto",
                 max_total_tokens=None):
        super().__init__(workspace_buffer, num_qo_heads, num_kv_heads, head_dim, page_size, max_total_tokens,
                         max_num_pages, device, accelerator_graph, enable_nvtx, backend)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, causal=True,
             dtype=torch.bfloat16, kv_lens=None, window_left=-1, sm_scale=None, **kwargs):
        self._refuse_unknown(kwargs)
        self._check_indices(paged_kv_indices)
        qo = qo_indptr.tolist()
        causal = self._causal(qo, causal)
        tokens = []
        for r, (pages, seen) in enumerate(paged_rows(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                                      self.page_size)):
            n = qo[r + 1] - qo[r]
            tokens += [(pages, seen - n + 1 + i if causal else seen) for i in range(n)]
        self._plan_rows(tokens, window_left, sm_scale)

    def _check_indices(self, indices):
        pass

    def _causal(self, qo, causal):
        return causal


class StaticMixed(StaticPrefill):
    """The same as a mixed wrapper (one plan for decode and prefill rows, always sized, so always
    in graph mode), which, like the managers' mixed split, takes its page indices on the host."""

    def __init__(self, float_workspace_buffer, int_workspace_buffer, num_qo_heads, num_kv_heads, head_dim,
                 page_size, batch_size, max_total_tokens, max_num_pages, max_prefill_rows, device="cpu",
                 backend="auto"):
        super().__init__(float_workspace_buffer, num_qo_heads, num_kv_heads, head_dim, page_size,
                         max_num_pages=max_num_pages, device=device, accelerator_graph=True,
                         max_total_tokens=max_total_tokens)

    def _check_indices(self, indices):
        if indices.device.type != "cpu":
            raise ValueError(f"StaticMixed.plan: paged_kv_indices must be on the host, got {indices.device}")


class StaticPrefillMultiTokenNoCausal(StaticPrefill):
    """Drops the causal mask for a step of uniform rows of a few queries (multi-token decode), as
    a kernel picked for those steps might; every other step is right."""

    def _causal(self, qo, causal):
        lens = {b - a for a, b in zip(qo[:-1], qo[1:], strict=True)}
        return causal and not (len(qo) > 2 and len(lens) == 1 and 1 < min(lens) <= 8)


class StaticDecodeScaledStep(StaticDecode):
    """Right in every step but the one of three rows, whose outputs are scaled by ``1 + 1e-5``
    (in float32, inside the stated tolerance): the largest error of a replay sequence is that one."""

    GAIN = 1e-5

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gain = torch.ones((), device=self.device)

    def _plan_rows(self, rows, window_left, sm_scale):
        super()._plan_rows(rows, window_left, sm_scale)
        self._gain.fill_(1.0 + self.GAIN if sum(1 for _, seen in rows if seen) == 3 else 1.0)

    def run(self, q, kv_cache_layer, **kwargs):
        return super().run(q, kv_cache_layer, **kwargs) * self._gain


class StaticDecodeLeadingDim(StaticDecode):
    """Returns its output with a leading dimension of one: the wrong shape, on every run."""

    def run(self, q, kv_cache_layer, **kwargs):
        return super().run(q, kv_cache_layer, **kwargs)[None]
