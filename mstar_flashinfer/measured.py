"""The flashinfer backend's measured kernel times (``measured.json``, written by
bench/paged_backends.py on the GPU it names), which order auto's candidates
(``mstar_core.plugin.MeasuredTable``)."""

from __future__ import annotations

from mstar_core.plugin import MeasuredTable, load_table


def table() -> MeasuredTable:
    return load_table(__package__, "measured.json")
