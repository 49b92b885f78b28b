"""The hooks a backend plugin implements. An entry point in the ``mstar.backends`` group names
a module holding ``@hookimpl`` functions for these; that module must import no kernel library
(the import happens in the backend's probe or when a wrapper is built)."""

from __future__ import annotations

from collections.abc import Callable

import pluggy

PROJECT = "mstar"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def mstar_register_backends(register: Callable[..., None]) -> None:
    """Register attention backends: call ``register(BackendSpec(...))`` once per backend."""
