"""Can FlashInfer run here: is ``flashinfer`` installed, and is it at least the oldest release
verified with this plugin. The device and architecture come from the backend's declared data
(checked by the registry). A release newer than the newest verified one is not refused -- the
version guards (compat.py) detect the differences they know -- but the log says it is unverified.

No tiny call: FlashInfer JIT-compiles each kernel on first use (20-120 s per module on an H200),
far too slow for a probe that every ``mstar backends`` and every ``auto`` runs. A broken
install shows when the wrapper is built instead.
"""

from __future__ import annotations

import logging

import torch

from mstar_core.plugin import installed_version, module_missing, version_too_old, version_tuple
from mstar_flashinfer.compat import VERIFIED

log = logging.getLogger("mstar.flashinfer")

MODULE = "flashinfer"
DISTRIBUTIONS = ("flashinfer-python", "flashinfer")
MIN_VERSION, NEWEST_VERIFIED = VERIFIED[0], VERIFIED[-1]
# the range plugins/flashinfer/pyproject.toml declares (tests/registry/test_wheels.py keeps them equal)
INSTALL = f"flashinfer-python>={MIN_VERSION},<={NEWEST_VERIFIED}"


def newer_than_verified(version: str) -> bool:
    """Is ``version`` past the newest verified release (post-releases count: 0.7.2.post2 is)?"""
    try:
        from packaging.version import Version  # flashinfer-python requires packaging

        return Version(version) > Version(NEWEST_VERIFIED)
    except Exception:  # no packaging, or a version string it cannot read: compare the release numbers
        return version_tuple(version) > version_tuple(NEWEST_VERIFIED)


def probe(device: torch.device) -> list[str]:
    """Reasons FlashInfer cannot run on ``device`` beyond the declared ones; empty if it can."""
    reasons = module_missing(MODULE, INSTALL) or version_too_old(DISTRIBUTIONS, MIN_VERSION, MODULE)
    found = None if reasons else installed_version(DISTRIBUTIONS)
    if found is not None and newer_than_verified(found[1]):
        log.warning("%s %s is newer than the newest release verified with mstar-flashinfer (%s; verified: %s); "
                    "it runs, with the differences mstar_flashinfer/compat.py detects", found[0], found[1],
                    NEWEST_VERIFIED, ", ".join(VERIFIED))
    return reasons
