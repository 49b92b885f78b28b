"""The paged KV manager's plan: per-span layout and the FlashInfer-style arrays, per label."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpanLayout:
    """Where one span's tokens live. ``length`` counts the stream's tokens after this step;
    this step's ``to_compute`` tokens sit at positions ``length - to_compute .. length - 1``
    and at packed offsets ``q_start .. q_start + to_compute - 1`` of their label."""

    request_id: str
    label: str
    pages: tuple[int, ...]
    length: int
    to_compute: int
    commit: bool
    q_start: int
    generation: int

    @property
    def prefix_len(self) -> int:
        """Tokens already in the cache before this step."""
        return self.length - self.to_compute


@dataclass(frozen=True)
class LabelLayout:
    """One label's packed rows. Index arrays are int32 on the host (what FlashInfer's ``plan``
    wants); write locations and positions are on the cache's device (what the layers read)."""

    spans: tuple[SpanLayout, ...]
    qo_indptr: torch.Tensor  # [rows + 1] int32, on cpu
    kv_indptr: torch.Tensor  # [rows + 1] int32, on cpu
    kv_indices: torch.Tensor  # [pages] int32, on cpu
    kv_last_page_len: torch.Tensor  # [rows] int32, on cpu; 0 for a row with no pages
    kv_lens: torch.Tensor  # [rows] int32, on cpu
    write_pages: torch.Tensor  # [tokens] int64, on device: page of each packed token
    write_offsets: torch.Tensor  # [tokens] int64, on device: slot within that page
    positions: torch.Tensor  # [tokens] int64, on device

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def q_lens(self) -> tuple[int, ...]:
        return tuple(s.to_compute for s in self.spans)


@dataclass(frozen=True)
class KVPlan:
    """Per-label layouts of one step, labels in first-appearance order."""

    labels: tuple[tuple[str, LabelLayout], ...]
    page_size: int

    def layout(self, label: str | None = None) -> LabelLayout:
        """The layout of ``label``; ``None`` is allowed when the step has exactly one label."""
        if label is None:
            if len(self.labels) != 1:
                names = [n for n, _ in self.labels]
                raise ValueError(f"label=None is ambiguous: this step has labels {names}; name one")
            return self.labels[0][1]
        for name, lay in self.labels:
            if name == label:
                return lay
        raise KeyError(f"label {label!r} is not in this step; its labels are {[n for n, _ in self.labels]}")

    @property
    def spans(self) -> tuple[SpanLayout, ...]:
        return tuple(s for _, lay in self.labels for s in lay.spans)
