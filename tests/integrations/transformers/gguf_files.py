"""A tiny llama written as a GGUF file by the ``gguf`` package, with the metadata and tensor names
transformers' GGUF loader reads, and a byte-level BPE tokenizer with a BOS and a chat template."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<s>", "<|user|>", "<|system|>", "<|assistant|>"]
BOS, EOS = 1, 0


def _tokens(vocab: int) -> tuple[list[str], list[str]]:
    """Printable ASCII in GPT-2's byte alphabet, then two-letter merges up to ``vocab``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    singles = [spell[b] for b in range(32, 127)]
    pairs = [(a, b) for a in "abcdefghij" for b in "abcdefghij"][: vocab - len(SPECIAL) - len(singles)]
    return SPECIAL + singles + [a + b for a, b in pairs], [f"{a} {b}" for a, b in pairs]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its rotary pairs are adjacent); the loader undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, path: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    import gguf

    cfg = model.config
    tokens, merges = _tokens(cfg.vocab_size)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))  # 3: control, 1: normal
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        if target is None:
            continue
        a = t.detach().float().numpy()
        if target.endswith("attn_q"):
            a = _permute(a, cfg.num_attention_heads)
        elif target.endswith("attn_k"):
            a = _permute(a, cfg.num_key_value_heads)
        w.add_tensor(f"{target}.{suffix}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
