"""The backend conformance suite: random paged and ragged cases, each wrapper's output against
the float64 oracle. Every backend runs it — the reference here, plugins through stand-in
modules on CPU and through the real libraries on the GPU.

Use from a test module::

    from mstar_core.testing import conformance as C

    @pytest.mark.parametrize("case", C.prefill_cases(), ids=str)
    def test_prefill(case):
        C.check_prefill(MY_BACKEND, case)

Wrappers are built with FlashInfer's positional constructor arguments, so a backend needs no
adapter to be tested.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.features import KV_DTYPES
from mstar_core.kv.fp8 import quantize
from mstar_core.testing.oracle import attention_oracle, rel_error

# Largest relative error (vs float64) a wrapper may show, by the dtype it computes in.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class WrapperSet:
    """A backend under test: its wrapper classes (None where it has none), device and dtype."""

    name: str
    prefill: Any = None
    decode: Any = None
    mixed: Any = None
    ragged: Any = None
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    workspace_bytes: int = 1 << 20
    extra_plan_kwargs: dict[str, Any] = field(default_factory=dict)
    # Prefill and decode plans get kv_indices on ``device``, as the paged KV manager passes them
    # (gathered there from its page table); the other index arrays stay on the host.
    device_indices: bool = False

    def workspace(self) -> torch.Tensor:
        return torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)

    def indices(self, data: PagedData) -> torch.Tensor:
        return data.kv_indices.to(self.device) if self.device_indices else data.kv_indices


@dataclass(frozen=True)
class PagedCase:
    page_size: int
    head_dim: int
    gqa: int
    q_lens: tuple[int, ...]
    # Keys cached before this step's queries; negative: the row has fewer keys than queries, so
    # under causal masking its first -p queries see no key (and must return zeros).
    prefix_lens: tuple[int, ...]
    causal: bool = True
    window_left: int = -1
    num_kv_heads: int = 2
    sm_scale: float | None = None
    seed: int = 0
    # Attention features (mstar_core.features): FP8 storage by name, soft-cap, sink logits.
    kv_dtype: str = "auto"
    soft_cap: float | None = None
    sinks: bool = False
    # A row whose queries are NaN and whose K/V pages hold inf/NaN: every other row must come out
    # as if it were clean (rows are isolated); that row's output is not checked.
    poison_row: int | None = None

    def __str__(self) -> str:
        c = "causal" if self.causal else "full"
        w = f"-win{self.window_left}" if self.window_left >= 0 else ""
        s = f"-scale{self.sm_scale:g}" if self.sm_scale is not None else ""
        return (f"ps{self.page_size}-d{self.head_dim}-gqa{self.gqa}-{c}{w}{s}{_feature_tag(self)}"
                f"-q{'_'.join(map(str, self.q_lens))}-p{'_'.join(map(str, self.prefix_lens))}")

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(p + q for p, q in zip(self.prefix_lens, self.q_lens, strict=True))


@dataclass(frozen=True)
class RaggedCase:
    head_dim: int
    gqa: int
    q_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    causal: bool = True
    num_kv_heads: int = 2
    seed: int = 0
    window_left: int = -1
    soft_cap: float | None = None
    sinks: bool = False
    sm_scale: float | None = None
    poison_row: int | None = None  # as PagedCase's

    def __str__(self) -> str:
        c = "causal" if self.causal else "full"
        w = f"-win{self.window_left}" if self.window_left >= 0 else ""
        s = f"-scale{self.sm_scale:g}" if self.sm_scale is not None else ""
        return (f"d{self.head_dim}-gqa{self.gqa}-{c}{w}{s}{_feature_tag(self)}-q{'_'.join(map(str, self.q_lens))}"
                f"-p{'_'.join(map(str, self.prefix_lens))}")


def _feature_tag(case: PagedCase | RaggedCase) -> str:
    kv_dtype = getattr(case, "kv_dtype", "auto")  # a ragged case stores the model dtype
    tag = f"-{kv_dtype}" if kv_dtype != "auto" else ""
    tag += f"-cap{case.soft_cap:g}" if case.soft_cap is not None else ""
    tag += f"-poison{case.poison_row}" if case.poison_row is not None else ""
    return tag + ("-sinks" if case.sinks else "")


def _lens_for(page_size: int, decode: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ragged rows including a length of 1 and one ending exactly on a page boundary."""
    if decode:
        return (1, 1, 1, 1), (0, page_size - 1, page_size, 2 * page_size + 3)
    return (1, 7, page_size, 2 * page_size + 1), (0, 5, page_size, 3)


def prefill_cases(page_sizes=(1, 16), head_dims=(64, 128), gqas=(1, 4, 8)) -> list[PagedCase]:
    cases = []
    for i, (ps, d, g, causal) in enumerate(itertools.product(page_sizes, head_dims, gqas, (True, False))):
        q, p = _lens_for(ps, decode=False)
        cases.append(PagedCase(ps, d, g, q, p, causal=causal, seed=i))
    # window_left and an explicit sm_scale, on a smaller grid
    for i, (ps, g) in enumerate(itertools.product(page_sizes, (1, 4))):
        q, p = _lens_for(ps, decode=False)
        cases.append(PagedCase(ps, 64, g, q, p, causal=True, window_left=5, seed=100 + i))
    cases.append(PagedCase(16, 64, 4, (3, 20), (40, 0), causal=True, sm_scale=0.07, seed=200))
    # a prompt over 64 tokens: FlashInfer 0.7.4 runs a plan holding one on fa3, shorter ones on fa2
    cases.append(PagedCase(16, 128, 4, (100, 3), (20, 0), causal=True, seed=210))
    # a window that bites on every row (each row's first query sits past it), with and without a scale
    cases.append(PagedCase(16, 128, 4, (3, 8, 17), (12, 20, 9), window_left=4, seed=220))
    cases.append(PagedCase(16, 128, 4, (3, 8, 17), (12, 20, 9), window_left=4, sm_scale=0.3, seed=221))
    return cases


def decode_cases(page_sizes=(1, 16), head_dims=(64, 128), gqas=(1, 4, 8)) -> list[PagedCase]:
    cases = []
    for i, (ps, d, g) in enumerate(itertools.product(page_sizes, head_dims, gqas)):
        q, p = _lens_for(ps, decode=True)
        cases.append(PagedCase(ps, d, g, q, p, seed=300 + i))
    for i, ps in enumerate(page_sizes):
        q, p = _lens_for(ps, decode=True)
        cases.append(PagedCase(ps, 64, 4, q, p, window_left=7, seed=400 + i))
    cases.append(PagedCase(16, 128, 4, (1, 1, 1), (20, 3, 41), sm_scale=0.07, seed=410))
    cases.append(PagedCase(16, 128, 4, (1, 1, 1, 1), (10, 20, 33, 47), window_left=5, seed=420))  # bites on every row
    return cases


def mixed_cases(page_sizes=(1, 16), head_dims=(64, 128), gqas=(1, 4, 8)) -> list[PagedCase]:
    cases = []
    for i, (ps, d, g) in enumerate(itertools.product(page_sizes, head_dims, gqas)):
        # decode rows and prompt rows interleaved, as a continuous-batching step sees them
        cases.append(PagedCase(ps, d, g, (1, 9, 1, ps + 1, 1), (12, 0, ps, 2, 1), seed=500 + i))
    cases.append(PagedCase(16, 64, 4, (1, 9, 1, 17), (12, 0, 16, 2), window_left=4, seed=600))
    cases.append(PagedCase(16, 128, 4, (1, 90, 1), (30, 5, 7), seed=610))  # a prompt over 64 tokens (see prefill)
    cases.append(PagedCase(16, 128, 4, (1, 9, 1), (12, 0, 30), sm_scale=0.07, seed=620))
    cases.append(PagedCase(16, 128, 4, (1, 9, 1, 17), (12, 7, 16, 6), window_left=4, seed=630))  # bites on every row
    return cases


def ragged_cases(head_dims=(64, 128), gqas=(1, 4, 8)) -> list[RaggedCase]:
    cases = []
    for i, (d, g, causal) in enumerate(itertools.product(head_dims, gqas, (True, False))):
        cases.append(RaggedCase(d, g, (1, 9, 16, 33), (0, 7, 16, 1), causal=causal, seed=700 + i))
    cases.append(RaggedCase(128, 4, (1, 9, 16), (8, 0, 30), sm_scale=0.07, seed=750))
    # The step's window_left reaches every dense backend (per-layer windows are the feature).
    cases.append(RaggedCase(128, 4, (1, 9, 16), (8, 7, 16), window_left=5, seed=760))  # bites on every row
    return cases


class Refused(Exception):
    """A wrapper refused, with a ValueError from ``plan``, a case the contract lets it refuse:
    rows with fewer keys than queries (the managers never plan one; a kernel that cannot return
    zeros for the queries that see no key refuses them rather than return garbage)."""


def _plan(case: PagedCase | RaggedCase, plan: Any) -> None:
    try:
        plan()
    except ValueError as e:
        if all(p >= 0 for p in case.prefix_lens):  # every row sees a key: nothing may be refused
            raise
        raise Refused(f"refused the plan: {e}") from e


def window_bites(case: PagedCase | RaggedCase) -> bool:
    """Whether the case's window removes keys from every row: each row's first query sits more
    than ``window_left`` positions in (a window case that bites nowhere tests nothing)."""
    return case.window_left >= 0 and all(p > case.window_left for p in case.prefix_lens)


# -- rows that must not affect each other, rows that see no key ----------------------------------


def edge_cases(kind: str, head_dim: int = 128, page_size: int = 16) -> list[PagedCase] | list[RaggedCase]:
    """For ``kind`` ("prefill", "decode", "mixed", "ragged"): a row poisoned with NaN/inf that
    no other row may notice, and (not decode: one query per row always sees its key) rows
    with fewer keys than queries, whose first queries see no key and must return zeros."""
    if kind == "ragged":
        return [RaggedCase(head_dim, 4, (9, 16, 5), (7, 16, 3), poison_row=1, seed=1000),
                RaggedCase(head_dim, 4, (6, 4, 9), (-3, 2, -5), seed=1010)]
    if kind == "decode":
        return [PagedCase(page_size, head_dim, 4, (1, 1, 1, 1), (20, 3, 41, 16), poison_row=1, seed=1020)]
    q, p = ((1, 9, 1, 17), (12, 0, 16, 6)) if kind == "mixed" else ((3, 8, 17), (12, 20, 9))
    cases = [PagedCase(page_size, head_dim, 4, q, p, poison_row=1, seed=1030)]
    q, p = ((1, 9, 1, 6), (12, -4, 16, 2)) if kind == "mixed" else ((5, 8, 17), (-2, 20, -10))
    cases.append(PagedCase(page_size, head_dim, 4, q, p, seed=1040))
    return cases


# -- attention features (mstar_core.features) ---------------------------------------------------

# Soft-caps that bite: scores of the cases' random data reach a few units, so a cap of 2 bends
# most of them and a cap of 30 (Gemma 2's) almost none; large-logit cases use the former.
SOFT_CAPS = (2.0, 30.0)
# FP8 K/V scales of the feature cases (per case, not 1.0, so a kernel that drops one shows).
K_SCALE, V_SCALE = 0.5, 2.0


def _declared(features: Any, *names: str) -> bool:
    return all(n in features for n in names)


def feature_cases(kind: str, features: Any, page_sizes=(1, 16), head_dim: int = 128) -> list[PagedCase]:
    """Cases for ``kind`` (``"prefill"``, ``"decode"``, ``"mixed"``) exercising every feature in
    ``features`` (a backend's ``BackendSpec.supports(capability)``), alone and combined.
    Windows: the plain cases already cover ``window_left`` per plan; per-layer windows are the
    managers' job (one plan per window)."""
    if kind == "decode":
        shapes = [(_lens_for(ps, decode=True), ps) for ps in page_sizes]
    elif kind == "mixed":
        shapes = [(((1, 9, 1, ps + 1, 1), (12, 0, ps, 2, 1)), ps) for ps in page_sizes]
    else:
        shapes = [(_lens_for(ps, decode=False), ps) for ps in page_sizes]
    variants: list[dict[str, Any]] = []
    for name in ("fp8_e4m3", "fp8_e5m2"):
        if _declared(features, name):
            variants.append({"kv_dtype": name})
    if _declared(features, "soft_cap"):
        variants += [{"soft_cap": c} for c in SOFT_CAPS]
    if _declared(features, "sink_logits"):
        variants.append({"sinks": True})
        variants.append({"sinks": True, "window_left": 3})  # rows whose window leaves few keys
    if _declared(features, "fp8_e4m3", "soft_cap"):
        variants.append({"kv_dtype": "fp8_e4m3", "soft_cap": 2.0})
    if _declared(features, "fp8_e4m3", "soft_cap", "sink_logits"):
        variants.append({"kv_dtype": "fp8_e4m3", "soft_cap": 2.0, "sinks": True})
    cases = []
    for i, (((q, p), ps), extra) in enumerate(itertools.product(shapes, variants)):
        cases.append(PagedCase(ps, head_dim, 4, q, p, seed=800 + i, **extra))
    return cases


def ragged_feature_cases(features: Any, head_dim: int = 128) -> list[RaggedCase]:
    """Prefixed ragged cases for the features in ``features`` (``BackendSpec.supports("prefixed_ragged")``)."""
    variants: list[dict[str, Any]] = []
    if _declared(features, "layer_windows"):
        variants.append({"window_left": 5})
    if _declared(features, "soft_cap"):
        variants += [{"soft_cap": c} for c in SOFT_CAPS]
    if _declared(features, "sink_logits"):
        variants += [{"sinks": True}, {"sinks": True, "causal": False}]
    if _declared(features, "soft_cap", "sink_logits", "layer_windows"):
        variants.append({"soft_cap": 2.0, "sinks": True, "window_left": 5})
    return [RaggedCase(head_dim, 4, (1, 9, 16, 33), (0, 7, 16, 1), seed=900 + i, **v) for i, v in enumerate(variants)]


def sink_logits(case: PagedCase | RaggedCase, device: str) -> torch.Tensor | None:
    """The case's sink logits ``[Hq]`` (float32), or None: values around the scores' scale, so
    they take a visible share of each softmax."""
    if not case.sinks:
        return None
    gen = torch.Generator().manual_seed(case.seed + 1)
    hq = case.num_kv_heads * case.gqa
    return (torch.randn(hq, generator=gen) * 2.0).to(device)


# -- building a case -----------------------------------------------------------------------------


@dataclass
class PagedData:
    q: torch.Tensor  # [tokens, Hq, D]
    layer: torch.Tensor  # [max_pages, 2, page_size, Hkv, D]
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    keys: list[tuple[torch.Tensor, torch.Tensor]]  # per row, [kv_len, Hkv, D] each


def make_paged(case: PagedCase, device: str, dtype: torch.dtype) -> PagedData:
    """Random data in a paged layer whose pages are scattered (a random permutation), plus a
    spare page nobody owns filled with large values, so a kernel that reads outside its pages
    shows."""
    gen = torch.Generator().manual_seed(case.seed)
    ps, hkv, d = case.page_size, case.num_kv_heads, case.head_dim
    hq = hkv * case.gqa
    kv_lens = case.kv_lens
    n_pages = [-(-n // ps) for n in kv_lens]
    total_pages = sum(n_pages) + 1
    perm = torch.randperm(total_pages, generator=gen)
    layer = torch.randn((total_pages, 2, ps, hkv, d), generator=gen) * 0.5
    layer[perm[-1]] = 1e4  # the poison page
    fp8 = KV_DTYPES[case.kv_dtype]
    if fp8 is None:
        stored = layer.to(dtype)
        seen = stored.double()  # what a kernel reads, in float64 for the oracle
    else:  # FP8 with the case's scales: a kernel reads stored * scale
        stored = torch.stack([quantize(layer[:, 0], K_SCALE, fp8), quantize(layer[:, 1], V_SCALE, fp8)], dim=1)
        seen = torch.stack([stored[:, 0].double() * K_SCALE, stored[:, 1].double() * V_SCALE], dim=1)
    indices, indptr, last, keys = [], [0], [], []
    cursor = 0
    for n, pages in zip(kv_lens, n_pages, strict=True):
        own = perm[cursor:cursor + pages]
        cursor += pages
        indices.extend(own.tolist())
        indptr.append(len(indices))
        last.append(n - (pages - 1) * ps if pages else 0)
        flat = seen[own].permute(1, 0, 2, 3, 4).reshape(2, pages * ps, hkv, d)[:, :n]
        keys.append((flat[0], flat[1]))
    tokens = sum(case.q_lens)
    q = torch.randn((tokens, hq, d), generator=gen)
    qo = [0]
    for n in case.q_lens:
        qo.append(qo[-1] + n)
    if case.poison_row is not None:  # after the oracle's keys were taken: they stay clean
        r = case.poison_row
        own = torch.tensor(indices[indptr[r]:indptr[r + 1]], dtype=torch.long)
        stored[own, 0], stored[own, 1] = float("inf"), float("nan")
        q[qo[r]:qo[r + 1]] = float("nan")
    i32 = torch.int32
    return PagedData(
        q=q.to(device, dtype), layer=stored.to(device),
        qo_indptr=torch.tensor(qo, dtype=i32), kv_indptr=torch.tensor(indptr, dtype=i32),
        kv_indices=torch.tensor(indices, dtype=i32), last_page_len=torch.tensor(last, dtype=i32),
        kv_lens=torch.tensor(kv_lens, dtype=i32), keys=keys,
    )


def paged_oracle(case: PagedCase, data: PagedData, causal: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    q = data.q.double().cpu()
    outs = []
    for i, (k, v) in enumerate(data.keys):
        a, b = int(data.qo_indptr[i]), int(data.qo_indptr[i + 1])
        outs.append(attention_oracle(q[a:b], k, v, causal, case.window_left, case.sm_scale, case.soft_cap, sinks))
    return torch.cat(outs)


def assert_close(backend: WrapperSet, what: str, case: PagedCase | RaggedCase, out: torch.Tensor,
                  ref: torch.Tensor) -> float:
    """The output is a tensor shaped like the queries, in their dtype, on their device, and
    within the dtype's tolerance of the float64 oracle (a poisoned row aside)."""
    where = f"{backend.name} {what} [{case}]"
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{where}: run returned {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"{where}: output shape {tuple(out.shape)}, expected {tuple(ref.shape)} "
                             "(the queries' [tokens, Hq, D])")
    if out.dtype != backend.dtype:
        raise AssertionError(f"{where}: output dtype {out.dtype}, expected {backend.dtype} (the queries' dtype)")
    if out.device.type != torch.device(backend.device).type:
        raise AssertionError(f"{where}: output on {out.device}, expected {backend.device} (the queries' device)")
    if case.poison_row is not None:
        qo = [0, *itertools.accumulate(case.q_lens)]
        keep = torch.ones(out.shape[0], dtype=torch.bool)
        keep[qo[case.poison_row]:qo[case.poison_row + 1]] = False
        out, ref = out[keep.to(out.device)], ref[keep]
    err = rel_error(out, ref)
    tol = TOLERANCE[backend.dtype]
    if not err <= tol:
        raise AssertionError(f"{where}: relative error {err:.3g} > {tol:.3g}")
    return err


def _scale_kwargs(backend: WrapperSet, case: PagedCase) -> dict[str, Any]:
    """The plan's keyword arguments: the backend's, the case's sm_scale and features."""
    kw = dict(backend.extra_plan_kwargs)
    if case.sm_scale is not None:  # a paged plan takes it (and the features) as keywords
        kw["sm_scale"] = case.sm_scale
    if case.soft_cap is not None:
        kw["logits_soft_cap"] = case.soft_cap
    if KV_DTYPES[case.kv_dtype] is not None:
        kw["kv_data_type"] = KV_DTYPES[case.kv_dtype]
    return kw


def _run_kwargs(case: PagedCase, sinks: torch.Tensor | None) -> dict[str, Any]:
    """The run's keyword arguments for the case's features (none for a plain case, so a
    backend without the feature keywords still runs the plain suite)."""
    kw: dict[str, Any] = {}
    if KV_DTYPES[case.kv_dtype] is not None:
        kw["k_scale"], kw["v_scale"] = K_SCALE, V_SCALE
    if sinks is not None:
        kw["sinks"] = sinks
    return kw


def check_prefill(backend: WrapperSet, case: PagedCase, wrapper: Any = None) -> float:
    """One prefill case through a fresh wrapper (or ``wrapper``, planned again: see
    :mod:`.reuse`); the relative error, or AssertionError naming the case."""
    data = make_paged(case, backend.device, backend.dtype)
    hq = case.num_kv_heads * case.gqa
    w = wrapper or backend.prefill(backend.workspace(), hq, case.num_kv_heads, case.head_dim, case.page_size,
                                   device=torch.device(backend.device))
    _plan(case, lambda: w.plan(
        data.qo_indptr, data.kv_indptr, backend.indices(data), data.last_page_len, causal=case.causal,
        dtype=backend.dtype, kv_lens=data.kv_lens, window_left=case.window_left, **_scale_kwargs(backend, case)))
    sinks = sink_logits(case, backend.device)
    out = w.run(data.q, data.layer, **_run_kwargs(case, sinks))
    return assert_close(backend, "prefill", case, out, paged_oracle(case, data, case.causal, sinks))


def check_decode(backend: WrapperSet, case: PagedCase, wrapper: Any = None) -> float:
    assert all(n == 1 for n in case.q_lens), "decode cases have one query per row"
    data = make_paged(case, backend.device, backend.dtype)
    hq = case.num_kv_heads * case.gqa
    w = wrapper or backend.decode(backend.workspace(), hq, case.num_kv_heads, case.head_dim, case.page_size,
                                  device=torch.device(backend.device))
    w.plan(data.kv_indptr, backend.indices(data), data.last_page_len, dtype=backend.dtype, kv_lens=data.kv_lens,
           window_left=case.window_left, **_scale_kwargs(backend, case))
    sinks = sink_logits(case, backend.device)
    out = w.run(data.q, data.layer, **_run_kwargs(case, sinks))
    return assert_close(backend, "decode", case, out, paged_oracle(case, data, True, sinks))


def check_mixed(backend: WrapperSet, case: PagedCase, max_prefill_rows: int | None = None, wrapper: Any = None
                ) -> float:
    data = make_paged(case, backend.device, backend.dtype)
    hq = case.num_kv_heads * case.gqa
    rows = len(case.q_lens)
    prompts = sum(1 for n in case.q_lens if n > 1)
    w = wrapper or backend.mixed(backend.workspace(), backend.workspace(), hq, case.num_kv_heads, case.head_dim,
                                 case.page_size, rows, sum(case.q_lens), int(data.kv_indices.numel()) + 1,
                                 max_prefill_rows or max(prompts, 1), torch.device(backend.device))
    _plan(case, lambda: w.plan(
        data.qo_indptr, data.kv_indptr, data.kv_indices, data.last_page_len, causal=case.causal,
        dtype=backend.dtype, kv_lens=data.kv_lens, window_left=case.window_left, **_scale_kwargs(backend, case)))
    sinks = sink_logits(case, backend.device)
    out = w.run(data.q, data.layer, **_run_kwargs(case, sinks))
    return assert_close(backend, "mixed", case, out, paged_oracle(case, data, case.causal, sinks))


def check_ragged(backend: WrapperSet, case: RaggedCase, wrapper: Any = None) -> float:
    gen = torch.Generator().manual_seed(case.seed)
    hkv, d = case.num_kv_heads, case.head_dim
    hq = hkv * case.gqa
    k_lens = [p + q for p, q in zip(case.prefix_lens, case.q_lens, strict=True)]
    q = torch.randn((sum(case.q_lens), hq, d), generator=gen)
    k = torch.randn((sum(k_lens), hkv, d), generator=gen)
    v = torch.randn((sum(k_lens), hkv, d), generator=gen)
    cu_q = torch.tensor([0, *itertools.accumulate(case.q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32)
    dev, dt = backend.device, backend.dtype
    qd, kd, vd = (t.to(dt).double() for t in (q, k, v))  # the oracle's inputs: clean, even for a poisoned row
    if case.poison_row is not None:
        r = case.poison_row
        q[cu_q[r]:cu_q[r + 1]] = float("nan")
        k[cu_k[r]:cu_k[r + 1]], v[cu_k[r]:cu_k[r + 1]] = float("inf"), float("nan")
    w = wrapper or backend.ragged(hq, hkv, d, torch.device(dev), workspace_buffer=backend.workspace())
    plan_kw: dict[str, Any] = {} if case.window_left < 0 else {"window_left": case.window_left}
    if case.soft_cap is not None:
        plan_kw["logits_soft_cap"] = case.soft_cap
    if case.sm_scale is not None:
        plan_kw["sm_scale"] = case.sm_scale
    _plan(case, lambda: w.plan(cu_q, cu_k, max(case.q_lens), max(k_lens), causal=case.causal, dtype=dt, **plan_kw))
    sinks = sink_logits(case, dev)
    out = w.run(q.to(dev, dt), k.to(dev, dt), v.to(dev, dt), **({} if sinks is None else {"sinks": sinks}))
    ref = torch.cat([
        attention_oracle(qd[cu_q[i]:cu_q[i + 1]], kd[cu_k[i]:cu_k[i + 1]], vd[cu_k[i]:cu_k[i + 1]], case.causal,
                         case.window_left, case.sm_scale, case.soft_cap, sinks)
        for i in range(len(case.q_lens))
    ])
    return assert_close(backend, "ragged", case, out, ref)


# The suite's check per kind of case; each takes ``(backend, case, wrapper=None)``.
CHECKS: dict[str, Any] = {"prefill": check_prefill, "decode": check_decode, "mixed": check_mixed,
                          "ragged": check_ragged}
