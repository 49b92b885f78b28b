"""Small helpers for backend probes: is a library importable (without importing it), and is
its installed version new enough. Each returns reasons, empty when fine."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import re
import sys
from collections.abc import Sequence


def module_missing(module: str, install: str) -> list[str]:
    """``[reason]`` when ``module`` cannot be found; ``find_spec`` does not execute it."""
    try:
        found = module in sys.modules or importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as e:  # a parent package that fails, or a broken __spec__
        return [f"{module} cannot be located ({type(e).__name__}: {e}); install {install}"]
    return [] if found else [f"{module} is not installed (install {install})"]


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: "0.5.3.post1" -> (0, 5, 3)."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def installed_version(distributions: Sequence[str]) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``distributions`` that is installed."""
    for dist in distributions:
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def version_too_old(distributions: Sequence[str], minimum: str, module: str) -> list[str]:
    """``[reason]`` when the installed version is below ``minimum``. Falls back to the imported
    module's ``__version__`` where no distribution metadata exists (a source checkout)."""
    found = installed_version(distributions)
    if found is None:
        try:
            version = str(getattr(importlib.import_module(module), "__version__", ""))
        except Exception as e:  # the library is present but broken: that is a reason too
            return [f"{module} failed to import ({type(e).__name__}: {e})"]
        if not version:
            return [f"{module} has no version metadata; {minimum} or newer is required"]
        found = (module, version)
    dist, version = found
    if version_tuple(version) < version_tuple(minimum):
        return [f"{dist} {version} is too old ({minimum} or newer is required)"]
    return []
