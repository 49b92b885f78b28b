"""mstar's configuration: a mapping, or a TOML file holding the same tables, read strictly.

```toml
[attention]
backend = "flashinfer"          # a backend name, or "auto" -- or, per capability, a table:
# [attention.backend]
# paged_decode = "mykernel"     # a capability's backend; "default" for the others (else "auto")
[attention.pins]                # which distribution serves a name that several register
fast = "fast-kernels"
[kv]
prefix_cache = true             # requests that share a prefix share its pages (default false)
```

An unknown table or key is an error that names it, where it is, and the closest known key: a
misspelled table silently read as "no config" would fall back to ``auto``, the one mistake a
user cannot see.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar_core.capabilities import CAPABILITIES
from mstar_core.errors import ConfigError

CONFIG_SHAPE = ('{"attention": {"backend": NAME or {CAPABILITY: NAME}, "pins": {NAME: DISTRIBUTION}}, '
                '"kv": {"prefix_cache": BOOL}}')
# The keys of a per-capability backend table besides the capabilities: the others' backend.
DEFAULT_KEY = "default"

# Every table and the keys it takes.
SCHEMA: dict[str, tuple[str, ...]] = {"attention": ("backend", "pins"), "kv": ("prefix_cache",)}

@dataclass(frozen=True)
class Config:
    """What a config asks of mstar: ``backend`` (None: not set; a name, or capability -> name
    with ``"default"`` for the rest), ``pins`` (backend name -> distribution that serves it) and
    ``prefix_cache`` (None: not set, i.e. off)."""

    backend: str | Mapping[str, str] | None = None
    pins: Mapping[str, str] = field(default_factory=dict)
    prefix_cache: bool | None = None


# What every ``config=`` argument takes: a Config already loaded, a mapping, a TOML file's path.
ConfigSource = Config | Mapping[str, Any] | str | os.PathLike[str] | None


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` to a misspelled ``word``, or ""."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_pins(pins: object, where: str) -> dict[str, str]:
    """``{backend name: distribution}``, both non-empty strings."""
    if not isinstance(pins, Mapping):
        raise ConfigError(f"{where} must map backend names to distribution names, got {type(pins).__name__} {pins!r}")
    for name, dist in pins.items():
        if not isinstance(name, str) or not name or not isinstance(dist, str) or not dist.strip():
            raise ConfigError(f"{where}: {name!r} = {dist!r}: a pin maps a backend name to the distribution that "
                             "serves it, both strings (e.g. {\"fast\": \"fast-kernels\"})")
    return {name: dist.strip() for name, dist in pins.items()}


def check_backend_table(table: object, where: str) -> dict[str, str]:
    """A per-capability backend choice: capability (or ``"default"``) -> a backend name or
    ``"auto"``, checked; an unknown key names the known ones."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a backend name or a table of capability -> backend name, got "
                          f"{type(table).__name__} {short(table)}")
    keys = (*CAPABILITIES, DEFAULT_KEY)
    out = {}
    for key, name in table.items():
        if key not in keys:
            raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(str(key), keys)}; a per-capability backend "
                              f"table takes {', '.join(keys)} ({DEFAULT_KEY!r}: every capability not named)")
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{where}: {key} = {short(name)}: give a backend name or 'auto'")
        out[key] = name.strip()
    return out


def read_file(path: Path) -> Mapping[str, Any]:
    """A TOML file's tables; a missing, unreadable, non-UTF-8 or invalid file raises ValueError."""
    try:
        with path.open("rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as e:  # a directory, no permission, ...
        raise ConfigError(f"config file {str(path)!r} cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (some Windows editors write one) is not TOML's
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (TOML files must be UTF-8): byte "
            f"{data[e.start:e.start + 1]!r} at offset {e.start} cannot be decoded ({e.reason})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def _check_tables(config: Mapping[str, Any], where: str) -> None:
    for table, value in config.items():
        if table not in SCHEMA:
            hint = did_you_mean(str(table), tuple(SCHEMA))
            if not hint and isinstance(value, Mapping) and set(value) & set(SCHEMA):
                inner = min(set(value) & set(SCHEMA))
                hint = f" (it holds [{inner}]: nested one table too deep? [{inner}] belongs at the top level)"
            raise ConfigError(f"{where}: unknown table {table!r}{hint}; known tables: {', '.join(SCHEMA)} "
                             f"(shape {CONFIG_SHAPE})")
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: {table!r} must be a table shaped {CONFIG_SHAPE}, got "
                             f"{type(value).__name__} {short(value)}")
        for key in value:
            if key not in SCHEMA[table]:
                hint = did_you_mean(str(key), SCHEMA[table])
                if not hint and key in SCHEMA:
                    hint = f" ([{key}] nested inside [{table}]: it belongs at the top level)"
                raise ConfigError(f"{where}: unknown key {key!r} in [{table}]{hint}; known keys: "
                                 f"{', '.join(SCHEMA[table])}")


def load_config(config: ConfigSource) -> Config:
    """``config`` (a mapping, the path of a TOML file, or None) checked against :data:`SCHEMA`; a
    :class:`Config` (already checked) as it is."""
    if isinstance(config, Config):
        return config
    if config is None:
        return Config()
    where = "config"
    if isinstance(config, (str, os.PathLike)):
        if not os.fspath(config).strip():
            raise ConfigError("config file path is empty; give the path of a TOML file")
        path = Path(config)
        config = read_file(path)
        where = f"config file {str(path)!r}"
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"{where} must be a table (a mapping) shaped {CONFIG_SHAPE}, or the path of a TOML file holding one; "
            f"got {type(config).__name__} {short(config)}")
    _check_tables(config, where)
    attention = config.get("attention", {})
    backend = attention.get("backend")
    if isinstance(backend, Mapping):
        backend = check_backend_table(backend, f"{where}: attention.backend")
    elif backend is not None and not isinstance(backend, str):
        raise ConfigError(f"{where}: attention.backend must be a string (a backend name or 'auto') or a table of "
                          f"capability -> backend name, got {short(backend)}")
    pins = check_pins(attention.get("pins", {}), f"{where}: attention.pins")
    prefix_cache = config.get("kv", {}).get("prefix_cache")
    if prefix_cache is not None and not isinstance(prefix_cache, bool):
        raise ConfigError(f"{where}: kv.prefix_cache must be true or false, got {short(prefix_cache)}")
    return Config(backend, pins, prefix_cache)
