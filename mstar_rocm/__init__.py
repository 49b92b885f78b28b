"""mstar-rocm: AITER's varlen flash attention as mstar's prefixed ragged (dense) wrapper on ROCm.

Importing this package imports no kernel library: ``aiter`` is imported when a wrapper is built."""
