"""The backend conformance suite: random paged and ragged cases, each wrapper's output against
the float64 oracle. Every backend runs it — the reference here, plugins through stand-in
modules on CPU and through the real libraries on the GPU.

Each case is planned once and run three times: twice on the same inputs (the outputs must be
bit-identical, and no input may change), then on the same values as strided views (q, and the
dense path's k/v, sliced out of a fused projection). Paged cases hold NaN in the unused slots of
every row's last page and in a page no row owns. A failure raises
:class:`~mstar_core.testing.rules.RuleError`, naming the rule (:data:`~mstar_core.testing.rules.RULES`).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.attention import calls
from mstar_core.attention.plans import PagedPlan, RaggedPlan, WrapperSize, paged_plan, ragged_plan
from mstar_core.features import KV_DTYPES
from mstar_core.kv.fp8 import quantize
from mstar_core.testing import numerics
from mstar_core.testing.oracle import attention_oracle, rel_error
from mstar_core.testing.rules import RuleError, at, bits_equal, check_unchanged, difference, largest, snapshot

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
    # Each case run three times (again, bit for bit; on strided views) rather than once, as
    # ``mstar check`` runs it (a test counting a library's calls per case may want one).
    thorough: bool = False
    # The plugin contract version its spec declares (None: 2.0 where the classes build from a
    # WrapperSize, else 1.1): how the kit builds and plans them (mstar_core.attention.calls).
    api_version: str | None = None

    def version(self, kind: str) -> str:
        """The contract version ``kind``'s wrapper ("prefill", "decode", "mixed", "ragged") speaks."""
        if self.api_version is not None:
            return self.api_version
        return "2.0" if hasattr(getattr(self, kind), "from_size") else "1.1"

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
    # Another layer of the same step: the same page table (drawn from ``seed``), other values.
    layer: int = 0
    # Scores shaped by :mod:`.numerics` (a key of ``numerics.SCORES``); "" for random unit-scale ones.
    scores: str = ""

    def __str__(self) -> str:
        c = "causal" if self.causal else "full"
        w = f"-win{self.window_left}" if self.window_left >= 0 else ""
        s = f"-scale{self.sm_scale:g}" if self.sm_scale is not None else ""
        return (f"ps{self.page_size}-d{self.head_dim}-{_heads(self)}-{c}{w}{s}{_feature_tag(self)}"
                f"-q{_lens(self.q_lens)}-p{_lens(self.prefix_lens)}")

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
    layer: int = 0  # as PagedCase's
    scores: str = ""  # as PagedCase's

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(p + q for p, q in zip(self.prefix_lens, self.q_lens, strict=True))

    def __str__(self) -> str:
        c = "causal" if self.causal else "full"
        w = f"-win{self.window_left}" if self.window_left >= 0 else ""
        s = f"-scale{self.sm_scale:g}" if self.sm_scale is not None else ""
        return (f"d{self.head_dim}-{_heads(self)}-{c}{w}{s}{_feature_tag(self)}-q{_lens(self.q_lens)}"
                f"-p{_lens(self.prefix_lens)}")


def _heads(case: PagedCase | RaggedCase) -> str:
    """``gqa4`` (two KV heads, the default), or ``gqa16-kv4`` (64 query heads)."""
    return f"gqa{case.gqa}" + (f"-kv{case.num_kv_heads}" if case.num_kv_heads != 2 else "")


def _lens(lens: tuple[int, ...]) -> str:
    """``1_7_16``; more than 8 rows: ``1x64`` (uniform), else the first values and the count."""
    if len(lens) > 8 and len(set(lens)) == 1:
        return f"{lens[0]}x{len(lens)}"
    if len(lens) > 8:
        return f"{'_'.join(map(str, lens[:6]))}_etc{len(lens)}"
    return "_".join(map(str, lens))


def _feature_tag(case: PagedCase | RaggedCase) -> str:
    kv_dtype = getattr(case, "kv_dtype", "auto")  # a ragged case stores the model dtype
    tag = f"-{kv_dtype}" if kv_dtype != "auto" else ""
    tag += f"-cap{case.soft_cap:g}" if case.soft_cap is not None else ""
    tag += f"-poison{case.poison_row}" if case.poison_row is not None else ""
    tag += f"-layer{case.layer}" if case.layer else ""
    tag += f"-scores_{case.scores}" if case.scores else ""
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
    # a window without the causal mask: each query sees every later key and window_left earlier ones
    cases.append(PagedCase(16, 128, 4, (3, 8, 17), (12, 20, 9), causal=False, window_left=4, seed=230))
    # uniform rows of a few queries each (speculative verification's shape)
    cases.append(PagedCase(16, 128, 4, (4,) * 6, (12, 30, 5, 17, 40, 9), seed=240))
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
    cases.append(PagedCase(16, 128, 4, (1, 9, 1, 17), (12, 7, 16, 6), causal=False, window_left=4, seed=640))
    return cases


def ragged_cases(head_dims=(64, 128), gqas=(1, 4, 8)) -> list[RaggedCase]:
    cases = []
    for i, (d, g, causal) in enumerate(itertools.product(head_dims, gqas, (True, False))):
        cases.append(RaggedCase(d, g, (1, 9, 16, 33), (0, 7, 16, 1), causal=causal, seed=700 + i))
    cases.append(RaggedCase(128, 4, (1, 9, 16), (8, 0, 30), sm_scale=0.07, seed=750))
    # The step's window_left reaches every dense backend (per-layer windows are the feature).
    cases.append(RaggedCase(128, 4, (1, 9, 16), (8, 7, 16), window_left=5, seed=760))  # bites on every row
    cases.append(RaggedCase(128, 4, (1, 9, 16), (8, 7, 16), causal=False, window_left=5, seed=770))
    return cases


# -- shapes past a kernel's typical tiles ----------------------------------------------------------


def _cycle(values: tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(values[i % len(values)] for i in range(n))


def shape_cases(kind: str, head_dim: int = 128) -> list[PagedCase] | list[RaggedCase]:
    """Cases past the tiles a kernel is usually written around: up to 64 rows (a row tile of 8
    or 16 whose later tiles index from 0 shows), up to 64 query heads (likewise a head tile),
    GQA 1 to 16, page sizes 1 to 64, rows ending on and just past a page boundary."""
    if kind == "ragged":
        return [
            RaggedCase(head_dim, 4, _cycle((1, 3, 2, 5), 40), _cycle((0, 7, 16, 33, 2), 40), seed=1200),
            RaggedCase(head_dim, 16, (5, 20, 1, 9, 2), (60, 2, 70, 0, 33), num_kv_heads=4, seed=1210),
            RaggedCase(head_dim, 2, _cycle((3, 1, 8), 10), _cycle((20, 0, 5, 40), 10), num_kv_heads=32, seed=1220),
            RaggedCase(head_dim, 1, (2, 17, 4), (9, 0, 40), num_kv_heads=24, causal=False, seed=1230),
        ]
    if kind == "decode":
        return [
            PagedCase(8, head_dim, 8, (1,) * 64, _cycle((0, 7, 8, 9, 31, 100, 3, 64), 64), seed=1240),
            PagedCase(64, head_dim, 8, (1,) * 9, (0, 63, 64, 65, 127, 128, 200, 5, 1), num_kv_heads=8, seed=1250),
            PagedCase(32, head_dim, 2, (1,) * 12, _cycle((31, 32, 33, 0, 90, 7), 12), num_kv_heads=16, seed=1260),
            PagedCase(1, head_dim, 16, (1,) * 20, _cycle((0, 1, 2, 17, 40), 20), num_kv_heads=1, seed=1270),
        ]
    if kind == "mixed":
        q = _cycle((1, 1, 1, 1, 1, 7, 1, 1, 1, 1, 1, 12), 36)
        return [
            PagedCase(32, head_dim, 16, q, _cycle((12, 0, 31, 32, 33, 5, 64, 1, 2, 90, 0, 3), 36), seed=1280),
            PagedCase(64, head_dim, 8, (1, 20, 1, 1, 5, 1, 1, 1, 1, 2), (63, 0, 64, 65, 60, 1, 2, 127, 128, 3),
                      num_kv_heads=8, seed=1290),
            PagedCase(1, head_dim, 1, _cycle((1, 4, 1), 18), _cycle((5, 0, 9, 20), 18), num_kv_heads=24, seed=1300),
        ]
    return [
        PagedCase(16, head_dim, 4, _cycle((1, 3, 2, 5), 40), _cycle((0, 7, 16, 33, 2), 40), seed=1310),
        PagedCase(64, head_dim, 16, (5, 20, 1, 9), (60, 2, 70, 0), num_kv_heads=4, seed=1320),
        PagedCase(8, head_dim, 2, _cycle((3, 1, 8), 12), _cycle((20, 0, 5, 40), 12), num_kv_heads=32, seed=1330),
        PagedCase(1, head_dim, 1, (2, 17, 4), (9, 0, 40), num_kv_heads=24, causal=False, seed=1340),
        PagedCase(3, head_dim, 4, (6, 2, 9), (5, 3, 0), seed=1350),  # a page size no power of two
    ]


def multi_token_cases(head_dim: int = 128) -> list[PagedCase]:
    """Uniform rows of 2..8 queries, causal, as the managers plan multi-token decode
    (speculative verification) on the wrapper that declares it; one with a window that bites."""
    return [
        PagedCase(16, head_dim, 4, (2,) * 16, _cycle((0, 15, 16, 30, 3, 99), 16), seed=1400),
        PagedCase(1, head_dim, 8, (4,) * 9, _cycle((12, 1, 40, 5), 9), seed=1410),
        PagedCase(16, head_dim, 4, (8,) * 5, (20, 33, 16, 47, 12), window_left=6, seed=1420),
        PagedCase(32, head_dim, 16, (3,) * 24, _cycle((0, 31, 32, 64, 5, 9), 24), num_kv_heads=4, seed=1430),
    ]


# The longest row the numerics cases build (keys), and the longest under --quick.
LONG_KEYS, QUICK_LONG_KEYS = 32768, 8192


def numerics_cases(kind: str, head_dim: int = 128, quick: bool = False) -> list[PagedCase] | list[RaggedCase]:
    """For ``kind``: scores in the hundreds, positive and negative, differing from one stretch of a
    row to the next (:mod:`.numerics`); rows whose every score is far below zero; a long row of
    unit-scale scores (bf16 or fp16 accumulation shows) and one of scores in the hundreds. Long
    rows hold :data:`LONG_KEYS` keys (``quick``: :data:`QUICK_LONG_KEYS`), beside short ones."""
    n = QUICK_LONG_KEYS if quick else LONG_KEYS
    if kind == "ragged":
        return [RaggedCase(head_dim, 4, (5, 1, 16), (300, 1000, 40), scores="hundreds", seed=1500),
                RaggedCase(head_dim, 4, (3, 9), (200, 7), scores="below", seed=1510),
                RaggedCase(head_dim, 4, (8, 2), (n - 8, 500), num_kv_heads=1, seed=1520),
                RaggedCase(head_dim, 4, (8, 2), (n - 8, 500), num_kv_heads=1, scores="hundreds", seed=1530)]
    if kind == "decode":
        return [PagedCase(16, head_dim, 4, (1,) * 6, (300, 40, 1000, 5, 700, 190), scores="hundreds", seed=1540),
                PagedCase(16, head_dim, 4, (1,) * 3, (50, 200, 7), scores="below", seed=1550),
                PagedCase(64, head_dim, 4, (1,) * 3, (n - 1, 3000, 10), num_kv_heads=1, seed=1560),
                PagedCase(64, head_dim, 4, (1,) * 3, (n - 1, 3000, 10), num_kv_heads=1, scores="hundreds", seed=1570)]
    if kind == "mixed":
        return [PagedCase(16, head_dim, 4, (1, 9, 1, 4), (300, 40, 1000, 190), scores="hundreds", seed=1580),
                PagedCase(16, head_dim, 4, (1, 6, 1), (50, 200, 7), scores="below", seed=1590),
                PagedCase(64, head_dim, 4, (1, 8, 1), (n - 1, 500, 10), num_kv_heads=1, seed=1600),
                PagedCase(64, head_dim, 4, (1, 8, 1), (n - 1, 500, 10), num_kv_heads=1, scores="hundreds", seed=1610)]
    return [PagedCase(16, head_dim, 4, (5, 1, 16), (300, 1000, 40), scores="hundreds", seed=1620),
            PagedCase(16, head_dim, 4, (3, 9), (200, 7), scores="below", seed=1630),
            PagedCase(64, head_dim, 4, (8, 2), (n - 8, 500), num_kv_heads=1, seed=1640),
            PagedCase(64, head_dim, 4, (8, 2), (n - 8, 500), num_kv_heads=1, scores="hundreds", seed=1650)]


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
    no other row may notice, and rows with fewer keys than queries (a decode row: no keys at all),
    whose first queries see no key and must return zeros (or the plan is refused)."""
    if kind == "ragged":
        return [RaggedCase(head_dim, 4, (9, 16, 5), (7, 16, 3), poison_row=1, seed=1000),
                RaggedCase(head_dim, 4, (6, 4, 9), (-3, 2, -5), seed=1010)]
    if kind == "decode":  # rows without keys (no pages) first, between others and last
        return [PagedCase(page_size, head_dim, 4, (1, 1, 1, 1), (20, 3, 41, 16), poison_row=1, seed=1020),
                PagedCase(page_size, head_dim, 4, (1,) * 6, (-1, 20, -1, 41, 16, -1), seed=1025)]
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


def feature_cases(kind: str, features: Any, page_sizes=(1, 16), head_dim: int = 128,
                  excludes: Sequence[Sequence[str]] = ()) -> list[PagedCase]:
    """Cases for ``kind`` (``"prefill"``, ``"decode"``, ``"mixed"``) exercising every feature in
    ``features`` (a backend's ``BackendSpec.supports(capability)``), alone and combined, but no
    combination ``excludes`` names (``BackendSpec.excludes[capability]``).
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
    variants = [v for v in variants if not any(set(x) <= _variant_features(v) for x in excludes)]
    cases = []
    for i, (((q, p), ps), extra) in enumerate(itertools.product(shapes, variants)):
        cases.append(PagedCase(ps, head_dim, 4, q, p, seed=800 + i, **extra))
    return cases


def _variant_features(v: dict[str, Any]) -> set[str]:
    """The feature names a feature case's keywords ask for."""
    names = {v["kv_dtype"]} if "kv_dtype" in v else set()
    return names | {n for k, n in (("soft_cap", "soft_cap"), ("sinks", "sink_logits")) if v.get(k)}


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


def make_paged(case: PagedCase, device: str, dtype: torch.dtype, stale_nan: bool = False) -> PagedData:
    """Random data in a paged layer whose pages are scattered (a random permutation), plus a
    spare page nobody owns filled with large values, so a kernel that reads outside its pages
    shows. ``stale_nan`` (what the suite's checks use): also NaN in the unused slots of every
    row's last page and in a second page nobody owns, which no output may show."""
    gen = torch.Generator().manual_seed(case.seed)
    ps, hkv, d = case.page_size, case.num_kv_heads, case.head_dim
    hq = hkv * case.gqa
    kv_lens = case.kv_lens
    n_pages = [-(-n // ps) for n in kv_lens]
    spare = 2 if stale_nan else 1
    total_pages = sum(n_pages) + spare
    perm = torch.randperm(total_pages, generator=gen)
    if case.layer:  # the same pages, other values
        gen = torch.Generator().manual_seed(case.seed * 1000 + case.layer)
    layer = torch.randn((total_pages, 2, ps, hkv, d), generator=gen) * 0.5
    layer[perm[-1]] = 1e4  # the poison page
    shaped = _shape_paged(case, layer, perm, n_pages) if case.scores else None
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
    if stale_nan:  # after the oracle's keys were taken: they never see these
        stored[perm[-2]] = float("nan")
        for r in range(len(kv_lens)):
            if n_pages[r] and last[r] < ps:
                stored[indices[indptr[r + 1] - 1], :, last[r]:] = float("nan")
    tokens = sum(case.q_lens)
    q = torch.randn((tokens, hq, d), generator=gen) if shaped is None else shaped
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


def _shape_paged(case: PagedCase, layer: torch.Tensor, perm: torch.Tensor, n_pages: list[int]) -> torch.Tensor:
    """Add the case's score offsets (:func:`.numerics.shape_scores`) to each row's keys in
    ``layer`` (its pages in ``perm`` order, as :func:`make_paged` hands them out); the queries."""
    gen = torch.Generator().manual_seed(case.seed + 31)
    q = torch.empty((sum(case.q_lens), case.num_kv_heads * case.gqa, case.head_dim))
    adds = numerics.shape_scores(case.scores, q, list(case.kv_lens), case.gqa, case.sm_scale, gen)
    cursor, ps = 0, case.page_size
    for add, pages in zip(adds, n_pages, strict=True):
        own = perm[cursor:cursor + pages]
        cursor += pages
        flat = torch.zeros((pages * ps, *add.shape[1:]))
        flat[:add.shape[0]] = add
        layer[own, 0] = layer[own, 0] + flat.reshape(pages, ps, *add.shape[1:])
    return q


def paged_oracle(case: PagedCase, data: PagedData, causal: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    q = data.q.double().cpu()
    outs = []
    for i, (k, v) in enumerate(data.keys):
        a, b = int(data.qo_indptr[i]), int(data.qo_indptr[i + 1])
        outs.append(attention_oracle(q[a:b], k, v, causal, case.window_left, case.sm_scale, case.soft_cap, sinks))
    return torch.cat(outs)


def fused_view(t: torch.Tensor, before: int, after: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [tokens, H, D]``'s values as a strided view into a fused projection ``[tokens,
    before + H + after, D]`` (heads ``before:before + H``; the others random), and that buffer."""
    n, h, d = t.shape
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn((n, before + h + after, d), generator=gen).to(t.device, t.dtype)
    base[:, before:before + h] = t
    return base[:, before:before + h], base


def no_key_queries(case: PagedCase | RaggedCase) -> torch.Tensor:
    """``[tokens]`` bool: the queries that see no key (a causal row with fewer keys than queries)."""
    flags = []
    for n, p in zip(case.q_lens, case.prefix_lens, strict=True):
        blind = min(n, max(0, -p)) if case.causal else (n if n + p <= 0 else 0)
        flags += [True] * blind + [False] * (n - blind)
    return torch.tensor(flags, dtype=torch.bool)


def _same_device(out: torch.device, want: torch.device) -> bool:
    if want.index is None:  # "cuda": the current device
        want = torch.device(want.type, torch.cuda.current_device()) if want.type == "cuda" else want
        return out.type == want.type and (out.index is None or want.index is None or out.index == want.index)
    return out == want


def _row_of(case: PagedCase | RaggedCase, token: int) -> int:
    end = 0
    for r, n in enumerate(case.q_lens):
        end += n
        if token < end:
            return r
    return len(case.q_lens) - 1


def assert_close(backend: WrapperSet, what: str, case: PagedCase | RaggedCase, out: torch.Tensor,
                 ref: torch.Tensor, q: torch.Tensor | None = None, rule: str | None = None) -> float:
    """The output is a tensor shaped like the queries (``q``; None: the backend's dtype and
    device), in their dtype, on their device, and within the dtype's tolerance of the float64
    oracle (a poisoned row aside). Raises :class:`RuleError` naming the rule: ``rule`` where
    given (a run on strided views), else the one the failure points at -- the queries that see
    no key, NaN reaching a clean row (from a poisoned row, or from what a paged row does not
    own), or the oracle."""
    where = f"{backend.name} {what} [{case}]"

    def fail(r: str, detail: str, error: float | None = None) -> None:
        raise RuleError(rule or r, where, detail, error)

    if not isinstance(out, torch.Tensor):
        fail("shape", f"run returned {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != tuple(ref.shape):
        fail("shape", f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)} (the queries' [tokens, Hq, D])")
    out64 = out.detach().to("cpu", torch.float64)
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    if case.poison_row is not None:
        qo = [0, *itertools.accumulate(case.q_lens)]
        keep[qo[case.poison_row]:qo[case.poison_row + 1]] = False
    want_dtype = q.dtype if q is not None else backend.dtype
    errs = row_errors(case, out64, ref, keep)
    err = max(errs, default=0.0)
    if out.dtype != want_dtype:
        fail("dtype", f"output dtype {out.dtype}, expected {want_dtype} (the queries' dtype); relative error "
                      f"{err:.3g}", err)
    want_device = q.device if q is not None else torch.device(backend.device)
    if not _same_device(out.device, want_device):
        fail("device", f"output on {out.device}, expected {want_device} (the queries' device); relative error "
                       f"{err:.3g}", err)
    tols = row_tolerances(case, want_dtype)
    over = [r for r, (e, t) in enumerate(zip(errs, tols, strict=True)) if e > t]
    if not over:
        return err
    row = max(over, key=lambda r: errs[r] / tols[r])
    diff = (out64 - ref).abs()
    diff = torch.where(diff.isnan(), float("inf"), diff)
    diff[~keep] = 0.0
    worst, idx = largest(diff)
    spot = f"{at(idx)} (row {_row_of(case, idx[0])})" if idx else "nowhere"
    detail = (f"row {row} ({case.q_lens[row]} queries, {case.kv_lens[row]} keys): relative error {errs[row]:.3g} > "
              f"{tols[row]:.3g}; largest error {worst:.3g} at {spot}")
    blind = no_key_queries(case) & keep
    if blind.any() and all(e <= t for e, t in zip(row_errors(case, out64, ref, keep & ~blind), tols, strict=True)):
        fail("no-key", f"{detail}, a query that sees no key", err)
    if not torch.isfinite(out64[keep]).all():
        if case.poison_row is not None:
            fail("isolation", f"{detail}: row {case.poison_row}'s NaN/inf reached another row", err)
        if isinstance(case, PagedCase):
            fail("stale-slots", f"{detail}: NaN from slots the row does not own (its last page's unused slots, "
                                "a page no row owns)", err)
    fail("oracle", detail, err)
    return err


def row_errors(case: PagedCase | RaggedCase, out64: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor
               ) -> list[float]:
    """Each row's relative error, ``||out - ref|| / ||ref||`` over its ``keep`` queries (inf where
    the output holds NaN or inf; 0 for a row with none kept)."""
    errs, a = [], 0
    for n in case.q_lens:
        sel = keep[a:a + n]
        errs.append(rel_error(out64[a:a + n][sel], ref[a:a + n][sel]) if sel.any() else 0.0)
        a += n
    return errs


def row_tolerances(case: PagedCase | RaggedCase, dtype: torch.dtype) -> list[float]:
    """Each row's tolerance: the dtype's (:data:`TOLERANCE`), grown with the row's keys as float32
    summation's error grows (:func:`.numerics.tolerance`)."""
    reach = numerics.REACH + 10.0 if case.scores else 0.0  # the shaped scores' largest, noise included
    return [numerics.tolerance(TOLERANCE[dtype], dtype, n, reach, case.head_dim) for n in case.kv_lens]


@dataclass
class Ran:
    """One case's first output as ``run`` returned it (the caller holds it across later runs)
    and a copy of it taken at once."""

    error: float
    out: torch.Tensor
    value: torch.Tensor
    where: str


def exercise(backend: WrapperSet, what: str, case: PagedCase | RaggedCase, run: Callable[..., torch.Tensor],
             args: dict[str, torch.Tensor], strided: dict[str, tuple[torch.Tensor, torch.Tensor]],
             others: dict[str, torch.Tensor], before: dict[str, torch.Tensor], ref: torch.Tensor) -> Ran:
    """A planned case's runs: ``run(**args)`` against the oracle, every input (``args``,
    ``others``: the plan's arrays, the cache, sinks) as ``before`` it. Where the backend is
    ``thorough``: the same again, bit for bit; then ``run`` on ``strided`` (name -> (view, the
    buffer it is cut from)) in place of those args, against the oracle, no part of those buffers
    written; the first output must still hold its value after those runs."""
    where = f"{backend.name} {what} [{case}]"
    inputs = {**args, **others}
    out = run(**args)
    err = assert_close(backend, what, case, out, ref, q=args["q"])
    check_unchanged(where, inputs, before, "after a run")
    value = out.detach().clone()
    if not backend.thorough:
        return Ran(err, out, value, where)
    again = run(**args)
    if not isinstance(again, torch.Tensor) or not bits_equal(again, value):
        d, idx = difference(again, value) if isinstance(again, torch.Tensor) and again.shape == value.shape \
            else (float("inf"), ())
        raise RuleError("deterministic", where, f"two runs of the same plan and inputs differ: largest difference "
                        f"{d:.3g} at {at(idx)}", d)
    check_unchanged(where, inputs, before, "after a second run")
    views = {n: v for n, (v, _) in strided.items()}
    bases = {f"the fused buffer of {n}": b for n, (_, b) in strided.items()}
    bases_before = snapshot(bases)
    out_s = run(**{**args, **views})
    assert_close(backend, f"{what} on strided views ({', '.join(strided)})", case, out_s, ref, q=views.get("q"),
                 rule="strided-inputs")
    check_unchanged(where, bases, bases_before, "after a run on strided views")
    if not bits_equal(out, value):
        d, idx = difference(out, value)
        raise RuleError("owned-output", where, f"the first run's output changed under later runs of the same plan: "
                        f"largest change {d:.3g} at {at(idx)}", d)
    return Ran(err, out, value, where)


def _run_kwargs(case: PagedCase, sinks: torch.Tensor | None) -> dict[str, Any]:
    """The run's keyword arguments for the case's features (none for a plain case, so a
    backend without the feature keywords still runs the plain suite)."""
    kw: dict[str, Any] = {}
    if KV_DTYPES[case.kv_dtype] is not None:
        kw["k_scale"], kw["v_scale"] = K_SCALE, V_SCALE
    if sinks is not None:
        kw["sinks"] = sinks
    return kw


KIND_CAPABILITY = {"prefill": "paged_prefill", "decode": "paged_decode", "mixed": "mixed", "ragged": "prefixed_ragged"}


def build(backend: WrapperSet, kind: str, case: PagedCase | RaggedCase, data: PagedData | None = None,
          device: str | None = None) -> Any:
    """A fresh wrapper of ``kind`` sized for ``case`` (``data``: its paged data, for the mixed
    wrapper's sizes), built as the managers build it (:func:`mstar_core.attention.calls.build_wrapper`)."""
    dev = torch.device(device or backend.device)
    hq = case.num_kv_heads * case.gqa
    size = WrapperSize(hq, case.num_kv_heads, case.head_dim, dev, workspace_bytes=backend.workspace_bytes)
    if kind != "ragged":
        assert isinstance(case, PagedCase)
        size = WrapperSize(hq, case.num_kv_heads, case.head_dim, dev, case.page_size,
                           workspace_bytes=backend.workspace_bytes)
    if kind == "mixed":
        assert data is not None and isinstance(case, PagedCase)
        prompts = sum(1 for n in case.q_lens if n > 1)
        size = mixed_size(size, len(case.q_lens), sum(case.q_lens), int(data.layer.shape[0]), max(prompts, 1))
    return calls.build_wrapper(getattr(backend, kind), KIND_CAPABILITY[kind], size, backend.version(kind))


def mixed_size(size: WrapperSize, rows: int, tokens: int, pages: int, prefill_rows: int) -> WrapperSize:
    return WrapperSize(size.num_qo_heads, size.num_kv_heads, size.head_dim, size.device, size.page_size,
                       batch_size=rows, max_total_tokens=tokens, max_num_pages=pages, max_prefill_rows=prefill_rows,
                       workspace_bytes=size.workspace_bytes)


def paged_arrays(backend: WrapperSet, kind: str, data: PagedData) -> dict[str, torch.Tensor]:
    """The index arrays a ``kind`` plan gets, as the paged manager passes them: page indices on
    the device for prefill and decode (``WrapperSet.device_indices``), on the host for mixed
    (its split is host arithmetic); the rest on the host."""
    arrays = {"paged_kv_indptr": data.kv_indptr,
              "paged_kv_indices": data.kv_indices if kind == "mixed" else backend.indices(data),
              "paged_kv_last_page_len": data.last_page_len, "kv_lens": data.kv_lens}
    if kind != "decode":
        arrays["qo_indptr"] = data.qo_indptr
    return arrays


def make_plan(backend: WrapperSet, kind: str, case: PagedCase, data: PagedData,
              arrays: dict[str, torch.Tensor] | None = None) -> PagedPlan:
    """The case's plan, built and checked as the managers build it (:func:`paged_plan`), from
    ``arrays`` (:func:`paged_arrays`)."""
    a = arrays if arrays is not None else paged_arrays(backend, kind, data)
    decode = kind == "decode"
    return paged_plan(KIND_CAPABILITY[kind], None if decode else a["qo_indptr"], a["paged_kv_indptr"],
                      a["paged_kv_indices"], a["paged_kv_last_page_len"], case.page_size, data.q.dtype,
                      causal=True if decode else case.causal, kv_lens=a["kv_lens"], window_left=case.window_left,
                      sm_scale=case.sm_scale, logits_soft_cap=case.soft_cap, kv_data_type=KV_DTYPES[case.kv_dtype],
                      sink_logits=case.sinks, query_tokens=case.q_lens[0] if decode and case.q_lens else 1,
                      who=f"mstar check ({kind} case)")


def plan_paged(backend: WrapperSet, kind: str, case: PagedCase, data: PagedData, w: Any,
               arrays: dict[str, torch.Tensor] | None = None, extra: dict[str, Any] | None = None) -> None:
    """Plan ``w`` for ``case`` as the managers do (:func:`mstar_core.attention.calls.plan_paged`),
    with ``arrays`` (:func:`paged_arrays`); ``extra``: more plan keywords (a 1.x wrapper's)."""
    plan = make_plan(backend, kind, case, data, arrays)
    kw = {**backend.extra_plan_kwargs, **(extra or {})}
    _plan(case, lambda: calls.plan_paged(w, plan, backend.version(kind), kw))


def run_paged(backend: WrapperSet, kind: str, case: PagedCase, wrapper: Any = None) -> Ran:
    """One paged case (``kind``: "prefill", "decode", "mixed") through a fresh wrapper (or
    ``wrapper``, planned again: see :mod:`.reuse`), run as :func:`exercise` says."""
    if kind == "decode":
        assert len(set(case.q_lens)) == 1 and case.causal, "decode cases have uniform causal rows"
    # NaN in what no row owns, except where a poisoned row's NaN is the point (so that NaN in
    # another row tells which rule it broke)
    data = make_paged(case, backend.device, backend.dtype, stale_nan=case.poison_row is None)
    w = wrapper or build(backend, kind, case, data)
    sinks = sink_logits(case, backend.device)
    arrays = paged_arrays(backend, kind, data)
    others = {"kv_cache_layer": data.layer, **arrays, **({"sinks": sinks} if sinks is not None else {})}
    before = snapshot({"q": data.q, **others})
    plan_paged(backend, kind, case, data, w, arrays)
    kw = _run_kwargs(case, sinks)
    layer = data.layer
    ref = paged_oracle(case, data, case.causal if kind != "decode" else True, sinks)
    strided = {"q": fused_view(data.q, 0, 2 * case.num_kv_heads, case.seed + 7)}
    try:
        return exercise(backend, kind, case, lambda q: w.run(q, layer, **kw), {"q": data.q}, strided, others,
                        before, ref)
    except RuleError as e:
        if e.rule != "stale-slots":
            raise
        clean = w.run(data.q, torch.nan_to_num(layer.float(), nan=0.0).to(layer.dtype), **kw)
        if isinstance(clean, torch.Tensor) and not torch.isfinite(clean.detach().cpu()).all():
            raise RuleError("oracle", e.where, f"{e.detail}; with those slots zeroed the output still holds NaN or "
                            "inf: the kernel's own arithmetic overflows or divides by zero", e.error) from None
        raise


def check_prefill(backend: WrapperSet, case: PagedCase, wrapper: Any = None) -> float:
    """One prefill case through a fresh wrapper (or ``wrapper``, planned again: see
    :mod:`.reuse`); the relative error, or :class:`RuleError` naming the rule and the case."""
    return run_paged(backend, "prefill", case, wrapper).error


def check_decode(backend: WrapperSet, case: PagedCase, wrapper: Any = None) -> float:
    return run_paged(backend, "decode", case, wrapper).error


def check_mixed(backend: WrapperSet, case: PagedCase, max_prefill_rows: int | None = None, wrapper: Any = None
                ) -> float:
    """``max_prefill_rows``: the mixed wrapper's (a fresh one's; default: the case's prompt rows)."""
    if wrapper is None and max_prefill_rows is not None:
        data = make_paged(case, backend.device, backend.dtype, stale_nan=True)
        size = WrapperSize(case.num_kv_heads * case.gqa, case.num_kv_heads, case.head_dim, torch.device(backend.device),
                           case.page_size, workspace_bytes=backend.workspace_bytes)
        size = mixed_size(size, len(case.q_lens), sum(case.q_lens), int(data.layer.shape[0]), max_prefill_rows)
        wrapper = calls.build_wrapper(backend.mixed, "mixed", size, backend.version("mixed"))
    return run_paged(backend, "mixed", case, wrapper).error


@dataclass
class RaggedData:
    q: torch.Tensor  # [tokens, Hq, D], on the device
    k: torch.Tensor  # [keys, Hkv, D]
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    ref: torch.Tensor  # the oracle's output, computed before any poison


def make_ragged(case: RaggedCase, device: str, dtype: torch.dtype, sinks: torch.Tensor | None = None
                ) -> RaggedData:
    gen = torch.Generator().manual_seed(case.seed * 1000 + case.layer if case.layer else case.seed)
    hkv, d = case.num_kv_heads, case.head_dim
    hq = hkv * case.gqa
    k_lens = [p + q for p, q in zip(case.prefix_lens, case.q_lens, strict=True)]
    q = torch.randn((sum(case.q_lens), hq, d), generator=gen)
    k = torch.randn((sum(k_lens), hkv, d), generator=gen)
    v = torch.randn((sum(k_lens), hkv, d), generator=gen)
    cu_q = torch.tensor([0, *itertools.accumulate(case.q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32)
    if case.scores:  # offsets on each segment's keys, the queries aimed at them (numerics.shape_scores)
        sgen = torch.Generator().manual_seed(case.seed + 31)
        adds = numerics.shape_scores(case.scores, q, k_lens, case.gqa, case.sm_scale, sgen)
        k = k + torch.cat(adds) if adds else k
    qd, kd, vd = (t.to(dtype).double() for t in (q, k, v))  # the oracle's inputs: clean, even for a poisoned row
    if case.poison_row is not None:
        r = case.poison_row
        q[cu_q[r]:cu_q[r + 1]] = float("nan")
        k[cu_k[r]:cu_k[r + 1]], v[cu_k[r]:cu_k[r + 1]] = float("inf"), float("nan")
    ref = torch.cat([
        attention_oracle(qd[cu_q[i]:cu_q[i + 1]], kd[cu_k[i]:cu_k[i + 1]], vd[cu_k[i]:cu_k[i + 1]], case.causal,
                         case.window_left, case.sm_scale, case.soft_cap, sinks)
        for i in range(len(case.q_lens))
    ])
    return RaggedData(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), cu_q, cu_k, ref)


def make_ragged_plan(case: RaggedCase, data: RaggedData) -> RaggedPlan:
    k_lens = (data.cu_k[1:] - data.cu_k[:-1]).tolist()
    return ragged_plan(data.cu_q, data.cu_k, max(case.q_lens), max(k_lens), data.q.dtype, causal=case.causal,
                       window_left=case.window_left, sm_scale=case.sm_scale, logits_soft_cap=case.soft_cap,
                       sink_logits=case.sinks, who="mstar check (ragged case)")


def plan_ragged(case: RaggedCase, data: RaggedData, w: Any, extra: dict[str, Any] | None = None,
                api_version: str | None = None) -> None:
    """Plan ``w`` for ``case`` as the dense manager does; ``api_version`` None: 2.0 where the
    wrapper builds from a WrapperSize, else 1.1."""
    version = api_version or ("2.0" if hasattr(type(w), "from_size") else "1.1")
    plan = make_ragged_plan(case, data)
    _plan(case, lambda: calls.plan_ragged(w, plan, version, extra))


def run_ragged(backend: WrapperSet, case: RaggedCase, wrapper: Any = None) -> Ran:
    """One prefixed ragged case, run as :func:`exercise` says (k and v too as strided views)."""
    dev = backend.device
    sinks = sink_logits(case, dev)
    data = make_ragged(case, dev, backend.dtype, sinks)
    w = wrapper or build(backend, "ragged", case)
    tensors = {"q": data.q, "k": data.k, "v": data.v}
    others = {"cu_q": data.cu_q, "cu_k": data.cu_k, **({"sinks": sinks} if sinks is not None else {})}
    before = snapshot({**tensors, **others})
    plan_ragged(case, data, w, api_version=backend.version("ragged"))
    kw = {} if sinks is None else {"sinks": sinks}
    hkv = case.num_kv_heads
    kv_view, kv_base = fused_view(torch.cat([data.k, data.v], dim=1), 0, 0, case.seed + 7)
    strided = {"q": fused_view(data.q, 0, 2 * hkv, case.seed + 8),
               "k": (kv_view[:, :hkv], kv_base), "v": (kv_view[:, hkv:], kv_base)}
    return exercise(backend, "ragged", case, lambda q, k, v: w.run(q, k, v, **kw), tensors, strided, others,
                    before, data.ref)


def check_ragged(backend: WrapperSet, case: RaggedCase, wrapper: Any = None) -> float:
    return run_ragged(backend, case, wrapper).error


# The suite's check per kind of case; each takes ``(backend, case, wrapper=None)``.
CHECKS: dict[str, Any] = {"prefill": check_prefill, "decode": check_decode, "mixed": check_mixed,
                          "ragged": check_ragged}
# The same, returning what ran (:class:`Ran`): the output, held, and its value.
RUNS: dict[str, Callable[..., Ran]] = {
    "prefill": lambda b, c, wrapper=None: run_paged(b, "prefill", c, wrapper),
    "decode": lambda b, c, wrapper=None: run_paged(b, "decode", c, wrapper),
    "mixed": lambda b, c, wrapper=None: run_paged(b, "mixed", c, wrapper),
    "ragged": run_ragged,
}
