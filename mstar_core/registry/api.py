"""The plugin contract's version: what this core implements, and whether a plugin written for
another version can run on it.

A version is ``"MAJOR.MINOR"``. The core implements :data:`API_VERSION`; a ``BackendSpec``
declares the version it was written for (``api_version``). The rule (docs/PLUGINS.md):

- a change a plugin written for the old contract cannot miss bumps MINOR: a new optional
  ``BackendSpec`` field, a new capability, feature or keyword argument a wrapper may accept,
  a new conformance case of behaviour the contract already stated;
- anything that can break such a plugin bumps MAJOR and resets MINOR: a renamed or removed
  field, hook or argument, a changed layout, a new required argument, a behaviour stated
  differently.

A plugin runs when the core implements its MAJOR and its MINOR is not newer than the newest
MINOR of that MAJOR the core implements. A core keeps running every MAJOR it has released
(:data:`IMPLEMENTED`): a 2.0 core runs plugins for 1.0, 1.1 and 2.0, calling each as its version
says (``mstar_core.attention.calls``). An incompatible plugin is listed, with both versions in
the reason, and never imported past its spec or picked.
"""

from __future__ import annotations

import re

from mstar_core.errors import InputError

API_VERSION = "2.0"
# Per MAJOR the core runs, the newest MINOR of it the core implements.
IMPLEMENTED: dict[int, int] = {1: 1, 2: 0}

_FORMAT = re.compile(r"(\d+)\.(\d+)")


def parse_api_version(value: object, who: str = "api_version") -> tuple[int, int]:
    """``"1.2"`` -> ``(1, 2)``; anything else raises, naming the value and the format."""
    match = _FORMAT.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise InputError(f"{who} must be a 'MAJOR.MINOR' string such as {API_VERSION!r} (the plugin contract "
                         f"version the backend was written for), got {value!r}")
    return int(match.group(1)), int(match.group(2))


def incompatibility(declared: str, core: str | None = None) -> str | None:
    """Why a backend written for contract ``declared`` cannot run on a core implementing
    ``core`` (default: :data:`API_VERSION`, with every earlier MAJOR in :data:`IMPLEMENTED`; a
    ``core`` given runs its own MAJOR alone); None when it can."""
    implemented = dict(IMPLEMENTED) if core is None else {}
    core = core or API_VERSION
    (major, minor), (core_major, core_minor) = parse_api_version(declared), parse_api_version(core, "core version")
    implemented[core_major] = core_minor
    if major in implemented and minor <= implemented[major]:
        return None
    if major in implemented or major > core_major:
        fix = "upgrade mstar-core" if major in implemented else "upgrade mstar-core to a release implementing it"
    else:
        fix = "upgrade the plugin to a release written for it"
    runs = ", ".join(f"{m}.0 to {m}.{n}" for m, n in sorted(implemented.items()))
    return (f"written for plugin API {declared}, but this mstar-core implements plugin API {core} "
            f"(compatible: {runs}); {fix}")
