"""One denoise step on the GPU, four ways, in one process:

1. raw FA3 varlen over pre-concatenated [prefix | fresh] K/V (the floor);
2. mstar dense with FA3 (DenseAttentionManager: cached prefix + concatenation + FA3);
3. mstar dense with FlashInfer's ragged prefill;
4. the paged way through mstar (KVManager.write_kv of the fresh K/V, plan, FlashInfer paged
   prefill through PagedAttentionManager).

Shape: 4 requests x (256 prefix + 4096 fresh tokens), 32 query / 8 KV heads, head_dim 128, bf16,
not causal. Per layer: CUDA-event medians. Per step of 32 layers: wall-clock medians of
``Node.step`` (admit, plan, 32 layers, commit), synchronised at both ends, so host planning
counts. Correctness first: every variant's output is compared with raw FA3's on the same data
and with a float64 reference on a slice (the kernels allocate their outputs fresh, so there is no
buffer to poison). ``--device cpu`` with small shapes runs the same code over the CPU stand-ins
(tests/bench/test_dense_bench.py), timing with the host clock.

    python3 bench/dense_prefill.py --out $OUT   # writes dense_prefill.json and .md

Targets: mstar dense with FA3 <= 1.05 x raw FA3 per layer; dense >= 1.25 x faster than paged per
step. A variant whose library is missing is reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import traceback

import report
import torch

from mstar_core import (
    AttentionStep,
    DenseAttentionManager,
    KVConfig,
    KVManager,
    KVSpan,
    KVStep,
    Node,
    PagedAttentionManager,
    Step,
)
from mstar_core.testing.oracle import attention_oracle, rel_error
from mstar_core.testing.timing import event, queued_events_ms, sync, wall_ms

LABEL = "latent"
NOT_CAUSAL = AttentionStep(causal=False)
DEV = torch.device("cuda")
BF16 = torch.bfloat16


class Data:
    """Same q / prefix K/V / fresh K/V for every variant."""

    def __init__(self, a: argparse.Namespace) -> None:
        g = torch.Generator(device=DEV).manual_seed(0)  # generated where used: no host copy
        self.a = a
        B, P, N = a.requests, a.prefix, a.fresh
        self.q = torch.randn((B * N, a.hq, a.d), generator=g, device=DEV, dtype=BF16)
        self.kf = torch.randn((B * N, a.hkv, a.d), generator=g, device=DEV, dtype=BF16)
        self.vf = torch.randn((B * N, a.hkv, a.d), generator=g, device=DEV, dtype=BF16)
        self.kp = torch.randn((B * P, a.hkv, a.d), generator=g, device=DEV, dtype=BF16)
        self.vp = torch.randn((B * P, a.hkv, a.d), generator=g, device=DEV, dtype=BF16)
        self.k_all = torch.cat([t for r in range(B) for t in (self.kp[r * P:(r + 1) * P], self.kf[r * N:(r + 1) * N])])
        self.v_all = torch.cat([t for r in range(B) for t in (self.vp[r * P:(r + 1) * P], self.vf[r * N:(r + 1) * N])])
        self.cu_q = torch.arange(0, B + 1, dtype=torch.int32, device=DEV) * N
        self.cu_k = torch.arange(0, B + 1, dtype=torch.int32, device=DEV) * (P + N)
        self.rids = [f"r{i}" for i in range(B)]


# -- the variants ------------------------------------------------------------------------------


def raw_fa3(d: Data) -> dict:
    fa3 = importlib.import_module("flash_attn_interface")
    a = d.a

    def call():
        out = fa3.flash_attn_varlen_func(d.q, d.k_all, d.v_all, d.cu_q, d.cu_k, a.fresh, a.prefix + a.fresh,
                                         causal=False)
        return out[0] if isinstance(out, (tuple, list)) else out

    out = call()
    layer = queued_events_ms(call, a.reps, a.layers, DEV)
    cat = queued_events_ms(lambda: (torch.cat([d.kp, d.kf]), torch.cat([d.vp, d.vf])), a.reps, 4, DEV)
    return {"layer_ms": layer, "step_ms_kernels_only": layer * a.layers, "concat_kv_ms": cat, "_out": out}


def _kv(d: Data) -> tuple[KVManager, KVConfig]:
    a = d.a
    pages_per_req = -(-(a.prefix + a.fresh) // a.page_size)
    cfg = KVConfig(a.layers, a.hkv, a.d, a.page_size, a.requests * pages_per_req + 8, a.hq)
    return KVManager(cfg, DEV, BF16), cfg


def _commit_prefixes(node: Node, kv: KVManager, attn, d: Data) -> None:
    """The conditioning prefixes, committed once (written by whichever path the manager takes)."""
    for r in d.rids:
        node.ingest_request(r)
    step = Step(KVStep(tuple(KVSpan(r, LABEL, d.a.prefix, True) for r in d.rids)), NOT_CAUSAL)
    q = torch.randn((len(d.rids) * d.a.prefix, d.a.hq, d.a.d), device=DEV, dtype=BF16)

    def fwd(ctx):
        for i in range(d.a.layers):
            if attn.requires_kv_write:
                kv.write_kv(d.kp, d.vp, layer_idx=i, label=LABEL)
            attn.run(q, LABEL, kv.layer_view(i), k=d.kp, v=d.vp, layer_idx=i)

    assert node.step(step, fwd).outcome


def mstar_variant(d: Data, make_attn) -> dict:
    """``make_attn(kv, cfg)``; then denoise steps through ``Node.step``."""
    a = d.a
    kv, cfg = _kv(d)
    attn = make_attn(kv, cfg)
    node = Node([kv, attn])
    _commit_prefixes(node, kv, attn, d)
    step = Step(KVStep(tuple(KVSpan(r, LABEL, a.fresh, False) for r in d.rids)), NOT_CAUSAL)
    captured = {}

    def layers(ctx):
        for i in range(a.layers):
            if attn.requires_kv_write:
                kv.write_kv(d.kf, d.vf, layer_idx=i, label=LABEL)
            out = attn.run(d.q, LABEL, kv.layer_view(i), k=d.kf, v=d.vf, layer_idx=i)
            if i == 0 and "out" not in captured:
                captured["out"] = out

    node.step(step, layers)  # warm-up: gathers the prefixes, compiles what compiles
    sync(DEV)
    captured.clear()
    node.step(step, layers)  # the checked step (its layer 0 output, on the cached prefix)
    sync(DEV)

    # per layer: events around one layer's work inside a planned step
    per_layer: list[float] = []

    def timed_layers(ctx):
        ev = []
        for i in range(a.layers):
            s, e = event(DEV), event(DEV)
            s.record()
            if attn.requires_kv_write:
                kv.write_kv(d.kf, d.vf, layer_idx=i, label=LABEL)
            attn.run(d.q, LABEL, kv.layer_view(i), k=d.kf, v=d.vf, layer_idx=i)
            e.record()
            ev.append((s, e))
        sync(DEV)
        per_layer.extend(s.elapsed_time(e) for s, e in ev)

    for _ in range(a.reps):
        node.step(step, timed_layers)
    # per step: wall clock, admit + plan + layers + commit
    step_ms = wall_ms(lambda: node.step(step, layers), a.reps, DEV)
    res = {"layer_ms": statistics.median(per_layer), "step_ms": step_ms, "_out": captured["out"]}
    if isinstance(attn, DenseAttentionManager):
        st = attn.stats
        res["prefix_cache"] = {"gathers": st.gathers, "hits": st.hits}
    node.cleanup()
    return res


def dense_fa3(d: Data) -> dict:
    from mstar_fa3.ragged import FA3PrefixedPrefillWrapper

    return mstar_variant(d, lambda kv, cfg: DenseAttentionManager(kv, DEV, BF16, cfg, FA3PrefixedPrefillWrapper))


def dense_flashinfer(d: Data) -> dict:
    from mstar_flashinfer.ragged import FlashInferPrefixedPrefillWrapper

    return mstar_variant(d, lambda kv, cfg: DenseAttentionManager(kv, DEV, BF16, cfg, FlashInferPrefixedPrefillWrapper))


def paged_flashinfer(d: Data) -> dict:
    from mstar_flashinfer.decode import FlashInferDecodeWrapper
    from mstar_flashinfer.mixed import FlashInferMixedWrapper
    from mstar_flashinfer.prefill import FlashInferPrefillWrapper

    wrappers = {"paged_prefill": FlashInferPrefillWrapper, "paged_decode": FlashInferDecodeWrapper,
                "mixed": FlashInferMixedWrapper}
    tokens = d.a.requests * d.a.fresh
    return mstar_variant(d, lambda kv, cfg: PagedAttentionManager(kv, DEV, BF16, cfg, wrappers,
                                                                  max_total_tokens=tokens))


VARIANTS = {
    "raw_fa3": raw_fa3,
    "mstar_dense_fa3": dense_fa3,
    "mstar_dense_flashinfer": dense_flashinfer,
    "mstar_paged_flashinfer": paged_flashinfer,
}


def reference_error(d: Data, out: torch.Tensor, rows: int = 128) -> float:
    """Request 0's first ``rows`` queries against float64 full attention over its keys."""
    a = d.a
    rows = min(rows, a.fresh)  # request 0's queries only
    k = d.k_all[: a.prefix + a.fresh]
    v = d.v_all[: a.prefix + a.fresh]
    # bottom-right alignment is irrelevant when not causal; the oracle takes any q_len
    ref = attention_oracle(d.q[:rows].double(), k.double(), v.double(), causal=False)
    return rel_error(out[:rows], ref)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--fresh", type=int, default=4096)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run over stand-ins)")
    a = p.parse_args(argv)
    global DEV
    DEV = torch.device(a.device)
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("dense_prefill needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    d = Data(a)
    shape = {k: getattr(a, k) for k in ("requests", "prefix", "fresh", "hq", "hkv", "d", "layers", "page_size", "reps")}
    shape.update(dtype="bfloat16", causal=False)
    results: dict[str, dict] = {}
    outs: dict[str, torch.Tensor] = {}
    for name, fn in VARIANTS.items():
        t0 = time.perf_counter()
        try:
            r = fn(d)
        except Exception as e:  # a missing library or a failure is reported, not fatal to the others
            results[name] = {"skipped": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
            print(f"{name}: skipped ({type(e).__name__}: {e})")
            continue
        finally:
            if DEV.type == "cuda":
                torch.cuda.empty_cache()  # the variant's cache and manager went with its frame
        out = r.pop("_out")
        outs[name] = out
        r["rel_error_vs_float64"] = reference_error(d, out)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    if "raw_fa3" in outs:
        base = outs["raw_fa3"].float()
        for name, o in outs.items():
            results[name]["rel_diff_vs_raw_fa3"] = float((o.float() - base).norm() / base.norm())
    errors_ok = all(r.get("rel_error_vs_float64", 0) < 1.6e-2 for r in results.values())
    doc = {"env": report.environment(), "shape": shape, "results": results, "targets": targets(results),
           "errors_ok": errors_ok}
    report.write(a.out, "dense_prefill", doc, page(doc))
    return 0 if errors_ok else 1


def targets(results: dict[str, dict]) -> dict:
    t = {}
    raw, dfa3 = results.get("raw_fa3", {}), results.get("mstar_dense_fa3", {})
    paged = results.get("mstar_paged_flashinfer", {})
    if "layer_ms" in raw and "layer_ms" in dfa3:
        ratio = dfa3["layer_ms"] / raw["layer_ms"]
        t["dense_fa3_over_raw_fa3_per_layer"] = report.target(ratio, "<= 1.05", ratio <= 1.05)
    if "step_ms" in paged:
        for name in ("mstar_dense_fa3", "mstar_dense_flashinfer"):
            if "step_ms" in results.get(name, {}):
                sp = paged["step_ms"] / results[name]["step_ms"]
                t[f"paged_over_{name}_per_step"] = report.target(sp, ">= 1.25", sp >= 1.25)
    return t


def page(doc: dict) -> list[str]:
    s = doc["shape"]
    rows = []
    for name, r in doc["results"].items():
        if "skipped" in r:
            rows.append((name, f"skipped: {r['skipped']}", None, None, None))
            continue
        step = r["step_ms"] if "step_ms" in r else f"{r['step_ms_kernels_only']:.2f} (kernels only)"
        rows.append((name, r["layer_ms"], step, r["rel_error_vs_float64"], r.get("rel_diff_vs_raw_fa3")))
    return ["# Dense path: one denoise step", "", report.environment_line(doc["env"]), "",
            f"{s['requests']} requests x ({s['prefix']} prefix + {s['fresh']} fresh), {s['hq']} q / {s['hkv']} kv "
            f"heads, head_dim {s['d']}, bf16, not causal, {s['layers']} layers, page size {s['page_size']}; "
            f"medians over {s['reps']} steps", "",
            *report.table(("variant", "per layer (ms)", "per step (ms, plan included)", "rel. error vs float64",
                           "rel. diff vs raw FA3"), rows, spec=".3g"),
            "", *report.targets_table(doc["targets"])]


if __name__ == "__main__":
    raise SystemExit(main())
