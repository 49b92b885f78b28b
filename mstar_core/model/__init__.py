"""A tiny decoder used by the demo and the benchmarks."""

from .tiny import TinyDecoder, TinyDecoderConfig

__all__ = ["TinyDecoder", "TinyDecoderConfig"]
