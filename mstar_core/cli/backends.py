"""``mstar backends``: every attention backend this machine can see — distribution and version,
what it provides and which attention features per capability, whether it runs here (or why not),
which one ``auto`` picks per capability -- for plain attention, or for the features asked for with
``--kv-dtype``/``--soft-cap``/``--sink-logits``/``--layer-windows``/``--decode-query-tokens``, with
the reason every other backend was passed over and the features not asked of that capability; where
layers ask different things (per-layer windows or sink logits), each layer group's picks; with
``--config FILE``, what that config's backend choice and pins pick per capability -- and every
plugin that failed to load.
``--json`` prints the same as one JSON object."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from mstar_core.attention.groups import layer_groups, same_picks
from mstar_core.capabilities import FEATURE_REACH, PAGED
from mstar_core.cli.options import add_config, config_from, parse_device, parse_kv_dtype
from mstar_core.config import Config
from mstar_core.errors import InputError
from mstar_core.features import FEATURES, KV_DTYPES, MAX_DECODE_QUERY_TOKENS, PLAIN, AttentionFeatures
from mstar_core.registry import CAPABILITIES, BackendUnavailable, Registry, get_registry, select_backend
from mstar_core.registry.api import API_VERSION
from mstar_core.registry.device import describe, device_arch
from mstar_core.registry.selection import AUTO, ENV_BACKEND, name_for
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
    p.add_argument("--dtype", default=None,
                   help="dtype for the auto picks (default: bfloat16 on a GPU, float32 on cpu)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim for the auto picks (default: 128)")
    # Feature options: one AttentionFeatures for every auto pick. Parsed in run() (strings here) so
    # a bad value is one "mstar backends: error:" line naming it, like every other bad value.
    f = p.add_argument_group("attention features", "judge the auto picks for a model that asks for these")
    f.add_argument("--kv-dtype", default=None, metavar="{" + ",".join(KV_DTYPES) + "}",
                   help="KV cache storage dtype (default: auto, the model dtype; fp8-e4m3 spelling accepted)")
    f.add_argument("--soft-cap", default=None, metavar="FLOAT", help="logit soft-cap, a finite float > 0 (e.g. 30)")
    f.add_argument("--sink-logits", nargs="?", const=True, default=False, metavar="B,B,...",
                   help="learned per-head sink logits (gpt-oss): on every layer, or per layer as a comma-separated "
                        "list of 1/0 (true/false), e.g. 1,0,1,0")
    f.add_argument("--layer-windows", default=None, metavar="W,W,...",
                   help="window_left per layer, comma-separated (-1: a full layer), e.g. 4096,-1; "
                        "write --layer-windows=-1,4096 when the list starts with -1")
    f.add_argument("--decode-query-tokens", default=None, metavar="N",
                   help=f"query tokens per decode row, 1..{MAX_DECODE_QUERY_TOKENS} (2..: speculative verification)")
    add_config(p, shown=True)


# How each feature is asked for on this command line (the legend under the features table).
FEATURE_OPTIONS: dict[str, str] = {
    "fp8_e4m3": "--kv-dtype fp8_e4m3",
    "fp8_e5m2": "--kv-dtype fp8_e5m2",
    "soft_cap": "--soft-cap FLOAT",
    "sink_logits": "--sink-logits [B,B,...]",
    "layer_windows": "--layer-windows W,W,...",
    "multi_token_decode": f"--decode-query-tokens 2..{MAX_DECODE_QUERY_TOKENS}",
}


# Why a requested feature is not asked of a capability (capabilities.FEATURE_REACH), where more
# can be said than which capabilities it does reach.
_DEQUANTISED = "the dense manager dequantises an FP8 cache's prefix: its wrappers read K/V in the model dtype"
NOT_ASKED_WHY: dict[str, dict[str, str]] = {
    "prefixed_ragged": {"fp8_e4m3": _DEQUANTISED, "fp8_e5m2": _DEQUANTISED},
}


def not_asked(capability: str, features: AttentionFeatures) -> dict[str, str]:
    """The requested features that do not reach ``capability``'s wrappers, each with why: auto
    judges no backend on them for it."""
    return {f: NOT_ASKED_WHY.get(capability, {}).get(f, f"it reaches {', '.join(FEATURE_REACH[f])} only")
            for f in features.requested() if capability not in FEATURE_REACH[f]}


def features_from_args(args: argparse.Namespace) -> AttentionFeatures:
    who = getattr(args, "command", None) or "backends"  # errors name the command given (backends, check)
    """The feature options as one :class:`AttentionFeatures`; a bad value is a ValueError naming
    the option, the value, and what is allowed."""
    kv_dtype = "auto"
    if getattr(args, "kv_dtype", None) is not None:
        try:
            kv_dtype = parse_kv_dtype(args.kv_dtype)
        except ValueError:
            raise InputError(f"{who}: --kv-dtype {args.kv_dtype!r} is not supported; choose one of "
                             f"{', '.join(KV_DTYPES)} (fp8-e4m3 / fp8-e5m2 spellings also accepted)") from None
    soft_cap = None
    if getattr(args, "soft_cap", None) is not None:
        try:
            soft_cap = float(args.soft_cap)
        except ValueError:
            soft_cap = math.nan
        if not math.isfinite(soft_cap) or soft_cap <= 0:
            raise InputError(f"{who}: --soft-cap {args.soft_cap!r} must be a finite float > 0 (the logit "
                             "soft-cap, e.g. 30); leave it out for no cap")
    windows = None
    if getattr(args, "layer_windows", None) is not None:
        text = args.layer_windows
        parts = [w.strip() for w in text.split(",")]
        parsed = []
        for i, w in enumerate(parts):
            try:
                value = int(w)
            except ValueError:
                value = None
            if value is None or value < -1:
                raise InputError(f"{who}: --layer-windows {text!r}: entry {i} ({w!r}) must be an int >= 0, or -1 "
                                 "for a full layer (comma-separated, one per layer, e.g. 4096,-1)")
            parsed.append(value)
        windows = tuple(parsed)
    tokens = 1
    if getattr(args, "decode_query_tokens", None) is not None:
        try:
            tokens = int(args.decode_query_tokens)
        except ValueError:
            tokens = 0
        if not 1 <= tokens <= MAX_DECODE_QUERY_TOKENS:
            raise InputError(f"{who}: --decode-query-tokens {args.decode_query_tokens!r} must be an int in "
                             f"1..{MAX_DECODE_QUERY_TOKENS} (query tokens per decode row; 2..{MAX_DECODE_QUERY_TOKENS} "
                             "for speculative verification)")
    sinks = sink_logits_from(getattr(args, "sink_logits", False), who)
    if isinstance(sinks, tuple) and windows is not None and len(sinks) != len(windows):
        raise InputError(f"{who}: --sink-logits names {len(sinks)} layers, --layer-windows {len(windows)}; give "
                         "one entry per layer in each")
    return AttentionFeatures(kv_dtype=kv_dtype, soft_cap=soft_cap, layer_windows=windows, decode_query_tokens=tokens,
                             sink_logits=sinks)


_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def sink_logits_from(value: bool | str, who: str = "backends") -> bool | tuple[bool, ...]:
    """``--sink-logits``: absent (False), bare (True), or one 1/0 (true/false) per layer."""
    if isinstance(value, bool):
        return value
    parts = [p.strip().lower() for p in value.split(",")]
    for i, p in enumerate(parts):
        if p not in _BOOLS:
            raise InputError(f"{who}: --sink-logits {value!r}: entry {i} ({p!r}) must be one of "
                             f"{', '.join(_BOOLS)} (comma-separated, one per layer, e.g. 1,0,1,0)")
    return tuple(_BOOLS[p] for p in parts)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise InputError(f"--dtype {name!r} is not a torch dtype (e.g. float32, bfloat16)")
    return dt


def collect(registry: Registry, device: torch.device, dtype: torch.dtype, head_dim: int,
            features: AttentionFeatures = PLAIN, config: Config | None = None,
            config_file: str | None = None) -> dict[str, Any]:
    """Everything the table shows, as plain data (the ``--json`` output); ``features`` is what
    every auto pick is judged for, and ``config`` (read from ``config_file``) what the config
    section's picks are selected under."""
    backends = []
    listed = [(spec, registry.reasons(spec, device=device)) for spec in registry.backends.values()]
    # A name several distributions register: every claimant, none available until pinned.
    conflicts = registry.conflicts  # built on each read
    listed += [(spec, [registry.conflict_reason(name)]) for name, claims in conflicts.items() for spec in claims]
    for spec, reasons in sorted(listed, key=lambda x: (x[0].name, x[0].distribution or "")):
        name = spec.name
        backends.append({
            "name": name,
            "distribution": spec.distribution,
            "version": spec.version,
            "api_version": spec.api_version,
            "conflict": name in conflicts,
            "provides": list(spec.provides),
            "devices": list(spec.devices),
            "archs": list(spec.archs) if spec.archs is not None else None,
            "min_compute_capability": ("sm{}{}".format(*spec.min_compute_capability)
                                       if spec.min_compute_capability else None),
            "dtypes": [dtype_name(d) for d in spec.dtypes],
            "head_dims": str(spec.head_dims),
            # capability -> its own dtypes / head dims where they differ from the backend's
            "per_capability": {cap: {"dtypes": [dtype_name(d) for d in spec.dtypes_for(cap)],
                                     "head_dims": str(spec.head_dims_for(cap))} for cap in spec.per_capability},
            "kv_layout": spec.kv_layout,
            "capturable": list(spec.capturable),
            # every capability it provides -> the features it supports there ([]: none)
            "features": {cap: list(spec.supports(cap)) for cap in spec.provides},
            "available": not reasons,
            "reasons": reasons,
            "install_hint": spec.install_hint,
            "description": spec.description,
        })
    def select(caps: tuple[str, ...], f: AttentionFeatures = features) -> Any:
        return select_backend(capabilities=caps, requested="auto", device=device, dtype=dtype, head_dim=head_dim,
                              registry=registry, honor_env=False, features=f)

    group, each = select_each(select)
    if isinstance(group, BackendUnavailable):
        paged: dict[str, Any] = {"picks": None, "multi_token_wrapper": None, "error": str(group)}
    else:
        paged = {"picks": group.names, "multi_token_wrapper": group.multi_token_wrapper, "error": None}
    auto: dict[str, dict[str, Any]] = {}
    for cap, sel in each.items():
        if isinstance(sel, BackendUnavailable):
            auto[cap] = {"pick": None, "rejected": sel.reasons, "measured": None}
        elif sel is group:
            auto[cap] = {"pick": group.names[cap], "rejected": dict(group.rejected_by.get(cap, {})),
                         "measured": group.measured.get(cap)}
        else:
            auto[cap] = {"pick": sel.name, "rejected": dict(sel.rejected), "measured": sel.measured.get(cap)}
        # requested features auto did not judge this capability on, and why
        auto[cap]["not_asked"] = not_asked(cap, features)
    group = None if isinstance(group, BackendUnavailable) else group

    def select_configured(caps: tuple[str, ...]) -> Any:
        return select_backend(capabilities=caps, device=device, dtype=dtype, head_dim=head_dim, config=config,
                              registry=registry, honor_env=False, features=features)

    return {
        "config": None if config is None else config_picks(config, config_file, select_configured),
        "layer_groups": group_picks(select, features, group),
        "device": describe(device),
        "arch": device_arch(device),
        "dtype": dtype_name(dtype),
        "head_dim": head_dim,
        # what the auto picks were judged for: feature names (FEATURES), and in words
        "features_requested": list(features.requested()),
        "features_description": str(features),
        "known_features": dict(FEATURES),
        "torch": torch.__version__,
        "plugin_api": API_VERSION,
        "backends": backends,
        "auto": auto,
        "paged": paged,
        "plugins": [{"entry_point": p.entry_point, "distribution": p.distribution, "version": p.version,
                     "backends": list(p.backends)} for p in registry.plugins],
        "failed_plugins": [{"entry_point": f.entry_point, "distribution": f.distribution, "version": f.version,
                            "stage": f.stage, "error": f.error, "backends": list(f.backends), "outcome": f.outcome}
                           for f in registry.failures],
        "allowlist": sorted(registry.allowlist) if registry.allowlist is not None else None,
        # what every selection gets instead of its configured name (auto's picks above are what
        # it would choose without the override)
        "env_override": os.environ.get(ENV_BACKEND, "").strip() or None,
    }


def select_each(select: Any) -> tuple[Any, dict[str, Any]]:
    """``select(capabilities)`` for every capability, in the capability table's order: the paged
    ones from the paged group's selection, as the paged manager takes them (where multi-token
    decode rows run depends on the picks together), each alone where the group cannot be built
    (so each says its own reason), the others alone. Returns the group's selection and each
    capability's, a selection that failed as its :class:`BackendUnavailable`."""
    def attempt(caps: tuple[str, ...]) -> Any:
        try:
            return select(caps)
        except BackendUnavailable as e:
            return e

    group = attempt(PAGED)
    failed = isinstance(group, BackendUnavailable)
    return group, {cap: group if cap in PAGED and not failed else attempt((cap,)) for cap in CAPABILITIES}


def config_picks(config: Config, file: str | None, select: Any) -> dict[str, Any]:
    """What ``config`` asks (its backend choice, pins and prefix cache) and picks per capability
    (``select(capabilities)`` selects under it, as :func:`select_each` walks them); where a
    selection fails, its error."""
    choice = config.backend if config.backend is not None else AUTO
    group, each = select_each(select)
    picks = {cap: {"pick": None, "error": str(sel)} if isinstance(sel, BackendUnavailable) else
             {"pick": sel.names[cap] if sel is group else sel.name, "error": None} for cap, sel in each.items()}
    return {
        "file": file,
        "backend": config.backend if isinstance(config.backend, str | None) else dict(config.backend),
        "pins": dict(config.pins),
        "prefix_cache": config.prefix_cache,
        # capability -> the name the config gives it ("auto" where it names none), then what that picks
        "picks": {cap: {"asks": name_for(choice, cap), **picks[cap]} for cap in CAPABILITIES},
    }


def _config_lines(data: dict[str, Any], env: str | None) -> list[str]:
    backend = data["backend"]
    asked = ("not set (auto)" if backend is None else repr(backend) if isinstance(backend, str) else
             "{" + ", ".join(f"{k} = {v!r}" for k, v in backend.items()) + "}")
    pins = ", ".join(f"{n} = {d}" for n, d in data["pins"].items()) or "none"
    cache = "not set (off)" if data["prefix_cache"] is None else str(data["prefix_cache"]).lower()
    where = f"config {data['file']!r}" if data["file"] is not None else "config"
    lines = [f"{where}: attention.backend = {asked}; attention.pins: {pins}; kv.prefix_cache = {cache}",
             "picks under this config" + (f" ({ENV_BACKEND}={env} overrides its backend: below)" if env else "") + ":"]
    said: dict[str, str] = {}  # an error with its capability's name taken out -> the first capability it was given for
    for cap, p in data["picks"].items():
        if p["pick"] is not None:
            lines.append(f"  {cap:<16} {p['pick']} ({'auto' if p['asks'] == AUTO else 'named'})")
            continue
        first = said.setdefault(p["error"].replace(cap, "*"), cap)
        lines.append(f"  {cap:<16} (none: {p['error'] if first == cap else f'as for {first}'})")
    return lines


def group_picks(select: Any, features: AttentionFeatures, whole: Any) -> dict[str, Any] | None:
    """Each layer group's paged picks (``select(capabilities, features)``), and whether one
    manager serves every layer (``whole``: the whole model's selection, None where it failed);
    None where the layers form one group."""
    n = features.per_layer_count()
    groups = () if n is None else layer_groups(features, n)
    if len(groups) <= 1:
        return None
    out, sels = [], []
    for g in groups:
        entry: dict[str, Any] = {"layers": list(g.layers), "window": g.window, "sink_logits": g.sink_logits,
                                 "describe": g.describe(), "asks": list(g.features.requested())}
        try:
            sel = select(PAGED, g.features)
            entry.update(picks=sel.names, multi_token_wrapper=sel.multi_token_wrapper, error=None,
                         rejected={cap: dict(sel.rejected_by.get(cap, {})) for cap in PAGED})
        except BackendUnavailable as e:
            sel = None
            entry.update(picks=None, multi_token_wrapper=None, error=str(e), rejected={})
        sels.append(sel)
        out.append(entry)
    one = whole is not None and all(s is not None and same_picks(s, whole) for s in sels)
    return {"one_manager": one, "groups": out}


def _group_lines(data: dict[str, Any]) -> list[str]:
    lines = ["layer groups (layers that ask the same; each group's paged capabilities from its own picks):"]
    for g in data["groups"]:
        lines.append(f"  {g['describe']}, asks {', '.join(g['asks']) or 'plain attention'}:")
        if g["picks"] is None:
            lines.append(f"    (none: {g['error']})")
            continue
        for cap, name in g["picks"].items():
            lines.append(f"    {cap:<16} {name}")
            for n, rs in g["rejected"][cap].items():
                lines.append(f"    {'':<16}   passed over {n}: {'; '.join(rs)}")
        if g["multi_token_wrapper"]:
            lines.append(f"    multi-token decode rows run on the {g['multi_token_wrapper']} wrapper")
    if data["one_manager"]:
        lines.append("the paged manager is one for every layer: every group's picks are the whole model's")
    elif all(g["picks"] is not None for g in data["groups"]):
        lines.append("the paged manager is one per layer group (GroupedPagedAttentionManager), each on its picks")
    else:
        lines.append("the paged manager cannot be built here: a layer group has no backend")
    return lines


def _feature_lines(data: dict[str, Any]) -> list[str]:
    """Per backend, the features of each capability it provides (capabilities with the same
    features share a line), then the known features and the option that asks for each."""
    lines = ["features per capability:"]
    width = max((len(b["name"]) for b in data["backends"]), default=0)
    for b in data["backends"]:
        groups: dict[tuple[str, ...], list[str]] = {}
        for cap, names in b["features"].items():
            groups.setdefault(tuple(names), []).append(cap)
        for i, (names, caps) in enumerate(groups.items()):
            label = b["name"] if i == 0 else ""
            lines.append(f"  {label:<{width}}  {', '.join(caps)}: {', '.join(names) or 'none'}")
    known = data["known_features"]
    rows = [(name, FEATURE_OPTIONS.get(name, ""), desc) for name, desc in known.items()]
    w0, w1 = (max((len(r[i]) for r in rows), default=0) for i in (0, 1))
    lines += ["", "known features (feature, the option that asks for it, what it is):"]
    lines += [f"  {n:<{w0}}  {o:<{w1}}  {d}" for n, o, d in rows]
    return lines


def render(data: dict[str, Any]) -> str:
    judged = f"dtype {data['dtype']}, head_dim {data['head_dim']}"
    if data["features_description"] != str(PLAIN):
        judged += f", features: {data['features_description']}"
    lines = [f"attention backends on {data['device']} (torch {data['torch']}, plugin API {data['plugin_api']}; auto "
             f"judged for {judged})", ""]
    rows = [("backend", "distribution", "provides", "dtypes", "head dims", "status")]
    for b in data["backends"]:
        status = "available" if b["available"] else "unavailable: " + "; ".join(b["reasons"])
        own = b["per_capability"]  # a capability's own declaration, after the backend's
        dtypes = "; ".join([", ".join(b["dtypes"])] + [f"{c}: {', '.join(o['dtypes'])}" for c, o in own.items()
                                                       if o["dtypes"] != b["dtypes"]])
        dims = "; ".join([b["head_dims"]] + [f"{c}: {o['head_dims']}" for c, o in own.items()
                                             if o["head_dims"] != b["head_dims"]])
        rows.append((b["name"], f"{b['distribution']} {b['version']}", ", ".join(b["provides"]), dtypes, dims,
                     status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:  # the last column (status) is not padded: widths stop one short
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    lines += ["", *_feature_lines(data)]
    asked = data["features_requested"]
    lines += ["", f"auto picks (for features {', '.join(asked)}):" if asked else "auto picks:"]
    for cap, a in data["auto"].items():
        lines.append(f"  {cap:<16} {a['pick'] or '(none: no backend can run it here)'}")
        for f, why in a["not_asked"].items():
            lines.append(f"  {'':<16}   {f} is not asked of {cap}: {why}")
        for n, rs in a["rejected"].items():
            lines.append(f"  {'':<16}   passed over {n}: {'; '.join(rs)}")
        if a.get("measured"):
            lines.append(f"  {'':<16}   ordered by measured kernel times: {a['measured']}")
    paged = data["paged"]
    groups = data["layer_groups"]
    if groups is not None:
        lines += ["", *_group_lines(groups)]
    elif paged["picks"] is not None:
        picks = paged["picks"]
        one = len(set(picks.values())) == 1
        lines += ["", "the paged manager takes " + (f"every paged capability from {next(iter(picks.values()))}" if one
                                                    else ", ".join(f"{c} from {n}" for c, n in picks.items()))
                  + " (each capability from its own pick, over mstar's KV layout)"]
        if paged["multi_token_wrapper"]:
            lines.append(f"  multi-token decode rows run on the {paged['multi_token_wrapper']} wrapper of "
                         f"{picks[paged['multi_token_wrapper']]}")
    else:
        lines += ["", f"the paged manager cannot be built here: {paged['error']}"]
    if data["config"] is not None:
        lines += ["", *_config_lines(data["config"], data["env_override"])]
    if data["env_override"]:
        lines += ["", f"{ENV_BACKEND}={data['env_override']}: every selection uses it, overriding config and "
                      "the name code gives (select_backend(requested=), a manager spec's \"backend\", --backend)"]
    if data["allowlist"] is not None:
        lines += ["", f"MSTAR_PLUGINS allowlist: {', '.join(data['allowlist']) or '(empty: built-ins only)'}"]
    if data["failed_plugins"]:
        lines += ["", "plugins that failed to load:"]
        for f in data["failed_plugins"]:
            meant = f", meant to register {', '.join(f['backends'])}" if f["backends"] else ""
            lines.append(f"  {f['entry_point']} ({f['distribution']} {f['version']}{meant}) at {f['stage']}: "
                         f"{f['error']}; {f['outcome']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.head_dim < 1:
        raise InputError(f"backends: --head-dim {args.head_dim} must be >= 1 "
                         "(the head dim auto's picks are judged for)")
    features = features_from_args(args)
    device = parse_device(args.device, "backends") if args.device is not None else _default_device()
    config = config_from(args)
    data = collect(get_registry(), device, _dtype(args.dtype, device), args.head_dim, features, config, args.config)
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone: ``python -m mstar_core.cli.backends [--json]``."""
    p = argparse.ArgumentParser(prog="mstar backends", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
