"""A tiny decoder used by the demo and the benchmarks."""

from mstar_core.demo.tiny import TinyDecoder, TinyDecoderConfig

__all__ = ["TinyDecoder", "TinyDecoderConfig"]
