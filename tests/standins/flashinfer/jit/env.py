"""flashinfer.jit.env's folder of JIT-built modules; tests point it at a temporary folder."""

import pathlib
import tempfile

FLASHINFER_JIT_DIR: pathlib.Path = pathlib.Path(tempfile.gettempdir()) / "flashinfer-standin" / "cached_ops"
