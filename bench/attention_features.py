"""The attention features (FP8 KV, soft-cap, sliding window, FA3 softcap / window / sinks,
multi-token decode) through mstar against the same call to the raw library, in one process on one
GPU.

    python3 bench/attention_features.py --out $OUT [--sections fp8,softcap,...] [--quick]

Writes attention_features.json and .md into --out (rewritten after every section, so a run cut
short keeps what it measured): environment, shapes, every figure, each target met or not. Kernel
times are CUDA-event medians (mstar_core.testing.timing); every mstar-vs-raw pair is timed in
alternating rounds (``paired_ms``) and its outputs compared (relative Frobenius difference), so a
fast wrong path is caught. bf16 queries, 32 query heads, 8 KV heads, head dim 128, page size 16.

Sections (each in its own try/except; a failure is recorded as ``{"error": ...}``):

- ``fp8``: paged decode 64 x 8192 with an FP8 (e4m3) KV cache made by quantising a bf16 cache with
  k_scale 0.5, v_scale 2.0. mstar's FlashInferDecodeWrapper (plan ``kv_data_type``, run
  ``k_scale``/``v_scale``) vs raw FlashInfer (tensor cores, as mstar picks them): <= 1.03x. Then
  every FP8 decode path FlashInfer 0.5.3 offers here, each checked against the bf16 decode of the
  dequantised cache (the same values) and timed paired with the bf16 decode: FP8 speed-up >= 1.6x
  wanted. A candidate that fails is recorded with its exception and the rest go on.
- ``softcap``: paged prefill (8 x 512 new tokens over 2048 cached) and paged decode 64 x 8192 with
  logits_soft_cap 30: <= 1.03x raw each. Queries are scaled so the logits' spread is about the
  cap (otherwise a dropped cap would change nothing measurable).
- ``window``: paged decode 64 x 8192 with window_left 1024: <= 1.03x raw.
- ``fa3``: mstar's FA3PrefixedPrefillWrapper vs flash_attn_varlen_func, 8 segments x (1024 prefix
  + 1024 fresh), causal: plain (control), softcap 30, window 512, sinks: <= 1.03x raw each.
- ``multitoken``: 32-layer decode, 64 rows x 4 query tokens over 8192, CUDA graphs + pre-plan (the
  loop of mstar_core.demo.decode_bench, which bench/runner_steps.py times for one token, with
  ``AttentionFeatures(decode_query_tokens=4)`` and ``GraphRunner(query_tokens=4)``): step <= 1.10x
  the step's kernels replayed back to back; the same steps eagerly, for scale. Where mstar does not
  capture 4-token rows, the refusal is the result.
- ``multitoken_kernels``: what one layer of such a step costs in raw FlashInfer -- the paged prefill
  wrapper (mstar runs multi-token rows on it) with backend "auto" (fa3 on sm90) and "fa2", against
  one-token tensor-core decode over the same cache.

Splitting a run over processes (``--sections fp8``, then the rest) keeps every pair in one process
and keeps a candidate kernel that poisons the CUDA context (an illegal address) from failing the
other sections; the JIT compiles FlashInfer needs here take about a minute in all on a fresh machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import report
import torch
from paged import BF16, DEV, HKV, HQ, PS, D, random_cache, uniform_layout, workspace

from mstar_core.backends.varlen import first_output as first
from mstar_core.testing import timing
from mstar_core.testing.oracle import rel_error

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 2.0
SOFT_CAP = 30.0
DECODE_WINDOW = 1024
FA3_WINDOW = 512
RATIO = 1.03  # mstar kernel time <= RATIO x raw
AGREE_TOL = 1e-2  # mstar vs raw: the same kernel, so ~0 expected
EXACT_TOL = 2e-2  # FP8 candidate vs the bf16 decode of the same (dequantised) values
FP8_TOL = 1e-1  # ... for paths that also round q / P to FP8 (FlashInfer's own FP8 test tolerance)
SECTIONS = ("fp8", "softcap", "window", "fa3", "multitoken", "multitoken_kernels")
FP8_CANDIDATES = ("raw_tensor_cores", "raw_cuda_cores", "xqa_batch_decode", "trtllm_batch_decode_auto",
                  "batch_attention", "prefill_fa3", "trtllm_gen")


# -- helpers -----------------------------------------------------------------------------------


def _err(e: BaseException, limit: int = 2000) -> str:
    """An exception as one string; a long one (a JIT compiler log) cut in the middle, after the
    log's own error lines, which would otherwise sit in the part cut out."""
    s = f"{type(e).__name__}: {e}"
    if len(s) <= limit:
        return s
    errors = [ln.strip() for ln in s.splitlines()[1:] if "error" in ln.lower() and len(ln) < 400][:8]
    head = ("compiler errors: " + " // ".join(errors) + " || ") if errors else ""
    keep = max(200, limit - len(head) - 600)
    return head + s[:keep] + " [...] " + s[-600:]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius difference of ``a`` from ``b`` (either on the GPU)."""
    return rel_error(a, b.to("cpu", torch.float64))


def graphed(fn: Callable[[], Any], calls: int) -> Callable[[], None]:
    """``calls`` back-to-back calls of ``fn`` captured in one CUDA graph (warmed up on a side
    stream first); returns its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def pair(raw_fn: Callable[[], Any], m_fn: Callable[[], Any], a: argparse.Namespace, slow: bool = False) -> dict:
    """raw and mstar timed in alternating rounds (timing.paired_ms); medians and the ratio. Then
    the same pair with each side's calls captured in a CUDA graph and replayed: GPU time with no
    host work between kernels, so a short kernel whose eager loop is host-bound (mstar's run does
    its checks on the host) is compared by what the GPU spends (``graph_ratio``, information; the
    target is judged on ``ratio``)."""
    reps = max(1, a.reps // 2) if slow else a.reps
    raw_ms, ms = timing.paired_ms(raw_fn, m_fn, reps=reps, rounds=a.rounds)
    r = {"raw_ms": raw_ms, "ms": ms, "ratio": ms / raw_ms}
    if a.graph_timing:
        try:
            g_raw, g_m = graphed(raw_fn, reps), graphed(m_fn, reps)
            graw, gm = timing.paired_ms(g_raw, g_m, reps=1, rounds=a.rounds)
            r.update(graph_raw_ms=graw / reps, graph_ms=gm / reps, graph_ratio=gm / graw)
        except Exception as e:  # a path that cannot be captured still has its eager figures
            r["graph_error"] = _err(e, 400)
    return r


def judged(r: dict, target: str = f"mstar <= {RATIO}x raw, outputs agree (rel diff <= {AGREE_TOL})") -> dict:
    r["target"] = target
    r["agree"] = r.get("rel_diff", math.inf) <= AGREE_TOL
    r["met"] = bool(r.get("ratio", math.inf) <= RATIO and r["agree"])
    return r


def guarded(rows: list[dict], workload: str, fn: Callable[[], dict]) -> None:
    """Run one measurement; an exception becomes that row's error (the others go on)."""
    try:
        rows.append(fn())
    except Exception as e:  # one failing measurement must not lose the others
        rows.append({"workload": workload, "error": _err(e), "trace": traceback.format_exc(limit=4), "met": False})
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "trace"}, default=str), flush=True)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*shape, device=DEV, dtype=torch.float32, generator=g)
    return (x * scale).to(BF16)


# -- 1. FP8 KV decode --------------------------------------------------------------------------


class Fp8Data:
    """One decode problem, rows x kv_len: q, the FP8 cache (K / k_scale, V / v_scale) and the bf16
    cache of the very values the FP8 one holds (dequantised: exact, the scales being powers of 2)."""

    def __init__(self, fi: Any, rows: int, kv_len: int) -> None:
        from mstar_core.kv.fp8 import quantize  # mstar's own quantisation: what the KV manager writes
        from mstar_flashinfer.decode import use_tensor_cores

        self.rows, self.kv_len = rows, kv_len
        self.lay = uniform_layout(rows, kv_len, 1)
        pages = self.lay["pages"]
        self.tc = use_tensor_cores(HQ, HKV)
        self.q = randn(rows, HQ, D, seed=1)
        self.cache = random_cache(pages, seed=2)  # the original bf16 values, then dequantised in place
        self.fp8 = torch.empty(pages, 2, PS, HKV, D, device=DEV, dtype=FP8)
        for i, s in ((0, K_SCALE), (1, V_SCALE)):
            self.fp8[:, i] = quantize(self.cache[:, i], s, FP8)
        # the bf16 decode (tensor cores, as mstar picks them): the baseline every FP8 path is timed with
        self.bf = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=self.tc)
        lay = self.lay
        self.bf.plan(lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS,
                     q_data_type=BF16, kv_data_type=BF16)
        self.bf_out = torch.empty_like(self.q)
        ref_original = self.bf16_run().clone()
        for i, s in ((0, K_SCALE), (1, V_SCALE)):
            self.cache[:, i] = (self.fp8[:, i].float() * s).to(BF16)
        self.ref = self.bf16_run().clone()
        # what FP8 storage itself costs in accuracy: a yardstick for the candidates' errors
        self.storage_error = rel(self.ref, ref_original)
        self.fp8_bytes = rows * kv_len * HKV * D * 2  # K and V, one byte each

    def bf16_run(self) -> torch.Tensor:
        return self.bf.run(self.q, self.cache, out=self.bf_out)


def _candidate_makers(fi: Any, d: Fp8Data) -> dict[str, tuple[str, str, Callable[[], Callable[[], Any]]]]:
    """name -> (where in FlashInfer 0.5.3, what it claims about sm90, maker of a run callable).
    Each maker plans (JIT-compiling on first use) and returns a zero-argument run."""
    lay, q, cache = d.lay, d.q, d.fp8
    sm = 1.0 / math.sqrt(D)

    def decode_wrapper(tc: bool) -> Callable[[], Any]:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=tc)
        w.plan(lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS, q_data_type=BF16, kv_data_type=FP8)
        out = torch.empty_like(q)
        return lambda: w.run(q, cache, k_scale=K_SCALE, v_scale=V_SCALE, out=out)

    def xqa_args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        work = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)  # xqa: zeroed (its semaphores)
        tables = lay["kv_indices"].view(d.rows, -1).to(DEV)  # [rows, pages per row], int32
        lens = lay["kv_lens"].to(DEV)  # int32, read as uint32
        return work, tables, lens, torch.empty_like(q)

    def xqa_direct() -> Callable[[], Any]:
        work, tables, lens, out = xqa_args()
        return lambda: fi.decode.xqa_batch_decode_with_kv_cache(
            q, cache, work, tables, lens, d.kv_len, bmm1_scale=K_SCALE * sm, bmm2_scale=V_SCALE, out=out,
            kv_layout="NHD")

    def trtllm_api(backend: str) -> Callable[[], Callable[[], Any]]:
        def make() -> Callable[[], Any]:
            work, tables, lens, out = xqa_args()
            return lambda: fi.decode.trtllm_batch_decode_with_kv_cache(
                q, cache, work, tables, lens, d.kv_len, bmm1_scale=K_SCALE * sm, bmm2_scale=V_SCALE, out=out,
                kv_layout="NHD", backend=backend)
        return make

    def batch_attention() -> Callable[[], Any]:
        ba = fi.BatchAttention(kv_layout="NHD", device="cuda")
        ba.plan(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"].to(DEV), lay["kv_lens"], HQ, HKV, D, D, PS,
                causal=False, q_data_type=BF16, kv_data_type=FP8)
        out = torch.empty_like(q)
        return lambda: ba.run(q, cache, out=out, k_scale=K_SCALE, v_scale=V_SCALE)

    def prefill_fa3() -> Callable[[], Any]:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend="fa3")
        w.plan(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS, causal=False,
               q_data_type=BF16, kv_data_type=FP8)
        out = torch.empty_like(q)
        return lambda: w.run(q, cache, k_scale=K_SCALE, v_scale=V_SCALE, out=out)

    return {
        "raw_tensor_cores": (
            "decode.py:583 BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True): plan decode.py:1026 "
            "(fa2 prefill kernel, one query per row)", "yes (fa2: sm80+)", lambda: decode_wrapper(True)),
        "raw_cuda_cores": (
            "decode.py:583 BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=False): plan decode.py:1066 "
            "(CUDA-core decode kernel)", "yes (sm80+)", lambda: decode_wrapper(False)),
        "xqa_batch_decode": (
            "decode.py:2335 xqa_batch_decode_with_kv_cache -> xqa.py:133 xqa (FP8 KV on sm90: mha_sm90.cu, "
            "xqa.py:262, q and P rounded to FP8)", "yes (xqa.py:266: sm90, sm100, sm120)", xqa_direct),
        "trtllm_batch_decode_auto": (
            "decode.py:2062 trtllm_batch_decode_with_kv_cache(backend='auto'): 'xqa' on sm90 (decode.py:2147, 2172)",
            "yes (routes to xqa)", trtllm_api("auto")),
        "batch_attention": (
            "attention.py:42 BatchAttention (persistent kernel; v_scale fused)", "not stated (fa2-style mma)",
            batch_attention),
        "prefill_fa3": (
            "prefill.py BatchPrefillWithPagedKVCacheWrapper(backend='fa3'), one query per row, bf16 q + FP8 KV "
            "(its paged run passes no FP8 scales: prefill.py:2185)", "fa3 is sm90-only; bf16 q with FP8 KV not stated",
            prefill_fa3),
        "trtllm_gen": (
            "decode.py:2062 trtllm_batch_decode_with_kv_cache(backend='trtllm-gen') (also the decode wrapper's "
            "backend='trtllm-gen', decode.py:698)", "no: sm100/sm103 (decode.py:2146); downloads cubins",
            trtllm_api("trtllm-gen")),
    }


def bench_fp8(fi: Any, a: argparse.Namespace, sec: dict) -> None:
    from mstar_flashinfer.decode import FlashInferDecodeWrapper

    rows, kv_len = a.decode_rows, a.decode_kv
    d = Fp8Data(fi, rows, kv_len)
    lay = d.lay
    sec.update(workload=f"paged decode {rows}x{kv_len}, FP8 e4m3 KV (k_scale {K_SCALE}, v_scale {V_SCALE})",
               use_tensor_cores=d.tc, fp8_storage_rel_error=d.storage_error,
               fp8_bytes=d.fp8_bytes)
    sec["bf16_ms"] = timing.kernel_ms(d.bf16_run, reps=a.reps, rounds=a.rounds)
    sec["bf16_tb_per_s"] = 2 * d.fp8_bytes / (sec["bf16_ms"] * 1e-3) / 1e12
    rows_out: list[dict] = []
    sec["pairs"] = rows_out
    makers = _candidate_makers(fi, d)

    # raw FP8 on mstar's path first: the pair below needs it
    raw_fp8: Callable[[], Any] | None = None
    try:
        raw_fp8 = makers["raw_tensor_cores"][2]()
        raw_fp8_out = first(raw_fp8()).clone()
    except Exception as e:  # recorded with the candidates below (tried again there)
        sec["raw_fp8_error"] = _err(e)

    def mstar_pair() -> dict:
        if raw_fp8 is None:
            raise RuntimeError(f"raw FP8 decode failed, nothing to pair with: {sec['raw_fp8_error']}")
        w = FlashInferDecodeWrapper(workspace(), HQ, HKV, D, PS, device=DEV)
        w.plan(lay["kv_indptr"], lay["kv_indices"], lay["last"], dtype=BF16, kv_lens=lay["kv_lens"], kv_data_type=FP8)

        def m_run():
            return w.run(d.q, d.fp8, k_scale=K_SCALE, v_scale=V_SCALE)

        out = m_run()
        r = {"workload": f"FP8 decode {rows}x{kv_len}: mstar vs raw (tensor cores)", "rel_diff": rel(out, raw_fp8_out),
             "rel_err_vs_bf16_ref": rel(out, d.ref), **pair(raw_fp8, m_run, a)}
        judged(r)
        # FP8 through mstar against bf16 (raw), paired too: the speed-up the FP8 target counts
        bf_ms, m_ms = timing.paired_ms(d.bf16_run, m_run, reps=a.reps, rounds=a.rounds)
        r["bf16_ms_paired"], r["ms_paired_with_bf16"] = bf_ms, m_ms
        r["speedup_vs_bf16"] = bf_ms / m_ms
        return r

    guarded(rows_out, "FP8 decode: mstar vs raw", mstar_pair)

    cands: list[dict] = []
    sec["candidates"] = cands
    wanted = [c for c in FP8_CANDIDATES if c not in a.skip]
    if "trtllm_gen" in wanted and not a.try_trtllm_gen and torch.cuda.get_device_capability()[0] != 10:
        wanted.remove("trtllm_gen")
        cands.append({"path": "trtllm_gen", "where": makers["trtllm_gen"][0], "claims_sm90": makers["trtllm_gen"][1],
                      "skipped": "not attempted off sm100/sm103 (it would fetch trtllm-gen cubins over the network); "
                                 "--try-trtllm-gen forces it"})
    for name in wanted:
        where, claim, make = makers[name]
        c: dict[str, Any] = {"path": name, "where": where, "claims_sm90": claim}
        t0 = time.perf_counter()
        try:
            fn = raw_fp8 if (name == "raw_tensor_cores" and raw_fp8 is not None) else make()
            out = first(fn()).clone()
            torch.cuda.synchronize()  # an asynchronous kernel error surfaces here, named
            c["rel_err_vs_bf16_ref"] = rel(out, d.ref)
            c["exact"] = c["rel_err_vs_bf16_ref"] <= EXACT_TOL
            c["correct"] = c["rel_err_vs_bf16_ref"] <= FP8_TOL
            bf_ms, ms = timing.paired_ms(d.bf16_run, fn, reps=a.reps, rounds=a.rounds)
            c.update(ms=ms, bf16_ms=bf_ms, speedup_vs_bf16=bf_ms / ms, tb_per_s=d.fp8_bytes / (ms * 1e-3) / 1e12)
        except Exception as e:  # a candidate that fails is a result, not the end of the run
            c["error"] = _err(e)
        c["seconds"] = round(time.perf_counter() - t0, 1)  # JIT compile included
        cands.append(c)
        print(json.dumps(c, default=str), flush=True)

    ok = [c for c in cands if c.get("correct") and "ms" in c]
    exact = [c for c in ok if c.get("exact")]
    if ok:
        best = min(ok, key=lambda c: c["ms"])
        sec["fastest_correct"] = {k: best[k] for k in ("path", "ms", "speedup_vs_bf16", "rel_err_vs_bf16_ref")}
    if exact:
        best = min(exact, key=lambda c: c["ms"])
        sec["fastest_exact"] = {k: best[k] for k in ("path", "ms", "speedup_vs_bf16", "rel_err_vs_bf16_ref")}


# -- 2./3. soft-cap and window on the paged wrappers --------------------------------------------


def paged_pair(fi: Any, cache: torch.Tensor, kind: str, rows: int, kv_len: int, q_len: int, feature: dict,
               q_std: float, a: argparse.Namespace) -> dict:
    """mstar's paged ``kind`` wrapper vs raw FlashInfer, both planned with ``feature`` (plan
    keywords: logits_soft_cap, window_left), timed in alternating rounds; outputs compared with
    each other and, for ``feature_effect``, raw's with raw's without the feature (a feature mstar
    dropped would show there, not in an effect-free comparison)."""
    from mstar_flashinfer.decode import FlashInferDecodeWrapper, use_tensor_cores
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    lay = uniform_layout(rows, kv_len, q_len)
    layer = cache[: lay["pages"]]
    q = randn(rows * q_len, HQ, D, seed=3, scale=q_std)
    tc = use_tensor_cores(HQ, HKV)

    def raw_wrapper(extra: dict) -> Callable[[], torch.Tensor]:
        if kind == "decode":
            r = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=tc)
            r.plan(lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS, q_data_type=BF16,
                   kv_data_type=BF16, **extra)
        else:
            r = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
            r.plan(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS, causal=True,
                   q_data_type=BF16, kv_data_type=BF16, **extra)
        out = torch.empty_like(q)
        return lambda: r.run(q, layer, out=out)

    if kind == "decode":
        w = FlashInferDecodeWrapper(workspace(), HQ, HKV, D, PS, device=DEV)
        w.plan(lay["kv_indptr"], lay["kv_indices"], lay["last"], dtype=BF16, kv_lens=lay["kv_lens"], **feature)
    else:
        w = FlashInferPrefillWrapper(workspace(), HQ, HKV, D, PS, device=DEV)
        w.plan(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["last"], causal=True, dtype=BF16,
               kv_lens=lay["kv_lens"], **feature)

    def m_run():
        return w.run(q, layer)

    raw_run = raw_wrapper(feature)
    raw_out = raw_run().clone()
    plain_out = raw_wrapper({})().clone()
    shape = f"{rows}x{kv_len}" if kind == "decode" else f"{rows}x{q_len} new over {kv_len - q_len} cached, causal"
    feat = ", ".join(f"{k}={v}" for k, v in feature.items())
    r = {"workload": f"paged {kind} {shape}, {feat}", "feature": feature, "q_std": q_std,
         "rel_diff": rel(m_run(), raw_out), "feature_effect": rel(raw_out, plain_out),
         **pair(raw_run, m_run, a, slow=kind != "decode")}
    return judged(r)


def bench_softcap(fi: Any, a: argparse.Namespace, sec: dict) -> None:
    rows_out: list[dict] = []
    sec["pairs"] = rows_out
    new, cached = a.prefill_new, a.prefill_cached
    pages = max(a.prefill_rows * math.ceil((new + cached) / PS), a.decode_rows * math.ceil(a.decode_kv / PS))
    cache = random_cache(pages, seed=4)
    cap = {"logits_soft_cap": SOFT_CAP}
    # logits ~ N(0, q_std^2) with unit K: a spread about the cap, so the cap changes the output
    guarded(rows_out, "soft-cap paged prefill", lambda: paged_pair(
        fi, cache, "prefill", a.prefill_rows, cached + new, new, cap, SOFT_CAP, a))
    guarded(rows_out, "soft-cap paged decode", lambda: paged_pair(
        fi, cache, "decode", a.decode_rows, a.decode_kv, 1, cap, SOFT_CAP, a))


def bench_window(fi: Any, a: argparse.Namespace, sec: dict) -> None:
    rows_out: list[dict] = []
    sec["pairs"] = rows_out
    cache = random_cache(a.decode_rows * math.ceil(a.decode_kv / PS), seed=5)
    window = min(DECODE_WINDOW, a.decode_kv // 8)
    guarded(rows_out, "window paged decode", lambda: paged_pair(
        fi, cache, "decode", a.decode_rows, a.decode_kv, 1, {"window_left": window}, 1.0, a))


# -- 4. FA3 varlen: softcap, window, sinks -------------------------------------------------------


def bench_fa3(a: argparse.Namespace, sec: dict) -> None:
    import flash_attn_interface as fa3

    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper

    segs, prefix, fresh = a.fa3_segs, a.fa3_prefix, a.fa3_fresh
    i32 = dict(dtype=torch.int32)
    cu_q, cu_k = torch.arange(segs + 1, **i32) * fresh, torch.arange(segs + 1, **i32) * (prefix + fresh)
    cu_q_d, cu_k_d = cu_q.to(DEV), cu_k.to(DEV)
    max_q, max_k = fresh, prefix + fresh
    q = randn(segs * fresh, HQ, D, seed=6)
    q_cap = (q.float() * SOFT_CAP).to(BF16)  # logits' spread about the cap (see the soft-cap section)
    k = randn(segs * (prefix + fresh), HKV, D, seed=7)
    v = randn(segs * (prefix + fresh), HKV, D, seed=8)
    g = torch.Generator(device=DEV).manual_seed(9)
    # sink logits well above the scores' log-sum (~log(keys)): they take a visible share of each row
    sinks32 = 6.0 + 2.0 * torch.rand(HQ, device=DEV, dtype=torch.float32, generator=g)
    window = min(FA3_WINDOW, max_k // 4)
    sec.update(workload=f"FA3 varlen {segs} x ({prefix} prefix + {fresh} fresh), causal", sinks_values="6 + 2*U(0,1)")
    rows_out: list[dict] = []
    sec["pairs"] = rows_out

    def raw(qq: torch.Tensor, **kw: Any) -> Callable[[], torch.Tensor]:
        return lambda: first(fa3.flash_attn_varlen_func(qq, k, v, cu_q_d, cu_k_d, max_q, max_k, causal=True, **kw))

    def mstar(qq: torch.Tensor, plan_kw: dict, run_kw: dict) -> Callable[[], torch.Tensor]:
        w = FA3PrefixedPrefillWrapper(HQ, HKV, D, DEV)
        w.plan(cu_q, cu_k, max_q, max_k, causal=True, dtype=BF16, sm_scale=None, **plan_kw)
        return lambda: w.run(qq, k, v, **run_kw)

    def case(name: str, qq: torch.Tensor, raw_kw: dict, plan_kw: dict, run_kw: dict, extra: dict | None = None) -> dict:
        r: dict[str, Any] = {"workload": f"FA3 varlen, {name}", **(extra or {})}
        raw_fn = raw(qq, **raw_kw)
        try:
            raw_out = raw_fn().clone()
        except Exception as e:  # the library build lacks the feature: what does mstar do with it?
            r["error"] = f"raw FA3 refused: {_err(e)}"
            try:
                mstar(qq, plan_kw, run_kw)()
                torch.cuda.synchronize()
                r["mstar"] = "ran (a declared feature this FA3 build lacks is not refused up front)"
            except Exception as e2:
                r["mstar"] = f"refused: {_err(e2, 600)}"
            return judged(r)
        if raw_kw:  # raw with the feature vs raw without it, same q: what a dropped keyword would lose
            r["feature_effect"] = rel(raw_out, raw(qq)().clone())
        try:
            m_fn = mstar(qq, plan_kw, run_kw)
            m_out = m_fn()
            torch.cuda.synchronize()
        except Exception as e:  # mstar's side refused or failed: that is the result, with raw's time
            r.update(error=f"mstar: {_err(e)}", raw_ms=timing.kernel_ms(raw_fn, reps=max(1, a.reps // 2),
                                                                         rounds=a.rounds))
            return judged(r)
        r["rel_diff"] = rel(m_out, raw_out)
        r.update(pair(raw_fn, m_fn, a, slow=True))
        if "window_size" not in raw_kw:  # causal over [prefix | fresh]: query i sees prefix + i + 1 keys
            r["tflop_per_s"] = segs * 4 * fresh * (prefix + fresh / 2) * HQ * D / (r["ms"] * 1e-3) / 1e12
        return judged(r)

    guarded(rows_out, "FA3 plain", lambda: case("plain (control)", q, {}, {}, {}))
    guarded(rows_out, f"FA3 softcap {SOFT_CAP:g}", lambda: case(
        f"softcap {SOFT_CAP:g}", q_cap, {"softcap": SOFT_CAP}, {"logits_soft_cap": SOFT_CAP}, {}))
    guarded(rows_out, f"FA3 window {window}", lambda: case(
        f"window_left {window}", q, {"window_size": (window, 0)}, {"window_left": window}, {}))

    def sinks_case() -> dict:
        # this FA3 build's own check says "sinks must have dtype bfloat16": find what each side takes
        raw_dtype, raw_errors = None, {}
        for dt in (BF16, torch.float32):
            try:
                raw(q, sinks=sinks32.to(dt))()
                torch.cuda.synchronize()
                raw_dtype = raw_dtype or dt
            except Exception as e:
                raw_errors[str(dt)] = _err(e, 400)
        if raw_dtype is None:
            raise RuntimeError(f"raw FA3 takes sinks in neither bf16 nor float32: {raw_errors}")
        s_raw = sinks32.to(raw_dtype)
        extra: dict[str, Any] = {"raw_sinks_dtype": str(raw_dtype), "raw_sinks_errors": raw_errors}
        m_dtype, m_errors = None, {}
        for dt in (torch.float32, BF16):  # float32 first: what a model's checkpoint usually holds
            try:
                mstar(q, {}, {"sinks": sinks32.to(dt)})()
                torch.cuda.synchronize()
                m_dtype = dt
                break
            except Exception as e:
                m_errors[str(dt)] = _err(e, 400)
        extra.update(mstar_sinks_dtype=str(m_dtype), mstar_sinks_errors=m_errors)
        s_m = sinks32.to(m_dtype if m_dtype is not None else raw_dtype)
        return case("sinks", q, {"sinks": s_raw}, {}, {"sinks": s_m}, extra)

    guarded(rows_out, "FA3 sinks", sinks_case)


# -- 5. multi-token decode under graphs + pre-plan ------------------------------------------------


def bench_multitoken(a: argparse.Namespace, sec: dict) -> None:
    """The decode loop of mstar_core.demo.decode_bench (tiny decoder, KV cache of ``context``
    random tokens per row, FlashInfer through the registry, captured graphs) with ``qt`` query
    tokens per decode row; then the same steps eagerly."""
    from mstar_core.demo.decode_bench import BenchOptions, build_decode_setup, run_decode_bench

    qt = a.mt_tokens
    sec.update(workload=f"decode, {a.mt_layers} layers, {a.mt_batch} rows x {qt} query tokens over {a.mt_context}, "
                        f"graphs + pre-plan, backend {a.mt_backend}",
               target="graphs+preplan step <= 1.10x GPU time back to back", met=False)
    o = BenchOptions(layers=a.mt_layers, qo_heads=HQ, kv_heads=HKV, head_dim=D, hidden=a.mt_hidden, batch=a.mt_batch,
                     context=a.mt_context, page_size=PS, backend=a.mt_backend, graphs=True, preplan=True,
                     steps=a.mt_steps, warmup=a.mt_warmup, device="cuda",
                     dtype=str(a.mt_dtype).removeprefix("torch."), query_tokens=qt)
    s = build_decode_setup(replace(o, steps=2 * (o.warmup + o.steps), warmup=1))  # room for both loops
    sec["backend"] = s.backend
    runner = s.runner
    if runner.enabled:
        try:
            prep = runner.prepare(s.decode)
        except Exception as e:  # mstar refusing the step is the result
            sec["refused"] = f"GraphRunner.prepare refused the {qt}-token step: {_err(e)}"
            prep = None
        if prep is not None:
            graph = prep.graph
            runner.discard(prep)
            if graph is None:
                sec["refused"] = (f"GraphRunner.prepare runs the {qt}-token step eagerly (Prepared.graph is None): "
                                  "no captured graph serves these rows")
            else:
                sec["supports_preplan"] = runner.supports_preplan
                r = run_decode_bench(o, s)
                gpu = r.gpu_step_ms  # None off CUDA
                sec.update(step_ms=r.median_step_ms, host_ms=r.median_host_ms, gpu_step_ms=gpu,
                           ratio=r.median_step_ms / gpu if gpu else None, tokens_per_s=r.tokens_per_s,
                           met=bool(gpu and r.median_step_ms <= 1.10 * gpu))
    else:
        sec["refused"] = "graphs were not captured (GraphRunner.warmup: a resource cannot be captured)"
    # the same steps eagerly, for scale (and as what mstar runs where it refuses the graphs)
    try:
        runner.enabled = False
        r = run_decode_bench(replace(o, graphs=False, preplan=False, warmup=2, steps=min(a.mt_steps, 10)), s)
        sec["eager_step_ms"], sec["eager_host_ms"] = r.median_step_ms, r.median_host_ms
    except Exception as e:
        sec["eager_error"] = _err(e)


def bench_multitoken_kernels(fi: Any, a: argparse.Namespace, sec: dict) -> None:
    """One layer's attention for rows of ``qt`` query tokens, raw FlashInfer: the paged prefill
    wrapper (what mstar runs such rows on) with backend "auto" (fa3 on sm90) and "fa2", against
    one-token tensor-core decode over the same cache: what a multi-token step's attention costs."""
    from mstar_flashinfer.decode import use_tensor_cores

    qt, rows, kv_len = a.mt_tokens, a.mt_batch, a.mt_context
    lay = uniform_layout(rows, kv_len, qt)
    cache = random_cache(lay["pages"], seed=10)
    q = randn(rows * qt, HQ, D, seed=11)
    q1 = q[::qt].contiguous()
    kv_bytes = rows * kv_len * HKV * D * 2 * 2
    runs: dict[str, Callable[[], torch.Tensor]] = {}
    for backend in ("auto", "fa2"):
        w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend=backend)
        w.plan(lay["qo_indptr"], lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS, causal=True,
               q_data_type=BF16, kv_data_type=BF16)
        out = torch.empty_like(q)
        runs[f"prefill_{backend}"] = lambda w=w, out=out: w.run(q, cache, out=out)
        sec[f"prefill_{backend}_backend"] = getattr(w, "_backend", backend)
    dw = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=use_tensor_cores(HQ, HKV))
    dw.plan(lay["kv_indptr"], lay["kv_indices"], lay["last"], HQ, HKV, D, PS, q_data_type=BF16, kv_data_type=BF16)
    out1 = torch.empty_like(q1)
    sec["workload"] = f"raw FlashInfer, one layer, {rows} rows x {qt} query tokens over {kv_len}, causal"
    sec["prefill_rel_diff_fa2_vs_auto"] = rel(runs["prefill_fa2"]().clone(), runs["prefill_auto"]().clone())
    t_auto, t_fa2 = timing.paired_ms(runs["prefill_auto"], runs["prefill_fa2"], reps=a.reps, rounds=a.rounds)
    t_dec = timing.kernel_ms(lambda: dw.run(q1, cache, out=out1), reps=a.reps, rounds=a.rounds)
    sec.update(prefill_auto_ms=t_auto, prefill_fa2_ms=t_fa2, decode_1_token_ms=t_dec,
               prefill_auto_tb_per_s=kv_bytes / (t_auto * 1e-3) / 1e12,
               prefill_fa2_tb_per_s=kv_bytes / (t_fa2 * 1e-3) / 1e12,
               decode_1_token_tb_per_s=kv_bytes / (t_dec * 1e-3) / 1e12)


# -- report ---------------------------------------------------------------------------------------


def targets(doc: dict) -> dict:
    out = {}

    def add(name: str, workload: str, value: Any, wanted: str, met: bool) -> None:
        out[f"{name}: {workload}" if workload else name] = report.target(value, wanted, met)

    for name, sec in doc["sections"].items():
        if "error" in sec:  # the section stopped there; what it measured before still counts below
            add(name, "ran", None, "no error", False)
        for r in sec.get("pairs", []):
            add(name, r["workload"], r.get("ratio"), r.get("target", "-"), bool(r.get("met")))
            if "speedup_vs_bf16" in r:
                add(name, "FP8 decode through mstar vs bf16 decode", r["speedup_vs_bf16"], "speed-up >= 1.6x",
                    r["speedup_vs_bf16"] >= 1.6)
        for c in sec.get("candidates", []) if name == "fp8" else []:
            if c["path"] == "raw_tensor_cores":
                add(name, "raw FP8 decode, tensor cores (mstar's path) vs bf16 decode", c.get("speedup_vs_bf16"),
                    "speed-up >= 1.6x", bool(c.get("speedup_vs_bf16", 0) >= 1.6 and c.get("correct")))
        if name == "fp8" and "fastest_correct" in sec:
            b = sec["fastest_correct"]
            add(name, f"fastest correct FlashInfer FP8 path: {b['path']}", b["speedup_vs_bf16"],
                "speed-up >= 1.6x (not mstar's path unless raw_tensor_cores)", b["speedup_vs_bf16"] >= 1.6)
        if name == "multitoken" and "error" not in sec:
            add(name, sec.get("workload", ""), sec.get("ratio"), sec.get("target", "-"), bool(sec.get("met")))
    return out


def page(doc: dict) -> list[str]:
    e = doc["env"]
    lines = [f"# Attention features: mstar vs raw libraries -- {e['device']}", "", report.environment_line(e), "",
             f"flashinfer imported: {e.get('flashinfer_imported', '?')}{' (--quick)' if e.get('quick') else ''}. "
             f"bf16 q, {HQ} q heads / {HKV} kv heads, head_dim {D}, page {PS}. CUDA-event medians; every "
             "mstar-vs-raw pair timed in alternating rounds in this process (ratio: eager calls back to back; "
             "graph ratio: the same calls captured in CUDA graphs, no host work between kernels). "
             f"Device-to-device copy (read + write): {report.fmt(e.get('copy_tb_per_s'))} TB/s "
             f"({e.get('copy_gib', '?')} GiB).", ""]
    for name in SECTIONS:
        if name not in doc["sections"]:
            continue
        sec = doc["sections"][name]
        lines += [f"## {name}", ""]
        if "workload" in sec:
            lines += [sec["workload"], ""]
        if "error" in sec:
            lines += [f"**error**: {report.fmt(sec['error'])}", ""]
        if name == "fp8" and "bf16_ms" in sec:
            lines += [f"bf16 KV decode (raw, tensor cores {sec.get('use_tensor_cores')}): "
                      f"{report.fmt(sec['bf16_ms'], '.4f')} ms ({report.fmt(sec.get('bf16_tb_per_s'))} TB/s). "
                      f"FP8 storage alone moves the output by {report.fmt(sec.get('fp8_storage_rel_error'), '.2e')} "
                      "(rel) from the bf16 original.", ""]
        if sec.get("pairs"):
            lines += [*report.table(("workload", "mstar ms", "raw ms", "ratio", "graph ratio", "rel diff mstar/raw",
                                     "feature effect", "other", "target", "met"),
                                    ((r["workload"], r.get("ms"), r.get("raw_ms"), r.get("ratio"), r.get("graph_ratio"),
                                      r.get("rel_diff"), r.get("feature_effect"), _other(r), r.get("target", "-"),
                                      bool(r.get("met"))) for r in sec["pairs"]), spec=".4g"), ""]
        if name == "fp8" and sec.get("candidates"):
            lines += ["### FP8 decode paths in FlashInfer (each timed paired with the bf16 decode)", "",
                      f"correct: rel error vs the bf16 decode of the same values <= {FP8_TOL} (exact: <= {EXACT_TOL})",
                      "", *report.table(("path", "ms", "bf16 ms", "speed-up", "TB/s", "rel err", "exact", "correct",
                                         "compile+run s", "where", "sm90", "error"),
                                        ((c["path"], c.get("ms"), c.get("bf16_ms"), c.get("speedup_vs_bf16"),
                                          c.get("tb_per_s"), c.get("rel_err_vs_bf16_ref"), c.get("exact"),
                                          c.get("correct"), c.get("seconds"), c["where"], c["claims_sm90"],
                                          c.get("error") or c.get("skipped")) for c in sec["candidates"]),
                                        spec=".4g"), ""]
            for k in ("fastest_correct", "fastest_exact"):
                if k in sec:
                    b = sec[k]
                    lines.append(f"- {k.replace('_', ' ')}: **{b['path']}** {b['ms']:.4f} ms, "
                                 f"{b['speedup_vs_bf16']:.2f}x bf16, rel err {b['rel_err_vs_bf16_ref']:.2e}")
            lines.append("")
        if name in ("multitoken", "multitoken_kernels") and "error" not in sec:
            lines += [f"- {k}: {report.fmt(v)}" for k, v in sec.items() if k not in ("workload", "seconds", "target")]
            lines.append("")
    return [*lines, *report.targets_table(doc.get("targets", {}))]


def _other(r: dict) -> str:
    """A pair's further figures and notes, in one cell."""
    other = [f"{k}={report.fmt(r[k])}" for k in ("speedup_vs_bf16", "rel_err_vs_bf16_ref", "tflop_per_s",
                                                "raw_sinks_dtype", "mstar_sinks_dtype") if k in r]
    for k, label in (("error", "error"), ("mstar", "mstar"), ("graph_error", "graph capture"),
                     ("mstar_sinks_errors", "mstar sinks errors")):
        if r.get(k):
            other.append(f"{label}: {r[k]}")
    return "; ".join(other)


def write(out: str, doc: dict) -> None:
    doc["targets"] = targets(doc)
    report.write(out, "attention_features", doc, page(doc), echo=False)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for attention_features.json and .md")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="small shapes and few repetitions (a smoke run)")
    p.add_argument("--skip", default="",
                   help=f"FP8 candidates not to try (comma-separated: {','.join(FP8_CANDIDATES)})")
    p.add_argument("--try-trtllm-gen", action="store_true",
                   help="try the trtllm-gen FP8 decode off sm100 too (it fetches cubins over the network)")
    p.add_argument("--reps", type=int, default=None, help="calls per timed round (default 10; --quick 3)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per contender (default 15; --quick 5)")
    p.add_argument("--no-graph-timing", dest="graph_timing", action="store_false",
                   help="skip timing each mstar-vs-raw pair again as CUDA-graph replays")
    a = p.parse_args(argv)
    q = a.quick
    a.reps = a.reps or (3 if q else 10)
    a.rounds = a.rounds or (5 if q else 15)
    a.decode_rows, a.decode_kv = (8, 1024) if q else (64, 8192)
    a.prefill_rows, a.prefill_new, a.prefill_cached = (2, 128, 512) if q else (8, 512, 2048)
    a.fa3_segs, a.fa3_prefix, a.fa3_fresh = (2, 256, 256) if q else (8, 1024, 1024)
    a.mt_layers, a.mt_batch, a.mt_context, a.mt_hidden = (2, 8, 512, 256) if q else (32, 64, 8192, 2048)
    a.mt_tokens, a.mt_steps, a.mt_warmup = 4, (5 if q else 30), (2 if q else 5)
    a.mt_backend, a.mt_dtype = "flashinfer", BF16
    a.sections = [s for s in a.sections.split(",") if s]
    bad = [s for s in a.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {list(SECTIONS)}")
    a.skip = {s for s in a.skip.split(",") if s}
    bad = sorted(a.skip - set(FP8_CANDIDATES))
    if bad:
        p.error(f"unknown FP8 candidates {bad}; choose from {list(FP8_CANDIDATES)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if not torch.cuda.is_available():
        print("attention_features needs a CUDA GPU", file=sys.stderr)
        return 2
    meta = report.environment("apache-tvm-ffi")
    meta.update(sm_count=torch.cuda.get_device_properties(0).multi_processor_count, quick=a.quick)
    try:
        import flashinfer as fi

        meta["flashinfer_imported"] = getattr(fi, "__version__", "?")
    except Exception as e:  # the FA3 section still runs
        fi = None
        meta["flashinfer_imported"] = f"import failed: {_err(e, 300)}"
    try:
        import flash_attn_interface

        meta["flash_attn_interface"] = getattr(flash_attn_interface, "__file__", "?")
    except Exception as e:
        meta["flash_attn_interface"] = f"import failed: {_err(e, 300)}"
    meta["copy_gib"] = 1 if a.quick else 4
    meta["copy_tb_per_s"] = timing.copy_bandwidth(meta["copy_gib"])["tb_per_s"]
    shapes = {"dtype": "bfloat16", "qo_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": PS,
              "decode": {"rows": a.decode_rows, "kv_len": a.decode_kv},
              "fp8": {"kv_dtype": "float8_e4m3fn", "k_scale": K_SCALE, "v_scale": V_SCALE},
              "softcap": {"logits_soft_cap": SOFT_CAP, "prefill_rows": a.prefill_rows, "new_tokens": a.prefill_new,
                          "cached_tokens": a.prefill_cached},
              "window": {"window_left": min(DECODE_WINDOW, a.decode_kv // 8)},
              "fa3": {"segments": a.fa3_segs, "prefix": a.fa3_prefix, "fresh": a.fa3_fresh, "causal": True,
                      "softcap": SOFT_CAP, "window_left": min(FA3_WINDOW, (a.fa3_prefix + a.fa3_fresh) // 4)},
              "multitoken": {"layers": a.mt_layers, "rows": a.mt_batch, "query_tokens": a.mt_tokens,
                             "context": a.mt_context, "hidden": a.mt_hidden, "steps": a.mt_steps},
              "timing": {"reps": a.reps, "rounds": a.rounds}}
    doc: dict[str, Any] = {"env": meta, "shapes": shapes, "sections": {}}
    print(json.dumps(meta, default=str), flush=True)
    runs = {
        "fp8": lambda sec: bench_fp8(fi, a, sec),
        "softcap": lambda sec: bench_softcap(fi, a, sec),
        "window": lambda sec: bench_window(fi, a, sec),
        "fa3": lambda sec: bench_fa3(a, sec),
        "multitoken": lambda sec: bench_multitoken(a, sec),
        "multitoken_kernels": lambda sec: bench_multitoken_kernels(fi, a, sec),
    }
    for name in a.sections:
        sec: dict[str, Any] = {}
        doc["sections"][name] = sec
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            if fi is None and name in ("fp8", "softcap", "window", "multitoken_kernels"):
                raise RuntimeError(f"flashinfer is not importable: {meta['flashinfer_imported']}")
            runs[name](sec)
        except Exception as e:  # one failing section must not lose the others' numbers
            sec["error"] = _err(e)
            sec["trace"] = traceback.format_exc(limit=6)
            print(f"{name}: error {sec['error'][:300]}", flush=True)
        sec["seconds"] = round(time.perf_counter() - t0, 1)
        try:
            gc.collect()  # the sections' graphs and caches hold reference cycles
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as e:  # a poisoned context: said once here, every later section will fail too
            sec["cuda_error_after"] = _err(e, 500)
        write(a.out, doc)
    print("\n".join(page(doc)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
