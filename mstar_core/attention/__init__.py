"""Attention managers (paged, dense) and the wrapper protocols backends implement."""
