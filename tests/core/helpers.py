import torch

from mstar_core.backends import reference as R
from mstar_core.resources.kv import KVConfig, KVManager

REF_WRAPPERS = {
    "paged_prefill": R.ReferencePrefillWrapper,
    "paged_decode": R.ReferenceDecodeWrapper,
    "mixed": R.ReferenceMixedWrapper,
}


def small_kv(max_pages=8, page_size=4, layers=2, hkv=2, hq=4, d=8, dtype=torch.float64):
    cfg = KVConfig(layers, hkv, d, page_size, max_pages, hq)
    return KVManager(cfg, "cpu", dtype)
