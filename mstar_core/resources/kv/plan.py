"""The paged KV manager's plan: per-span layout and the FlashInfer-style arrays, per label."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def token_arrays(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
                 page_size: int) -> dict[str, torch.Tensor]:
    """Per packed token (int64, on the host): its page, its slot in that page, its position."""
    qo, kv_indptr, kv_indices, kv_lens = (t.to(torch.int64) for t in (qo_indptr, kv_indptr, kv_indices, kv_lens))
    q_lens = qo[1:] - qo[:-1]
    row_of = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    pos = (kv_lens - q_lens)[row_of] + (torch.arange(int(qo[-1])) - qo[row_of])
    pages = kv_indices[kv_indptr[row_of] + pos // page_size] if kv_indices.numel() else torch.zeros(0, dtype=torch.int64)
    return {"write_pages": pages, "write_offsets": pos % page_size, "positions": pos}


@dataclass(frozen=True)
class LabelLayout:
    """One label's packed rows. Index arrays are int32 on the host (what FlashInfer's ``plan``
    wants); write locations and positions are on the cache's device (what the layers read).

    The per-token device arrays of an eager step are built on first use: a backend that never
    writes through the plan (the dense one) and a model that supplies its own positions never
    pay for them. A graph step has them staged at plan time, in the static buffers."""

    spans: tuple[SpanLayout, ...]
    qo_indptr: torch.Tensor  # [rows + 1] int32, on cpu
    kv_indptr: torch.Tensor  # [rows + 1] int32, on cpu
    kv_indices: torch.Tensor  # [pages] int32, on cpu
    kv_last_page_len: torch.Tensor  # [rows] int32, on cpu; 0 for a row with no pages
    kv_lens: torch.Tensor  # [rows] int32, on cpu
    page_size: int
    device: torch.device
    per_token: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def _token(self, name: str) -> torch.Tensor:
        if not self.per_token:
            host = token_arrays(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_lens, self.page_size)
            self.per_token.update({k: t.to(self.device) for k, t in host.items()})
        return self.per_token[name]

    @property
    def write_pages(self) -> torch.Tensor:
        """``[tokens]`` int64 on the device: the page of each packed token."""
        return self._token("write_pages")

    @property
    def write_offsets(self) -> torch.Tensor:
        """``[tokens]`` int64 on the device: its slot within that page."""
        return self._token("write_offsets")

    @property
    def positions(self) -> torch.Tensor:
        """``[tokens]`` int64 on the device: its position in its stream."""
        return self._token("positions")

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
