"""A model from a local directory, never from the network: ``config.json``, safetensors weights
when present (random weights from a seed otherwise), and a tokenizer when the directory has one."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from mstar_core.errors import InputError

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load(directory: str | os.PathLike[str], device: str = "cpu", dtype: torch.dtype = torch.float32,
         seed: int = 0) -> tuple[Any, Any | None, bool]:
    """``(model, tokenizer or None, weights_loaded)`` from ``directory``; raises ``ValueError``
    naming what is missing."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = Path(directory)
    if not d.is_dir():
        raise InputError(f"model directory {str(d)!r} does not exist (mstar generate reads a local directory with "
                         "config.json; nothing is downloaded)")
    if not (d / "config.json").is_file():
        raise InputError(f"model directory {str(d)!r} has no config.json")
    weights = any(d.glob("*.safetensors"))
    if weights:
        # local_files_only everywhere: a missing file is an error here, never a download.
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=dtype)
    else:
        config = AutoConfig.from_pretrained(d, local_files_only=True)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        log.info("%s has no safetensors weights: random weights from seed %d", d, seed)
    tokenizer = None
    if any((d / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
    # transformers wraps PreTrainedModel.to in functools.wraps, whose type does not bind self.
    return model.to(device).eval(), tokenizer, weights  # type: ignore[arg-type]
