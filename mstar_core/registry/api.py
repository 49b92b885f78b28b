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

A plugin runs when its MAJOR equals the core's and its MINOR is not newer (a plugin for 1.0
runs on a 1.3 core; one for 1.4 needs a newer core, one for 2.0 or 0.x a different one). An
incompatible plugin is listed, with both versions in the reason, and never imported past its
spec or picked.
"""

from __future__ import annotations

import re

from mstar_core.errors import InputError

API_VERSION = "1.1"

_FORMAT = re.compile(r"(\d+)\.(\d+)")


def parse_api_version(value: object, who: str = "api_version") -> tuple[int, int]:
    """``"1.2"`` -> ``(1, 2)``; anything else raises, naming the value and the format."""
    match = _FORMAT.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise InputError(f"{who} must be a 'MAJOR.MINOR' string such as {API_VERSION!r} (the plugin contract "
                         f"version the backend was written for), got {value!r}")
    return int(match.group(1)), int(match.group(2))


def api_reasons(declared: str, core: str | None = None) -> list[str]:
    """Why a backend written for contract ``declared`` cannot run on a core implementing
    ``core`` (default: :data:`API_VERSION`); empty when it can."""
    core = core or API_VERSION
    (major, minor), (core_major, core_minor) = parse_api_version(declared), parse_api_version(core, "core version")
    if major == core_major and minor <= core_minor:
        return []
    if major == core_major:
        fix = "upgrade mstar-core"
    elif major > core_major:
        fix = "upgrade mstar-core to a release implementing it"
    else:
        fix = "upgrade the plugin to a release written for it"
    return [(f"written for plugin API {declared}, but this mstar-core implements plugin API {core} "
             f"(compatible: {core_major}.0 to {core}); {fix}")]
