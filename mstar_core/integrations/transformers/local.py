"""A model from a local directory, never from the network: ``config.json``, safetensors weights
when present (random weights from a seed otherwise), and a tokenizer when the directory has one."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from mstar_core.errors import InputError

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# The JSON files transformers reads from a model directory, checked first so that a corrupt one is
# an error naming it, the line and the column (transformers raises a bare JSONDecodeError or an
# OSError that names neither).
JSON_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _said(e: BaseException) -> str:
    """``Type: message`` of a library's exception, on one line."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _where(d: Path) -> str:
    return f"model directory {str(d)!r}"


def read_json(d: Path, name: str) -> Any:
    """``d / name`` parsed; an unreadable, non-UTF-8 or invalid file is an :class:`InputError`
    naming the directory, the file and (invalid JSON) the line and column."""
    path = d / name
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{_where(d)}: {name} is not UTF-8 text (byte offset {e.start}: {e.reason})") from None
    except OSError as e:
        raise InputError(f"{_where(d)}: {name} cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{_where(d)}: {name} is not valid JSON (line {e.lineno}, column {e.colno}: "
                         f"{e.msg})") from None


def check_safetensors(d: Path, path: Path) -> None:
    """A safetensors file whose header parses and whose tensors lie inside the file: a truncated
    or corrupt one is an :class:`InputError` naming it (the loader would raise a bare
    ``SafetensorError``, or read past the end of a memory map)."""
    name = path.name

    def bad(why: str) -> InputError:
        return InputError(f"{_where(d)}: {name} is truncated or corrupt: {why}")

    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, less than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise bad(f"its header says {n} bytes of header, the file holds {size - 8} after the length")
            raw = f.read(n)
    except OSError as e:
        raise InputError(f"{_where(d)}: {name} cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, IndexError, TypeError,
            ValueError) as e:
        raise bad(f"its header is not a safetensors header ({type(e).__name__}: {e})") from None
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise bad(f"the file holds {size} bytes, its header describes {need}")


def load(directory: str | os.PathLike[str], device: str = "cpu", dtype: torch.dtype = torch.float32,
         seed: int = 0) -> tuple[Any, Any | None, bool]:
    """``(model, tokenizer or None, weights_loaded)`` from ``directory``; raises ``ValueError``
    naming what is missing."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not os.fspath(directory).strip():
        raise InputError("model directory is empty: give the path of a local directory with config.json")
    d = Path(directory)
    if not d.is_dir():
        raise InputError(f"model directory {str(d)!r} does not exist (mstar generate reads a local directory with "
                         "config.json; nothing is downloaded)")
    if not (d / "config.json").is_file():
        raise InputError(f"{_where(d)} has no config.json")
    for name in JSON_FILES:
        if (d / name).is_file():
            value = read_json(d, name)
            if not isinstance(value, dict):
                raise InputError(f"{_where(d)}: {name} must hold a JSON object, got {type(value).__name__}")
    shards = sorted(d.glob("*.safetensors"))
    for path in shards:
        check_safetensors(d, path)
    weights = bool(shards)
    try:
        # local_files_only everywhere: a missing file is an error here, never a download.
        config = AutoConfig.from_pretrained(d, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{_where(d)}: config.json does not describe a model transformers can build "
                         f"({_said(e)})") from e
    try:
        if weights:
            model = AutoModelForCausalLM.from_pretrained(d, config=config, local_files_only=True, dtype=dtype)
        else:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            log.info("%s has no safetensors weights: random weights from seed %d", d, seed)
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = ", ".join(p.name for p in shards) if weights else "config.json"
        raise InputError(f"{_where(d)}: no causal LM could be built from {what} ({_said(e)})") from e
    tokenizer = None
    present = [f for f in TOKENIZER_FILES if (d / f).is_file()]
    if present:
        try:
            tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        except Exception as e:  # the tokenizers library raises its own exception types
            raise InputError(f"{_where(d)}: the tokenizer ({', '.join(present)}) cannot be loaded "
                             f"({_said(e)})") from e
    # transformers wraps PreTrainedModel.to in functools.wraps, whose type does not bind self.
    return model.to(device).eval(), tokenizer, weights  # type: ignore[arg-type]
