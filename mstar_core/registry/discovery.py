"""Finding plugins: the ``mstar.backends`` entry points, filtered by ``MSTAR_PLUGINS``, each
loaded in isolation so one broken install never hides the others (pluggy's own
``load_setuptools_entrypoints`` stops at the first failure)."""

from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass

GROUP = "mstar.backends"
ENV_ALLOWLIST = "MSTAR_PLUGINS"
ENV_STRICT = "MSTAR_STRICT_PLUGINS"

# Entry points that ship with mstar-core. They load even when MSTAR_PLUGINS leaves them out
# (so an allowlist never leaves the engine without a backend), and are added by hand when the
# core runs from a source tree that has no installed metadata.
BUILTIN: dict[str, str] = {"reference": "mstar_core.backends.reference.plugin"}
CORE_DISTRIBUTION = "mstar-core"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that failed: at ``stage`` "load" (importing its module or checking its hooks),
    "register" (its hook raised, or it has none), or "duplicate" (a backend name taken first)."""

    entry_point: str
    distribution: str
    version: str
    stage: str
    error: str

    def __str__(self) -> str:
        return f"plugin {self.entry_point!r} ({self.distribution} {self.version}) failed at {self.stage}: {self.error}"


@dataclass(frozen=True)
class LoadedPlugin:
    entry_point: str
    distribution: str
    version: str
    module: str
    backends: tuple[str, ...]


class PluginError(RuntimeError):
    """Raised in strict mode for a failure that is not itself an exception (a duplicate name)."""


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
    raise ValueError(
        f"{name}={raw!r} is not a boolean: use one of {', '.join(TRUE_VALUES)} (on) or "
        f"{', '.join(v for v in FALSE_VALUES if v)} or empty (off), in any case")


def strict_from_env() -> bool:
    return env_flag(ENV_STRICT)


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
