"""A model from local files, never from the network: a directory with ``config.json``
(safetensors weights when present, random weights from a seed otherwise, and a tokenizer when it
has one), or a GGUF file (config, weights and tokenizer in one file, read by transformers' GGUF
loader). The config and tokenizer are read before the weights, so the CLI can check the prompts
against them first."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mstar_core.errors import InputError, StateError
from mstar_core.text_files import read_text

log = logging.getLogger(__name__)

# transformers' GGUF loader imports gguf to read the file and needs accelerate to build the model.
GGUF_PACKAGES = ("gguf", "accelerate")
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
    text = read_text(d / name, f"{_where(d)}: {name}")
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


@dataclass(frozen=True)
class Source:
    """Where a model's files lie: its directory, and the GGUF file in it when it is one."""

    directory: Path
    gguf: str | None = None

    def __str__(self) -> str:
        return str(self.directory / self.gguf) if self.gguf else str(self.directory)

    def where(self) -> str:
        return f"GGUF file {str(self)!r}" if self.gguf else _where(self.directory)

    def kwargs(self) -> dict[str, Any]:
        # local_files_only everywhere: a missing file is an error here, never a download.
        return {"local_files_only": True, **({"gguf_file": self.gguf} if self.gguf else {})}


def resolve(path: str | os.PathLike[str]) -> Source:
    """The model at ``path``: a ``.gguf`` file, a directory with ``config.json``, or a directory
    holding exactly one ``.gguf`` file."""
    if not os.fspath(path).strip():
        raise InputError("model path is empty: give a local directory with config.json, or a .gguf file")
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return Source(p.parent, p.name)
    if p.is_file():
        raise InputError(f"model path {str(p)!r} is a file but not a .gguf file: give a .gguf file or a directory "
                         "with config.json")
    if not p.is_dir():
        raise InputError(f"model path {str(p)!r} does not exist (mstar generate reads a local directory with "
                         "config.json, or a .gguf file; nothing is downloaded)")
    if (p / "config.json").is_file():
        return Source(p)
    ggufs = sorted(f.name for f in p.glob("*.gguf") if f.is_file())
    if len(ggufs) == 1:
        return Source(p, ggufs[0])
    if ggufs:
        raise InputError(f"{_where(p)} holds {len(ggufs)} .gguf files ({', '.join(ggufs)}): give the path of the "
                         "one to load")
    raise InputError(f"{_where(p)} has no config.json (nor a .gguf file)")


def _check_gguf_packages() -> None:
    missing = [m for m in GGUF_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise StateError(f"reading a .gguf file needs the {' and '.join(GGUF_PACKAGES)} packages (missing: "
                         f"{', '.join(missing)}): pip install '.[transformers]' in a clone of mstar")


def _check_directory(source: Source) -> list[Path]:
    """The directory's JSON files parsed and its safetensors headers read; its safetensors files."""
    d = source.directory
    for name in JSON_FILES:
        if (d / name).is_file():
            value = read_json(d, name)
            if not isinstance(value, dict):
                raise InputError(f"{_where(d)}: {name} must hold a JSON object, got {type(value).__name__}")
    shards = sorted(d.glob("*.safetensors"))
    for path in shards:
        check_safetensors(d, path)
    return shards


def read_config(source: Source) -> Any:
    """The model's transformers config (from ``config.json`` or the GGUF's metadata), after the
    directory's files are checked; the weights are not read."""
    from transformers import AutoConfig

    if source.gguf:
        _check_gguf_packages()
        what = source.gguf
    else:
        _check_directory(source)
        what = "config.json"
    try:
        return AutoConfig.from_pretrained(source.directory, **source.kwargs())
    except Exception as e:  # gguf's reader raises what numpy and struct raise on a damaged file
        raise InputError(f"{source.where()}: {what} does not describe a model transformers can build "
                         f"({_said(e)})") from e


def read_tokenizer(source: Source) -> Any | None:
    """The tokenizer, or None for a directory without tokenizer files (a GGUF always holds one)."""
    from transformers import AutoTokenizer

    present = [source.gguf] if source.gguf else [f for f in TOKENIZER_FILES if (source.directory / f).is_file()]
    if not present:
        return None
    try:
        return AutoTokenizer.from_pretrained(source.directory, **source.kwargs())
    except Exception as e:  # the tokenizers library raises its own exception types
        raise InputError(f"{source.where()}: the tokenizer ({', '.join(map(str, present))}) cannot be loaded "
                         f"({_said(e)})") from e


def read_model(source: Source, config: Any, device: str = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0, tp_size: int = 1) -> tuple[Any, bool]:
    """``(model in eval mode on device, weights_loaded)``: the GGUF's or the safetensors weights,
    else random weights from ``seed``. ``tp_size`` > 1 (inside an initialised process group of
    that many ranks): safetensors weights load sharded by transformers' tensor parallelism, each
    rank keeping its slice; GGUF and random weights load whole (mstar shards them when it serves
    them)."""
    from transformers import AutoModelForCausalLM

    shards = [] if source.gguf else sorted(source.directory.glob("*.safetensors"))
    weights = bool(source.gguf or shards)
    sharded: dict[str, Any] = {}
    if tp_size > 1 and shards:
        from transformers.distributed import DistributedConfig

        # transformers' sharded loading puts each rank on the host's accelerator, whatever device was asked for.
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None and torch.device(device).type != accelerator.type:
            raise InputError(f"{source.where()}: loading its safetensors weights sharded over {tp_size} ranks puts "
                             f"each rank on this host's {accelerator.type}, not {device}: run on --device "
                             f"{accelerator.type}")
        sharded["distributed_config"] = DistributedConfig(tp_size=tp_size)
    try:
        if weights:
            model = AutoModelForCausalLM.from_pretrained(source.directory, config=config, dtype=dtype,
                                                         **source.kwargs(), **sharded)
        else:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            log.info("%s has no safetensors weights: random weights from seed %d", source.directory, seed)
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = source.gguf or (", ".join(p.name for p in shards) if shards else "config.json")
        raise InputError(f"{source.where()}: no causal LM could be built from {what} ({_said(e)})") from e
    # transformers wraps PreTrainedModel.to in functools.wraps, whose type does not bind self.
    return model.to(device).eval(), weights  # type: ignore[arg-type]


def load(path: str | os.PathLike[str], device: str = "cpu", dtype: torch.dtype = torch.float32,
         seed: int = 0) -> tuple[Any, Any | None, bool]:
    """``(model, tokenizer or None, weights_loaded)`` from a model directory or GGUF file; an
    :class:`InputError` names what is missing or damaged."""
    source = resolve(path)
    config = read_config(source)
    tokenizer = read_tokenizer(source)
    model, weights = read_model(source, config, device, dtype, seed)
    return model, tokenizer, weights
