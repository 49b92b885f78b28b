"""NVTX ranges that cost nothing when off: a wrapper built with ``enable_nvtx=False`` (or off CUDA)
gets the shared no-op context."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

_OFF = nullcontext()


class _Range:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.nvtx.range_pop()


class Nvtx:
    """``with self._nvtx("plan"): ...`` -- ranges are named ``<prefix>.<what>``."""

    def __init__(self, prefix: str, enabled: bool, device: torch.device) -> None:
        self.on = bool(enabled) and device.type == "cuda"
        self.prefix = prefix

    def __call__(self, what: str) -> AbstractContextManager[None]:
        return _Range(f"{self.prefix}.{what}") if self.on else _OFF
