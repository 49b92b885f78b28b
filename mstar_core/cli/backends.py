"""``mstar backends``: every attention backend this machine can see — distribution and version,
what it provides, whether it runs here (or why not), which one ``auto`` picks per capability —
and every plugin that failed to load. ``--json`` prints the same as one JSON object."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from mstar_core.registry import CAPABILITIES, BackendUnavailable, Registry, get_registry, select_backend
from mstar_core.registry.device import as_device, describe, device_arch
from mstar_core.registry.selection import ENV_BACKEND
from mstar_core.registry.spec import dtype_name


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("backends", help="list attention backends and why each can or cannot run here",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--device", default=None, help="device to judge (default: cuda if usable, else cpu)")
    p.add_argument("--dtype", default=None, help="dtype for the auto picks (default: bfloat16 on a GPU, float32 on cpu)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim for the auto picks (default: 128)")


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"--dtype {name!r} is not a torch dtype (e.g. float32, bfloat16)")
    return dt


def collect(registry: Registry, device: torch.device, dtype: torch.dtype, head_dim: int) -> dict[str, Any]:
    """Everything the table shows, as plain data (the ``--json`` output)."""
    backends = []
    for name, spec in registry.backends.items():
        reasons = registry.device_reasons(name, device)
        backends.append({
            "name": name,
            "distribution": spec.distribution,
            "version": spec.version,
            "provides": list(spec.provides),
            "devices": list(spec.devices),
            "archs": list(spec.archs) if spec.archs is not None else None,
            "min_compute_capability": "sm{}{}".format(*spec.min_compute_capability) if spec.min_compute_capability else None,
            "dtypes": [dtype_name(d) for d in spec.dtypes],
            "head_dims": str(spec.head_dims),
            "capturable": list(spec.capturable),
            "available": not reasons,
            "reasons": reasons,
            "install_hint": spec.install_hint,
            "description": spec.description,
        })
    auto = {}
    for cap in CAPABILITIES:
        try:
            sel = select_backend(capabilities=(cap,), requested="auto", device=device, dtype=dtype,
                                 head_dim=head_dim, registry=registry, honor_env=False)
            auto[cap] = {"pick": sel.name, "rejected": dict(sel.rejected)}
        except BackendUnavailable as e:
            auto[cap] = {"pick": None, "rejected": e.reasons}
    return {
        "device": describe(device),
        "arch": device_arch(device),
        "dtype": dtype_name(dtype),
        "head_dim": head_dim,
        "torch": torch.__version__,
        "backends": backends,
        "auto": auto,
        "plugins": [{"entry_point": p.entry_point, "distribution": p.distribution, "version": p.version,
                     "backends": list(p.backends)} for p in registry.plugins],
        "failed_plugins": [{"entry_point": f.entry_point, "distribution": f.distribution, "version": f.version,
                            "stage": f.stage, "error": f.error} for f in registry.failures],
        "allowlist": sorted(registry.allowlist) if registry.allowlist is not None else None,
        # what every selection gets instead of its configured name (auto's picks above are what
        # it would choose without the override)
        "env_override": os.environ.get(ENV_BACKEND, "").strip() or None,
    }


def render(data: dict[str, Any]) -> str:
    lines = [f"attention backends on {data['device']} (torch {data['torch']}; auto judged for dtype "
             f"{data['dtype']}, head_dim {data['head_dim']})", ""]
    rows = [("backend", "distribution", "provides", "dtypes", "head dims", "status")]
    for b in data["backends"]:
        status = "available" if b["available"] else "unavailable: " + "; ".join(b["reasons"])
        rows.append((b["name"], f"{b['distribution']} {b['version']}", ", ".join(b["provides"]),
                     ", ".join(b["dtypes"]), b["head_dims"], status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    lines += ["", "auto picks:"]
    for cap, a in data["auto"].items():
        lines.append(f"  {cap:<16} {a['pick'] or '(none: no backend can run it here)'}")
        for n, rs in a["rejected"].items():
            lines.append(f"  {'':<16}   passed over {n}: {'; '.join(rs)}")
    if data["env_override"]:
        lines += ["", f"{ENV_BACKEND}={data['env_override']}: every selection uses it, overriding config and "
                      "constructor arguments"]
    if data["allowlist"] is not None:
        lines += ["", f"MSTAR_PLUGINS allowlist: {', '.join(data['allowlist']) or '(empty: built-ins only)'}"]
    if data["failed_plugins"]:
        lines += ["", "plugins that failed to load:"]
        for f in data["failed_plugins"]:
            lines.append(f"  {f['entry_point']} ({f['distribution']} {f['version']}) at {f['stage']}: {f['error']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.head_dim < 1:
        raise ValueError(f"backends: --head-dim {args.head_dim} must be >= 1 (the head dim auto's picks are judged for)")
    device = as_device(args.device) if args.device else _default_device()
    data = collect(get_registry(), device, _dtype(args.dtype, device), args.head_dim)
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone: ``python -m mstar_core.cli.backends [--json]``."""
    p = argparse.ArgumentParser(prog="mstar backends", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
