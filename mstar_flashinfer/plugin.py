"""Entry point ``flashinfer`` (group ``mstar.backends``) of the mstar-flashinfer distribution.
Registers the backend as data; imports no kernel library."""

from __future__ import annotations

import torch

from mstar_core.plugin import BackendSpec, HeadDims, hookimpl

PAGED_FEATURES = ("fp8_e4m3", "fp8_e5m2", "soft_cap", "layer_windows", "sink_logits")
# What the sink-logit variant does not run with (see features below).
SINKS_ALONE = (("sink_logits", "soft_cap"), ("sink_logits", "fp8_e4m3"), ("sink_logits", "fp8_e5m2"))

FLASHINFER = BackendSpec(
    name="flashinfer",
    provides={
        "paged_prefill": "mstar_flashinfer.prefill:FlashInferPrefillWrapper",
        "paged_decode": "mstar_flashinfer.decode:FlashInferDecodeWrapper",
        "mixed": "mstar_flashinfer.mixed:FlashInferMixedWrapper",
        "prefixed_ragged": "mstar_flashinfer.ragged:FlashInferPrefixedPrefillWrapper",
    },
    devices=("cuda",),
    dtypes=(torch.float16, torch.bfloat16),
    # FlashInfer 0.5.3: the sm90 kernels static_assert HEAD_DIM in {64, 128, 256}
    # (attention/hopper/prefill_sm90.cuh) and the fa2 dispatch covers the same dims plus 512,
    # which neither the sm90 path nor tensor-core decode runs. Page sizes: any.
    head_dims=HeadDims(values=(64, 128, 256)),
    # Its fa2 kernels need sm80 for bf16 (sm75 runs fp16 only); one declared floor for both.
    min_compute_capability=(8, 0),
    # The paged wrappers take use_cuda_graph buffers; the ragged (dense) path is eager-only.
    capturable=("paged_prefill", "paged_decode", "mixed"),
    # FP8 KV (kv_data_type, k_scale/v_scale at run) and soft-cap (logits_soft_cap) on every paged
    # path; windows per layer through the managers (one plan per window). Sink logits on every
    # paged path, eager and in graphs, any page size and the declared head dims: a plan with
    # sink_logits=True runs FlashInfer's AttentionSink JIT variant (fa2/fa3; decode rows as one-query
    # prefill rows), never its plain wrappers (which drop `sinks` off sm100). That variant has no
    # soft-cap and is built here for 16-bit K/V only, so sink logits with soft-cap or an FP8 cache
    # are excluded (below; the wrappers refuse such a plan: mstar_flashinfer.sinks). Not on the
    # dense path (no `sinks` there).
    # Multi-token decode rows run on the prefill wrapper in graph mode (static rows and tokens):
    # declared there (plugin API 1.1); FlashInfer's decode wrapper takes one query per row.
    features={
        "paged_prefill": (*PAGED_FEATURES, "multi_token_decode"),
        "paged_decode": PAGED_FEATURES,
        "mixed": PAGED_FEATURES,
        "prefixed_ragged": ("soft_cap", "layer_windows"),
    },
    excludes=dict.fromkeys(("paged_prefill", "paged_decode", "mixed"), SINKS_ALONE),
    probe="mstar_flashinfer.probe:probe",
    # FlashInfer JIT-compiles each kernel family on first use: `mstar warmup` does it ahead.
    warmup="mstar_flashinfer.warmup:warmup",
    description="FlashInfer paged prefill/decode/mixed and ragged prefill (JIT-compiled on first use)",
    install_hint="pip install 'flashinfer-python>=0.5.3,<=0.7.4'",
    # Median kernel times on the H200 (bench/paged_backends.py): auto's order between paged backends.
    measured="mstar_flashinfer.measured:table",
    # auto: first for the paged group where no measured table decides; on the dense path after
    # FA3 and AITER, which run only where they have a kernel.
    priority=100,
    api_version="2.0",
)


@hookimpl
def mstar_register_backends(register):
    register(FLASHINFER)
