"""mstar-fa3: FlashAttention-3's varlen kernel as mstar's prefixed ragged (dense) wrapper.

Importing this package imports no kernel library: ``flash_attn_interface`` is imported when a
wrapper is built."""
