"""Kernels the core ships itself (not through a backend plugin): bounded attention."""
