"""Small random-weight transformers models of the architectures mstar's transformers
integration is tested on, built from their config classes (nothing is downloaded). Shared by
the CPU tests and the GPU scripts in bench/; imports transformers only when called.

Across them: GQA ratios 1, 2, 4 and 8, head dims 64, 128 and 256, a sliding window on every
layer (Mistral), alternating sliding and full layers (Gemma 2, gpt-oss), logit soft-cap
(Gemma 2), sink logits (gpt-oss), q/k norms (Qwen 3).
"""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.errors import InputError

ARCHITECTURES = ("llama", "qwen3", "mistral", "gemma2", "gpt_oss")

# Per architecture: (config class, model class, its own keywords). head_dim / heads give the GQA
# ratio and head dim each covers; windows are short enough that the CPU prompts cross them.
_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=128)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64, sliding_window=24)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_attention_heads=4, num_key_value_heads=2, head_dim=256, sliding_window=20,
                    attn_logit_softcapping=5.0, final_logit_softcapping=30.0, query_pre_attn_scalar=64)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_attention_heads=8, num_key_value_heads=1, head_dim=64, sliding_window=20,
                     num_local_experts=4, num_experts_per_tok=2)),
}

# The GPU sizes: wide enough that the kernels, not the host, decide (head dims 64/128/256).
_GPU: dict[str, dict[str, Any]] = {
    "llama": dict(num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "qwen3": dict(num_attention_heads=16, num_key_value_heads=2, head_dim=128),
    "mistral": dict(num_attention_heads=8, num_key_value_heads=8, head_dim=128, sliding_window=128),
    "gemma2": dict(num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=128,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256),
    "gpt_oss": dict(num_attention_heads=32, num_key_value_heads=4, head_dim=64, sliding_window=128,
                    num_local_experts=8, num_experts_per_tok=2),
}


def config(arch: str, size: str = "tiny", **overrides: Any) -> Any:
    """The transformers config of ``arch`` at ``size`` ("tiny": CPU tests; "gpu": GPU checks)."""
    import transformers

    if arch not in _SPECS:
        raise InputError(f"unknown architecture {arch!r}; choose one of {list(ARCHITECTURES)}")
    if size not in ("tiny", "gpu"):
        raise InputError(f"unknown size {size!r}; choose 'tiny' or 'gpu'")
    cfg_name, _, own = _SPECS[arch]
    if size == "tiny":
        # initializer_range 0.2: random logits peaked enough that greedy ties are vanishingly rare.
        kw: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  initializer_range=0.2)
    else:
        # initializer_range 0.01: at this width a wider init leaves the random logits so flat that
        # bf16 rounding alone flips greedy tokens (transformers' own eager, bf16 against fp32, agreed
        # on 65/128 tokens at 0.02 and 116/128 at 0.01 on a 1024-wide Llama).
        kw = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                  initializer_range=0.01)
        own = {**own, **_GPU[arch]}
    # No special tokens: a random model must not stop early on one (both sides run to the end).
    kw.update(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return getattr(transformers, cfg_name)(**{**kw, **own, **overrides})


def build(arch: str, size: str = "tiny", dtype: torch.dtype = torch.float32, device: str = "cpu",
          seed: int = 0, attn_implementation: str = "eager", **overrides: Any) -> Any:
    """A random-weight ``arch`` model in eval mode."""
    import transformers

    cfg = config(arch, size, **overrides)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, _SPECS[arch][1])(cfg)
    return model.to(device=device, dtype=dtype).eval()
