"""Stand-in for flashinfer.utils.determine_attention_backend (0.5.3 utils.py:450; 0.7.4 adds two
keyword-only head dims): fa3 on an sm90 GPU for fp16/bf16 without custom mask, RoPE or fp16 QK
reduction, else fa2."""


import torch


def determine_attention_backend(
    device: torch.device,
    pos_encoding_mode: int,
    use_fp16_qk_reductions: bool,
    use_custom_mask: bool,
    dtype_q: torch.dtype,
    dtype_kv: torch.dtype,
    *,
    head_dim_qk: int | None = None,
    head_dim_vo: int | None = None,
) -> str:
    device = torch.device(device)
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    plain = pos_encoding_mode == 0 and not use_fp16_qk_reductions and not use_custom_mask
    return "fa3" if sm90 and plain and dtype_q in (torch.float16, torch.bfloat16) else "fa2"
