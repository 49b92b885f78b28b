"""The backend registry: plugins register attention backends through the ``mstar.backends``
entry points; selection picks one by name or by probing, and says why it passed over the rest.

    from mstar_core.registry import get_registry, select_backend
    sel = select_backend(capabilities=("paged_decode",), device=torch.device("cuda"),
                         dtype=torch.bfloat16, head_dim=128)
    sel.name, sel.classes["paged_decode"], sel.rejected
"""

from mstar_core.errors import PluginError
from mstar_core.registry.discovery import GROUP, LoadedPlugin, PluginFailure
from mstar_core.registry.hookspecs import hookimpl, hookspec
from mstar_core.registry.registry import Registry, get_registry, reset_registry
from mstar_core.registry.selection import (
    ENV_BACKEND,
    BackendUnavailable,
    Selection,
    auto_order,
    config_backend,
    resolve_requested,
    select_backend,
)
from mstar_core.registry.spec import CAPABILITIES, DEVICE_KINDS, BackendSpec, CapabilitySpec, HeadDims

__all__ = [
    "CAPABILITIES",
    "DEVICE_KINDS",
    "ENV_BACKEND",
    "GROUP",
    "BackendSpec",
    "BackendUnavailable",
    "CapabilitySpec",
    "HeadDims",
    "LoadedPlugin",
    "PluginError",
    "PluginFailure",
    "Registry",
    "Selection",
    "auto_order",
    "config_backend",
    "get_registry",
    "hookimpl",
    "hookspec",
    "reset_registry",
    "resolve_requested",
    "select_backend",
]
