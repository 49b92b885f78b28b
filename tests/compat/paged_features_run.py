"""``python paged_features_run.py NAME``, in a process that sees an installed backend NAME: the
paged manager, built for NAME by name, serves prefill, mixed and decode steps under each feature
(and multi-token decode rows), checked against the float64 oracle over what the cache stored. One
line per feature set; exits 1 on a mismatch. Unlike ``mstar check``, this drives the manager's own
calls into the wrappers (which keywords it passes, to which wrapper)."""

from __future__ import annotations

import sys

import torch

from mstar_core import AttentionFeatures, KVConfig, KVManager, KVSpan, KVStep, Node, Step, build_paged_attention
from mstar_core.features import KV_DTYPES
from mstar_core.kv.fp8 import quantize
from mstar_core.testing.oracle import attention_oracle, rel_error

LAYERS, HKV, HQ, D, TOLERANCE = 2, 2, 4, 64, 1e-4
# a prompt step, a mixed step, then decode steps past a page
STEPS = [[("a", 9), ("b", 3)], [("a", 1), ("b", 6), ("c", 5)], [("a", 1), ("b", 1), ("c", 1)],
         [("a", 1), ("b", 1), ("c", 1)]]
# prompts, then uniform rows of 4 queries (speculative verification)
MULTI_STEPS = [[("a", 9), ("b", 3), ("c", 5)], [("a", 4), ("b", 4), ("c", 4)], [("a", 4), ("b", 4), ("c", 4)]]
CASES = {
    "sink_logits+layer_windows": (AttentionFeatures(sink_logits=True, layer_windows=(-1, 3)), STEPS),
    "fp8_e4m3+soft_cap": (AttentionFeatures(kv_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0, soft_cap=2.0), STEPS),
    "fp8_e5m2": (AttentionFeatures(kv_dtype="fp8_e5m2"), STEPS),
    "multi_token_decode": (AttentionFeatures(decode_query_tokens=4), MULTI_STEPS),
}


def stored(features: AttentionFeatures, layer: int, k: torch.Tensor, v: torch.Tensor):
    """What a kernel reads back of ``k``/``v`` written to ``layer`` (FP8: quantised, then scaled)."""
    fp8 = KV_DTYPES[features.kv_dtype]
    if fp8 is None:
        return k.double(), v.double()
    ks, vs = features.scales(layer)
    return quantize(k, ks, fp8).double() * ks, quantize(v, vs, fp8).double() * vs


def serve(name: str, features: AttentionFeatures, steps: list) -> tuple[dict[str, str], float]:
    """The backend serving each paged capability, and the worst relative error over every step."""
    cfg = KVConfig(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, page_size=4, max_pages=64, num_qo_heads=HQ)
    kv = KVManager(cfg, "cpu", torch.float32, features=features)
    attn = build_paged_attention(kv, "cpu", torch.float32, cfg, name, features=features)
    node = Node([attn, kv])
    for rid in "abc":
        node.ingest_request(rid)
    gen = torch.Generator().manual_seed(0)
    sinks = [torch.randn(HQ, generator=gen) * 2 for _ in range(LAYERS)] if features.any_sinks else [None] * LAYERS
    hist: dict = {}
    worst = 0.0

    def forward(ctx):
        nonlocal worst
        ((label, lay),) = ctx.plan_results["kv"].labels
        n = lay.num_tokens
        for layer in range(LAYERS):
            q, k, v = (torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV))
            kv.write_kv(k, v, layer, label)
            out = attn.run(q, label, kv.layer_view(layer), layer_idx=layer, sinks=sinks[layer])
            ks, vs = stored(features, layer, k, v)
            for s in lay.spans:
                sl = slice(s.q_start, s.q_start + s.to_compute)
                old_k, old_v = hist.get((s.request_id, layer), (ks[:0], vs[:0]))
                all_k, all_v = torch.cat([old_k, ks[sl]]), torch.cat([old_v, vs[sl]])
                ref = attention_oracle(q[sl], all_k, all_v, True, features.window(layer, -1), None, features.soft_cap,
                                       sinks[layer])
                worst = max(worst, rel_error(out[sl], ref))
                hist[(s.request_id, layer)] = (all_k, all_v)

    for spans in steps:
        assert node.step(Step(KVStep(tuple(KVSpan(r, "t", n) for r, n in spans))), forward).outcome
    return dict(attn.backend_names), worst


def main(name: str) -> int:
    failed = False
    for what, (features, steps) in CASES.items():
        try:
            served, worst = serve(name, features, steps)
        except Exception as e:  # one feature set's failure is reported, and the others still run
            failed = True
            print(f"{what}: FAIL: {type(e).__name__}: {e} ({'; '.join(getattr(e, '__notes__', []))})")
            continue
        ok = worst < TOLERANCE and set(served.values()) == {name}
        failed |= not ok
        print(f"{what}: served by {served}; worst rel. error {worst:.2e} (tolerance {TOLERANCE}): "
              f"{'OK' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
