"""Finding plugins: the ``mstar.backends`` entry points, filtered by ``MSTAR_PLUGINS``, each
loaded in isolation so one broken install never hides the others (pluggy's own
``load_setuptools_entrypoints`` stops at the first failure)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mstar_core.config import check_pins
from mstar_core.errors import InputError

GROUP = "mstar.backends"
ENV_ALLOWLIST = "MSTAR_PLUGINS"
ENV_STRICT = "MSTAR_STRICT_PLUGINS"
ENV_PINS = "MSTAR_BACKEND_PINS"

# Entry points that ship with mstar-core. They load even when MSTAR_PLUGINS leaves them out
# (so an allowlist never leaves the engine without a backend), and are added by hand when the
# core runs from a source tree that has no installed metadata.
BUILTIN: dict[str, str] = {"reference": "mstar_core.backends.reference.plugin"}
CORE_DISTRIBUTION = "mstar-core"
# Backend names only the core may register: a plugin claiming one is refused (a conflict over
# the reference would leave auto without its fallback).
RESERVED: dict[str, str] = {name: CORE_DISTRIBUTION for name in BUILTIN}
# The plugin distributions that ship in mstar's repository (plugins/), by the backend each
# registers, and the line that installs it from a clone (as the README's Backends section says).
FIRST_PARTY: dict[str, tuple[str, str]] = {
    "flashinfer": ("mstar-flashinfer", "pip install ./plugins/flashinfer"),
    "fa3": ("mstar-fa3", 'pip install "./plugins/fa3[tokenspeed]"'),
    "rocm": ("mstar-rocm", "pip install ./plugins/rocm"),
}


def install_hint(name: str) -> str | None:
    """How to install the first-party plugin that registers backend ``name``; None for any other."""
    if name not in FIRST_PARTY:
        return None
    dist, line = FIRST_PARTY[name]
    return f"it is the {dist} plugin's backend: install it with `{line}` in a clone of mstar"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that failed: at ``stage`` "load" (importing its module), "register" (its hook
    raised, it has none, or what it registers cannot be kept) or "provides" (strict mode: a
    wrapper reference that does not import). ``backends``: the names it meant to register, as
    far as they are known (see :func:`intended_backends`)."""

    entry_point: str
    distribution: str
    version: str
    stage: str
    error: str
    backends: tuple[str, ...] = ()

    @property
    def outcome(self) -> str:
        """What the failure cost: a plugin that failed at load or register keeps nothing (one
        malformed ``BackendSpec`` -- a bad ``api_version``, say -- drops every backend of it);
        one that failed at provides keeps its backend, refused for those capabilities."""
        if self.stage in WHOLE_PLUGIN_STAGES:
            return "none of its backends is registered"
        return "the backend stays registered, refused for the capabilities whose wrappers do not import"

    def __str__(self) -> str:
        meant = f", meant to register {', '.join(map(repr, self.backends))}" if self.backends else ""
        return (f"plugin {self.entry_point!r} ({self.distribution} {self.version}{meant}) failed at {self.stage}: "
                f"{self.error}; {self.outcome}")


# The stages at which a plugin fails whole: nothing it registers is kept.
WHOLE_PLUGIN_STAGES: tuple[str, ...] = ("load", "register")


@dataclass(frozen=True)
class LoadedPlugin:
    entry_point: str
    distribution: str
    version: str
    module: str
    backends: tuple[str, ...]


# The values a boolean environment variable may take (case-insensitive; unset or empty is off).
TRUE_VALUES: tuple[str, ...] = ("1", "true", "yes", "on")
FALSE_VALUES: tuple[str, ...] = ("0", "false", "no", "off", "")


def env_flag(name: str) -> bool:
    """A boolean environment variable: one of ``TRUE_VALUES`` / ``FALSE_VALUES`` in any case,
    surrounding blanks ignored. Anything else raises: a typo (``MSTAR_STRICT_PLUGINS=ture``)
    silently read as off is the one mistake a user cannot see."""
    raw = os.environ.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise InputError(
        f"{name}={raw!r} is not a boolean: use one of {', '.join(TRUE_VALUES)} (on) or "
        f"{', '.join(v for v in FALSE_VALUES if v)} or empty (off), in any case")


def strict_from_env() -> bool:
    return env_flag(ENV_STRICT)


def pins_from_env() -> dict[str, str]:
    """``MSTAR_BACKEND_PINS=name=distribution[,name=distribution...]``; unset or empty: none."""
    raw = os.environ.get(ENV_PINS, "")
    pins: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        name, sep, dist = (x.strip() for x in part.partition("="))
        if not sep:
            raise InputError(f"{ENV_PINS}={raw!r}: {part!r} is not NAME=DISTRIBUTION (e.g. "
                             f"{ENV_PINS}=fast=fast-kernels,other=other-dist)")
        if name in pins and pins[name] != dist:
            raise InputError(f"{ENV_PINS}={raw!r}: backend {name!r} is pinned twice, to {pins[name]!r} and to "
                             f"{dist!r}; pin each name once")
        pins[name] = dist
    return check_pins(pins, f"{ENV_PINS}={raw!r}")


def _source_of(module: str) -> Path | None:
    """The ``.py`` file of ``module`` on ``sys.path``, found without importing it or its parent
    packages (``importlib.util.find_spec`` would run their ``__init__``)."""
    parts = module.split(".")
    for entry in sys.path:
        base = Path(entry or ".").joinpath(*parts)
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
    return None


def intended_backends(module: str) -> tuple[str, ...]:
    """The backend names a plugin module's source passes to ``BackendSpec(name=...)`` (or as
    its first argument), read without executing any of it: what a plugin that failed to load
    or register meant to provide, so selecting such a name can say that plugin failed."""
    try:
        path = _source_of(module)
        if path is None:
            return ()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):  # best effort: no names is the answer
        return ()
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)) != "BackendSpec":
            continue
        values = [k.value for k in node.keywords if k.arg == "name"] + node.args[:1]
        names += [v.value for v in values[:1] if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return tuple(dict.fromkeys(names))


def allowlist_from_env() -> frozenset[str] | None:
    """None when MSTAR_PLUGINS is unset (load all); an empty set when it is set but empty."""
    raw = os.environ.get(ENV_ALLOWLIST)
    if raw is None:
        return None
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def is_builtin(ep: md.EntryPoint) -> bool:
    return BUILTIN.get(ep.name) == ep.value


def distribution_of(ep: md.EntryPoint) -> tuple[str, str]:
    """(name, version) of the distribution declaring ``ep``; "?" where unknown."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        if is_builtin(ep):
            from mstar_core import __version__

            return CORE_DISTRIBUTION, __version__
        return "?", "?"
    name = getattr(dist, "name", None) or (dist.metadata["Name"] if hasattr(dist, "metadata") else None) or "?"
    return str(name), str(getattr(dist, "version", None) or "?")


def entry_points() -> list[md.EntryPoint]:
    """Every entry point of the group, plus the built-in ones the metadata lacks. Read through
    ``importlib.metadata.entry_points`` at call time so tests can monkeypatch it."""
    eps = list(md.entry_points(group=GROUP))
    values = {ep.value for ep in eps}
    for name, value in BUILTIN.items():
        if value not in values:
            eps.insert(0, md.EntryPoint(name=name, value=value, group=GROUP))
    # A distribution installed twice (e.g. editable and a --target copy) lists its entry point
    # twice; keep the first of each (name, value) pair.
    seen: set[tuple[str, str]] = set()
    unique = []
    for ep in eps:
        if (ep.name, ep.value) not in seen:
            seen.add((ep.name, ep.value))
            unique.append(ep)
    return unique
