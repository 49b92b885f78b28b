"""Hugging Face transformers' own generation paths, timed: the baselines a decode benchmark holds
mstar against.

* ``hf_generate``: ``model.generate`` (greedy), with the default dynamic cache or
  ``cache_implementation="static"`` (which transformers auto-compiles with ``torch.compile``,
  mode ``reduce-overhead``, on CUDA; never on CPU).
* ``hf_generate_batch``: transformers' continuous-batching engine (``model.generate_batch``, a
  paged KV cache driven by a background thread), or ``None`` where the installed version lacks it.

Both take a causal LM already on its device (the caller picks ``attn_implementation``, e.g. sdpa)
and ``prompts``, a list of token-id lists, and return a plain, JSON-ready dict. Units are in the key
names: ``_s`` seconds, ``_ms`` milliseconds, ``tok_per_s`` generated tokens per second.

Written against transformers 5.17.0 and 5.24.0 (the continuous-batching API differs between them:
see ``_cb_attn_and_config``). ``python3 bench/transformers_baselines.py --smoke`` checks every path on CPU
with a tiny random Llama.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import torch
from report import dist_version

from mstar_core.testing.timing import event, sync

log = logging.getLogger("transformers_baselines")


# --------------------------------------------------------------------------------------------- #
# helpers


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _pad_id(model) -> int:
    """The pad id ``generate`` is given: the model's pad, else its (first) eos, else 0."""
    for cfg in (model.generation_config, model.config):
        for name in ("pad_token_id", "eos_token_id"):
            v = getattr(cfg, name, None)
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            if v is not None:
                return int(v)
    return 0


def _batch(prompts: list[list[int]], pad_id: int, device: torch.device):
    """Left-padded ``input_ids`` and ``attention_mask`` (no padding when all prompts are one length)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _attn_impl(model) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


# --------------------------------------------------------------------------------------------- #
# model.generate

# A checkpoint's generation_config fills every field a call leaves unset (e.g. a
# repetition_penalty): these keep the logits untouched, so greedy is a plain argmax.
_PLAIN_GREEDY = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0}


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int,
                cache_implementation: str | None = None, *, warmup: int | None = None,
                reps: int = 3, first_reps: int = 3, return_output_ids: bool = False) -> dict:
    """Greedy ``model.generate`` on ``prompts``, exactly ``max_new_tokens`` new tokens each
    (``min_new_tokens`` = ``max_new_tokens``, so no eos stops a row early; a checkpoint's
    ``repetition_penalty``/``no_repeat_ngram_size`` are neutralised: a plain argmax).

    Measured, in this order (full runs first: transformers sizes each new static cache to the
    longest one seen on this model, ``_previous_max_cache_length``, so the short runs then get
    the same cache shape and nothing recompiles between timed runs):

    1. ``warmup`` untimed full runs (default: 1, or 2 for ``"static"``, whose first run compiles the
       decode step and whose CUDA graphs are recorded on the following calls);
    2. ``first_reps`` timed runs with ``max_new_tokens=1`` (after one untimed): prefill plus the
       first token; their median is ``ttft_s``;
    3. ``reps`` timed full runs; their median is ``total_s``.

    Each run is one whole ``generate`` call bracketed by timing events (CUDA events on CUDA, the
    host clock elsewhere), so it includes ``generate``'s own host work (cache creation, logits
    processors, stopping checks). Derived: ``decode_ms_per_step = (total_s - ttft_s) / (n - 1)``
    in ms (one step = one new token for every row), ``decode_tok_per_s = batch /
    decode_s_per_step`` and ``total_tok_per_s = batch * n / total_s`` (prefill included).
    ``return_output_ids`` adds the new tokens of the last full run (a list per prompt).
    """
    dev = _device(model)
    pad = _pad_id(model)
    ids, mask = _batch(prompts, pad, dev)
    batch, n = ids.shape[0], int(max_new_tokens)
    static = cache_implementation == "static"
    if warmup is None:
        warmup = 2 if static else 1

    def run(k: int):
        kw = {"attention_mask": mask, "do_sample": False, "max_new_tokens": k, "min_new_tokens": k,
              "pad_token_id": pad, **_PLAIN_GREEDY}
        if cache_implementation is not None:
            kw["cache_implementation"] = cache_implementation
        sync(dev)
        a, b = event(dev), event(dev)
        a.record()
        out = model.generate(ids, **kw)
        b.record()
        sync(dev)
        if out.shape[1] != ids.shape[1] + k:
            raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, not {k}")
        return a.elapsed_time(b) / 1e3, out

    t0 = time.perf_counter()
    for _ in range(warmup):
        run(n)
    warmup_s = time.perf_counter() - t0

    run(1)  # untimed: the first run of another length
    ttft = statistics.median(run(1)[0] for _ in range(first_reps))
    fulls = []
    out = None
    for _ in range(reps):
        t, out = run(n)
        fulls.append(t)
    total = statistics.median(fulls)

    step_ms = (total - ttft) / (n - 1) * 1e3 if n > 1 else float("nan")
    res = {
        "path": "generate_static" if static else (
            "generate" if cache_implementation is None else f"generate_{cache_implementation}"),
        "transformers": dist_version("transformers"),
        "torch": torch.__version__,
        "device": str(dev),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attn_implementation": _attn_impl(model),
        "cache_implementation": cache_implementation or "dynamic",
        "batch": batch,
        "prompt_len": ids.shape[1],
        "max_new_tokens": n,
        "warmup_runs": warmup,
        "warmup_s": warmup_s,
        "ttft_reps": first_reps,
        "full_reps": reps,
        "compiled": hasattr(model, "_compiled_call"),  # transformers auto-compiled the decode step
        "ttft_s": ttft,
        "total_s": total,
        "total_s_all": fulls,
        "decode_ms_per_step": step_ms,
        "decode_tok_per_s": batch / (step_ms / 1e3) if step_ms > 0 else float("nan"),
        "total_tok_per_s": batch * n / total,
    }
    if return_output_ids:
        res["output_ids"] = out[:, ids.shape[1]:].tolist()
    return res


# --------------------------------------------------------------------------------------------- #
# continuous batching: model.generate_batch


def _cb_attn_and_config(model, attn: str, cb_overrides: dict | None):
    """The attention name to run continuous batching with, and its ``ContinuousBatchingConfig``.

    transformers 5.24 (``ContinuousBatchingConfig.auto_switch_to_flash`` exists): ``"sdpa"`` is
    served by the paged engine as is (``paged|`` is only kept for ``paged|eager``; ``paged|sdpa``
    is stripped with a deprecation warning), and ``auto_switch_to_flash=False`` stops the manager
    swapping sdpa for an installed flash-attention. transformers 5.17 (no such field): the manager
    swaps any non-``paged|`` name for flash-attention when one is importable (or loadable from the
    kernels hub), so ``paged|sdpa`` is set to keep sdpa. ``cb_overrides`` are further config
    fields (e.g. ``num_blocks``, ``use_cuda_graph``); ones this version lacks are dropped (logged).
    """
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} \
        if dataclasses.is_dataclass(ContinuousBatchingConfig) else set()
    kw = {}
    if "auto_switch_to_flash" in fields:
        kw["auto_switch_to_flash"] = False
        name = attn.removeprefix("paged|") if attn != "paged|eager" else attn
    else:
        name = attn if attn.startswith("paged|") else f"paged|{attn}"
    overrides = dict(cb_overrides or {})
    if "page_size" in fields and "page_size" in overrides:
        overrides.pop("block_size", None)  # 5.24: block_size is page_size's deprecated alias
    for k, v in overrides.items():
        if fields and k not in fields:
            log.info("ContinuousBatchingConfig has no field %r in this version: dropped", k)
        else:
            kw[k] = v
    return name, ContinuousBatchingConfig(**kw)


def cb_workload_sizing(prompts: list[list[int]], max_new_tokens: int, page_size: int = 256,
                       chunk: int | None = None) -> dict:
    """``cb_overrides`` that size the paged cache for exactly this workload instead of from free
    device memory: every request's prompt + new tokens in whole pages (+1 page of slack each), and
    ``max_batch_tokens`` = all prompts in one step (or ``chunk``). The config field is
    ``page_size`` in 5.24 and ``block_size`` in 5.17; both are given, the unknown one is dropped."""
    pages = sum(-(-(len(p) + max_new_tokens) // page_size) + 1 for p in prompts)
    return {"num_blocks": pages, "max_batch_tokens": chunk or sum(len(p) for p in prompts),
            "page_size": page_size, "block_size": page_size}


def _cb_summary(manager) -> dict:
    """What the (resolved) continuous-batching config of a live manager says."""
    if manager is None:
        return {}
    cfg = manager.continuous_batching_config
    out = {}
    for k in ("page_size", "block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
              "use_cuda_graph", "use_async_batching", "default_compile_level", "allow_block_sharing"):
        v = getattr(cfg, k, None)
        if v is not None:
            out[k] = list(v) if isinstance(v, tuple) else v
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    for k in ("num_blocks", "max_batch_tokens", "block_size", "page_size"):
        v = getattr(cache, k, None)
        if isinstance(v, int):
            out[f"cache_{k}"] = v
    return out


def hf_generate_batch(model, prompts: list[list[int]], max_new_tokens: int, *,
                      attn_implementation: str = "sdpa", reps: int = 2,
                      cb_overrides: dict | None = None,
                      return_output_ids: bool = False) -> dict | None:
    """Greedy continuous batching (``model.generate_batch``) of all ``prompts`` at once, exactly
    ``max_new_tokens`` new tokens each (eos disabled: ``eos_token_id=-1``; a fresh
    ``GenerationConfig``, so none of the checkpoint's logits processors). ``None`` (reason
    logged) when this transformers has no ``generate_batch``. The model is switched to the
    paged-capable name of ``attn_implementation`` for the run and switched back after.

    The first call builds the manager (paged cache sized from free device memory unless
    ``cb_overrides`` says otherwise; CUDA-graph warm-up) and keeps it (``persistent_manager``);
    the ``reps`` timed calls reuse it, so they hold no cache allocation or graph capture.
    Figures, the median over the timed calls:

    * ``wall_s``: the whole ``generate_batch`` call (incl. thread start, stop, gc);
    * ``span_s``: first request created -> last request finished (the requests' own
      ``time.perf_counter`` stamps), the engine's time for the batch, prefill included;
    * ``sched_span_s``: first request scheduled -> last request finished; it leaves out the
      session's start (each ``generate_batch`` call resets the engine's static tensors once the
      requests are queued; with sdpa/eager that includes a dense float mask of
      ``max_batch_tokens x (cache tokens + max_batch_tokens)``, a cost that grows with the cache
      size: pass ``cb_overrides=cb_workload_sizing(prompts, n)`` to size the cache for the
      workload and keep it small); ``queue_s_median``: request created -> scheduled, the median;
    * ``tok_per_s = batch * n / span_s``, ``sched_tok_per_s = batch * n / sched_span_s`` and
      ``wall_tok_per_s = batch * n / wall_s``;
    * per request (``record_timestamps``; a token is stamped on the host when the engine reads it
      back): ``ttft_s_median``/``ttft_s_max`` = first token stamp - request creation, and
      ``itl_ms_median`` = (last stamp - first stamp) / (n - 1), the median over requests.
    """
    if not hasattr(model, "generate_batch"):
        log.warning("transformers %s has no model.generate_batch: continuous batching skipped",
                    dist_version("transformers"))
        return None
    from transformers import GenerationConfig

    dev = _device(model)
    n = int(max_new_tokens)
    original = _attn_impl(model)
    name, cb_cfg = _cb_attn_and_config(model, attn_implementation, cb_overrides)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=-1,
                               pad_token_id=_pad_id(model))
    if name != original:
        model.set_attn_implementation(name)
    used_attn = name
    summary: dict = {}

    def call():
        sync(dev)
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen_cfg,
                                   continuous_batching_config=cb_cfg, record_timestamps=True,
                                   progress_bar=False, persistent_manager=True, warmup=True)
        sync(dev)
        return time.perf_counter() - t0, out

    try:
        t0 = time.perf_counter()
        _, out = call()  # builds, warms and keeps the manager
        setup_s = time.perf_counter() - t0
        mgr = getattr(model, "_cached_continuous_batching_manager", None)
        summary = _cb_summary(mgr)
        walls, spans, sched, queues, ttfts, itls = [], [], [], [], [], []
        for _ in range(reps):
            wall, out = call()
            res = list(out.values())
            if len(res) != len(prompts):
                raise RuntimeError(f"generate_batch returned {len(res)} of {len(prompts)} requests")
            bad = [r.request_id for r in res if r.error is not None or len(r.generated_tokens) != n]
            if bad:
                raise RuntimeError(f"requests {bad[:4]} failed or did not generate {n} tokens")
            walls.append(wall)
            spans.append(max(r.lifespan[1] for r in res) - min(r.created_time for r in res))
            sched.append(max(r.lifespan[1] for r in res) - min(r.lifespan[0] for r in res))
            queues.append(statistics.median(r.lifespan[0] - r.created_time for r in res))
            ttfts.append([r.timestamps[0] - r.created_time for r in res if r.timestamps])
            itls.append([(r.timestamps[-1] - r.timestamps[0]) / (n - 1) * 1e3
                         for r in res if r.timestamps and n > 1])
    finally:
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        if _attn_impl(model) != original and original is not None:
            model.set_attn_implementation(original)

    i = walls.index(statistics.median_low(walls))  # the figures of one call, the median one by wall
    batch = len(prompts)
    res = {
        "path": "generate_batch",
        "transformers": dist_version("transformers"),
        "torch": torch.__version__,
        "device": str(dev),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attn_implementation": used_attn,
        "batch": batch,
        "prompt_len": max(len(p) for p in prompts),
        "max_new_tokens": n,
        "warmup_runs": 1,
        "warmup_s": setup_s,
        "reps": reps,
        "wall_s": statistics.median(walls),
        "span_s": statistics.median(spans),
        "wall_s_all": walls,
        "span_s_all": spans,
        "sched_span_s": statistics.median(sched),
        "queue_s_median": queues[i],
        "tok_per_s": batch * n / statistics.median(spans),
        "sched_tok_per_s": batch * n / statistics.median(sched),
        "wall_tok_per_s": batch * n / statistics.median(walls),
        "ttft_s_median": statistics.median(ttfts[i]) if ttfts[i] else None,
        "ttft_s_max": max(ttfts[i]) if ttfts[i] else None,
        "itl_ms_median": statistics.median(itls[i]) if itls[i] else None,
        "cb_config": summary,
    }
    if return_output_ids:
        res["output_ids"] = [list(r.generated_tokens) for r in out.values()]
    return res


# --------------------------------------------------------------------------------------------- #
# CPU smoke


def _smoke() -> None:
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)  # a correctness check: keep it off a busy 2-core host's other work
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                          dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 256, (4, 8), generator=g).tolist()
    n = 4

    ids = torch.tensor(prompts)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, min_new_tokens=n, pad_token_id=_pad_id(model))
    ref = ref[:, ids.shape[1]:].tolist()

    results = []
    for ci in (None, "static"):
        r = hf_generate(model, prompts, n, ci, reps=2, first_reps=2, return_output_ids=True)
        assert r["output_ids"] == ref, (ci, r["output_ids"], ref)
        assert r["attn_implementation"] == "sdpa"
        results.append(r)
    # sized for the workload: 5.17 sizes the cache from host memory on CPU (0 without psutil)
    r = hf_generate_batch(model, prompts, n, reps=2, return_output_ids=True,
                          cb_overrides=cb_workload_sizing(prompts, n, page_size=16))
    if r is not None:
        assert r["output_ids"] == ref, ("generate_batch", r["output_ids"], ref)
        assert _attn_impl(model) == "sdpa", _attn_impl(model)  # restored
        results.append(r)
    for r in results:
        r.pop("output_ids")
        print(json.dumps(r, indent=None))
    print(f"smoke OK: transformers {dist_version('transformers')}, "
          f"{len(results)} paths, output ids equal to plain generate")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="check every path on CPU, tiny Llama")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if a.smoke:
        _smoke()
    else:
        p.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
