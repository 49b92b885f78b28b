"""``mstar check``: the conformance suite against one installed backend, as the registry sees
it -- every capability it provides, in every dtype and (up to two) head dims it declares, with
the features it declares -- plus the checks a fresh-wrapper-per-case suite cannot make: shapes
past a kernel's usual tiles, one wrapper re-planned with different shapes (and refusing a plan
without losing the previous one), several wrappers planned with different windows and scales
and run in turn (one per layer), replay from a CUDA graph where it is capturable, rows
poisoned with NaN/inf that no other row may notice, and rows that see no key. Every case runs
twice (bit-identical outputs), on strided inputs too, with every input compared before and
after; each failure names its rule (:data:`mstar_core.testing.rules.RULES`).

From Python::

    report = check_backend("mykernel", device="cuda")
    assert report.ok, report.render()

From a plugin's own test suite, in one line (one pytest test per case)::

    from mstar_core.testing.check import conformance_test
    test_conformance = conformance_test("mykernel")
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_core.capabilities import STEP_KINDS
from mstar_core.errors import InputError
from mstar_core.registry.spec import BackendSpec, dtype_name
from mstar_core.testing import conformance as C
from mstar_core.testing import reuse
from mstar_core.testing.groups import GROUPS
from mstar_core.testing.rules import RuleError

NOT_COVERED: dict[str, str] = {
    "bounded": "the bounded kernel has no wrapper protocol yet: tests/kv/bounded and tests/kernels check the "
               "built-in one",
}
HEAD_DIM_CANDIDATES = (64, 128, 256, 96, 80, 32, 192, 16, 8)
# The head dims every backend is checked at where it declares them (and the largest it declares).
COMMON_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class Check:
    """One case of the suite: ``run()`` returns the relative error or raises."""

    capability: str
    group: str  # a key of GROUPS
    dtype: torch.dtype
    name: str
    run: Callable[[], float] = field(repr=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.capability}-{dtype_name(self.dtype)}-{self.group}-{self.name}"


@dataclass(frozen=True)
class Result:
    capability: str
    group: str
    dtype: str
    name: str
    passed: bool
    error: float | None  # relative error vs the float64 oracle (None: it raised)
    message: str = ""
    seconds: float = 0.0
    refused: bool = False  # passed by refusing a plan the contract lets it refuse (see conformance.Refused)
    rule: str | None = None  # the rule a failure broke (a key of rules.RULES)


@dataclass
class Report:
    """What ``mstar check`` prints (``render``) or dumps (``as_json``)."""

    backend: str
    label: str
    api_version: str
    device: str
    results: list[Result]
    not_covered: dict[str, str]
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if not r.passed]

    @property
    def ok(self) -> bool:
        return bool(self.results) and not self.failed

    def render(self, all_rows: bool = True) -> str:
        rows = [("capability", "dtype", "group", "case", "result", "rel. error")]
        for r in self.results:
            if all_rows or not r.passed:
                err = f"{r.error:.2e}" if r.error is not None else "-"
                result = ("refused" if r.refused else "pass") if r.passed else f"FAIL {r.rule or ''}".rstrip()
                rows.append((r.capability, r.dtype, r.group, r.name, result, err))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [f"mstar check {self.backend} ({self.label}, plugin API {self.api_version}) on {self.device}", ""]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        for r in self.failed:
            rule = f" [{r.rule}]" if r.rule else ""
            lines += ["", f"FAIL {r.capability} {r.dtype} {r.group} {r.name}{rule}:", f"  {r.message}"]
        for cap, why in self.not_covered.items():
            lines += ["", f"not covered: {cap}: {why}"]
        for note in self.notes:
            lines += ["", f"note: {note}"]
        n, bad = len(self.results), len(self.failed)
        refused = sum(r.refused for r in self.results)
        note = f" ({refused} by refusing rows with fewer keys than queries, as the contract allows)" if refused else ""
        broken: dict[str, int] = {}
        for r in self.failed:
            broken[r.rule or "?"] = broken.get(r.rule or "?", 0) + 1
        rules = ", ".join(f"{k} ({v})" for k, v in sorted(broken.items()))
        lines += ["", f"{n - bad} of {n} cases passed{note}" + (f"; {bad} failed, by rule: {rules}" if bad else "")]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "label": self.label, "api_version": self.api_version, "device": self.device,
                "ok": self.ok, "passed": len(self.results) - len(self.failed), "failed": len(self.failed),
                "not_covered": self.not_covered, "notes": self.notes,
                "results": [dataclasses.asdict(r) for r in self.results]}


def default_head_dims(spec: BackendSpec, capability: str | None = None) -> tuple[int, ...]:
    """The head dims a run checks (by ``capability``; None: the backend): every value a list
    declares; from a range, 64, 128 and 256 where declared, and its maximum where that is larger
    (else the first declared among common head dims)."""
    dims = spec.head_dims if capability is None else spec.head_dims_for(capability)
    if dims.values is not None:
        return tuple(sorted(set(dims.values)))
    common = [d for d in COMMON_HEAD_DIMS if dims.refusal(d) is None]
    top = dims.maximum
    if top is not None and dims.refusal(top) is None and top > max(common, default=0):
        common.append(top)
    return tuple(common) or tuple(d for d in HEAD_DIM_CANDIDATES if dims.refusal(d) is None)[:1]


def left_out(spec: BackendSpec, classes: Mapping[str, Any], dtypes: Sequence[torch.dtype] | None,
             head_dims: Sequence[int] | None, quick: bool) -> dict[str, str]:
    """What a run of :func:`plan_checks` with these arguments does not check of what each
    capability declares -- head dims and dtypes -- and why, so a summary never passes it over."""
    out: dict[str, str] = {}
    all_dtypes = tuple(dtypes) if dtypes is not None else default_dtypes(spec)
    given = tuple(head_dims) if head_dims is not None else None
    for cap in STEP_KINDS:
        if cap not in classes:
            continue
        cap_dtypes, dims = _for_capability(spec, cap, all_dtypes, dtypes is None, given)
        why = "not asked (--head-dim)" if given is not None else ""
        if quick and dims[1:]:
            dims, why = dims[:1], "--quick checks the first head dim only"
        declared = spec.head_dims_for(cap)
        if declared.values is not None:
            missing = [d for d in declared.values if d not in dims]
            if missing:
                out[f"{cap} head dims"] = f"{', '.join(map(str, missing))} declared, not checked: {why}"
        elif not (declared.maximum is not None and all(
                d in dims for d in range(declared.multiple_of, declared.maximum + 1, declared.multiple_of))):
            usual = "64, 128, 256 and the largest declared" if dims else "the suite checks none it allows"
            checked = f"{', '.join(map(str, dims))} only" if dims else "none"
            out[f"{cap} head dims"] = f"declares {declared}; checked {checked} ({why or usual})"
        skipped = [d for d in spec.dtypes_for(cap) if d not in cap_dtypes]
        if skipped:
            reasons = ["not asked (--dtype)" if d in C.TOLERANCE else "the suite has no tolerance for it"
                       for d in skipped]
            out[f"{cap} dtypes"] = "; ".join(f"{dtype_name(d)}: {r}" for d, r in zip(skipped, reasons, strict=True))
    return out


def _declared_anywhere(spec: BackendSpec) -> tuple[list[torch.dtype], list[Any]]:
    """Every dtype and every head-dim declaration some capability of ``spec`` has."""
    caps = list(spec.provides)
    dtypes = list(dict.fromkeys(d for c in caps for d in spec.dtypes_for(c)))
    return dtypes, [spec.head_dims_for(c) for c in caps]


def check_given(spec: BackendSpec, dtypes: Sequence[torch.dtype] | None, head_dims: Sequence[int] | None) -> None:
    """Refuse dtypes and head dims to check (None: the declared ones) that no capability of the
    backend declares or (a dtype) the suite has no tolerance for, naming what is allowed."""
    usable = default_dtypes(spec)
    dtypes = tuple(dtypes) if dtypes is not None else usable
    declared, dims = _declared_anywhere(spec)
    bad = [dtype_name(d) for d in dtypes if d not in usable]
    if bad:
        raise InputError(f"backend {spec.name!r}: cannot check dtype {', '.join(bad)}; it declares "
                         f"{', '.join(map(dtype_name, declared))}, and the suite checks "
                         f"{', '.join(map(dtype_name, C.TOLERANCE))}")
    if head_dims is not None:
        head_dims = tuple(head_dims)
        for d in head_dims:
            if all(h.refusal(d) is not None for h in dims):
                raise InputError(f"backend {spec.name!r}: cannot check {dims[0].refusal(d)}")
    if not dtypes or (head_dims is not None and not head_dims) or not any(default_head_dims(spec, c)
                                                                          for c in spec.provides):
        raise InputError(f"backend {spec.name!r}: no dtype or head dim to check "
                         f"(dtypes {list(map(dtype_name, dtypes))}, "
                         f"head dims {list(head_dims or ())}); it declares dtypes {[dtype_name(d) for d in declared]}, "
                         f"head dims {', '.join(sorted(set(map(str, dims))))}")


def default_dtypes(spec: BackendSpec) -> tuple[torch.dtype, ...]:
    """Every dtype some capability declares that the suite has a tolerance for."""
    return tuple(d for d in _declared_anywhere(spec)[0] if d in C.TOLERANCE)


def _for_capability(spec: BackendSpec, cap: str, dtypes: Sequence[torch.dtype], declared_dtypes: bool,
                    head_dims: Sequence[int] | None) -> tuple[tuple[torch.dtype, ...], tuple[int, ...]]:
    """The dtypes and head dims ``cap`` is checked at: the declared ones it runs (given head dims
    it declares; given dtypes it declares, and those no capability declares as they are: a
    stand-in tested in float32 on a CPU -- a dtype another capability declares is not this one's)."""
    own = spec.dtypes_for(cap)
    if declared_dtypes:
        dtypes = [d for d in dtypes if d in own]
    else:
        elsewhere = _declared_anywhere(spec)[0]
        dtypes = [d for d in dtypes if d in own or d not in elsewhere]
    if head_dims is None:
        return tuple(dtypes), default_head_dims(spec, cap)
    return tuple(dtypes), tuple(d for d in head_dims if spec.head_dims_for(cap).refusal(d) is None)


def _at(cases: Sequence[Any], head_dims: Sequence[int]) -> list[Any]:
    """The cases at the allowed head dims (a case at another one moves to the nearest), once each."""
    out: dict[str, Any] = {}
    for c in cases:
        if c.head_dim not in head_dims:
            c = dataclasses.replace(c, head_dim=min(head_dims, key=lambda d: abs(d - c.head_dim)))
        out.setdefault(str(c), c)
    return list(out.values())


PLAIN: dict[str, Callable[[], Sequence[Any]]] = {
    "prefill": C.prefill_cases, "decode": C.decode_cases, "mixed": C.mixed_cases, "ragged": C.ragged_cases}


def _targeted(c: Any) -> bool:
    """A plain case aimed at one thing (a window, a scale, no causal mask, uniform rows, a long
    prompt): ``--quick`` keeps these and one case of the grid per page size."""
    uniform = len(c.q_lens) > 1 and len(set(c.q_lens)) == 1 and c.q_lens[0] > 1
    return c.window_left >= 0 or c.sm_scale is not None or not c.causal or uniform or max(c.q_lens) > 64


def _quick_plain(cases: Sequence[Any]) -> list[Any]:
    seen: set[Any] = set()
    out = []
    for c in cases:
        first = getattr(c, "page_size", None) not in seen and c.gqa == 4 and c.causal
        if _targeted(c) or first:
            seen.add(getattr(c, "page_size", None))
            out.append(c)
    return out


def _cases(kind: str, features: Sequence[str], head_dims: Sequence[int], quick: bool = False, window: int = -1,
           excludes: Sequence[Sequence[str]] = ()) -> list[tuple[str, Any]]:
    """(group, case) of one capability: the plain cases at the checked head dims; the shapes,
    feature, edge and numerics cases at every one of them (no combination of features ``excludes`` names);
    ``window`` >= 0: the feature cases and the first plain one at that window too. ``quick``: a
    subset of the plain and feature cases (the head dims are the caller's to cut)."""
    base: Sequence[C.PagedCase | C.RaggedCase] = PLAIN[kind]()
    if quick:
        base = _quick_plain(base)
    groups: list[tuple[str, list[Any]]] = [("plain", _at(base, head_dims))]
    shapes: list[Any] = []
    extra: list[Any] = []
    edge: list[Any] = []
    numerics: list[Any] = []
    for d in head_dims:
        shapes += C.shape_cases(kind, d)
        numerics += C.numerics_cases(kind, d, quick)
        if kind == "ragged":
            extra += C.ragged_feature_cases(features, d)
        else:
            extra += C.feature_cases(kind, features, page_sizes=(16,) if quick else (1, 16), head_dim=d,
                                     excludes=excludes)
        edge += C.edge_cases(kind, d)
    groups += [("shapes", shapes), ("features", extra), ("edge", edge), ("numerics", numerics)]
    if window >= 0 and kind != "ragged":
        groups.append(("window", [dataclasses.replace(c, window_left=window) for c in [*groups[0][1][:1], *extra]]))
    return [(g, c) for g, cases in groups for c in cases]


def multi_token_kinds(spec: BackendSpec, classes: Mapping[str, Any]) -> tuple[str, ...]:
    """The step kinds ("decode", "prefill") whose provided wrapper runs multi-token decode
    rows, as ``spec`` declares them (:meth:`BackendSpec.multi_token_wrappers`)."""
    return tuple(STEP_KINDS[c] for c in spec.multi_token_wrappers() if c in classes)


def _other_cuda(device: torch.device) -> torch.device | None:
    """A CUDA device that is not the current one (the device case runs there), or None."""
    if device.type != "cuda" or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    current = torch.cuda.current_device()
    return torch.device("cuda", next(i for i in range(torch.cuda.device_count()) if i != current))


def plan_checks(spec: BackendSpec, classes: Mapping[str, Any], device: torch.device | str,
                dtypes: Sequence[torch.dtype] | None = None, head_dims: Sequence[int] | None = None,
                quick: bool = False, features: Mapping[str, Sequence[str]] | None = None,
                window: int = -1) -> list[Check]:
    """Every check of ``spec``'s capabilities (``classes``: capability -> loaded wrapper) on
    ``device``; ``dtypes``/``head_dims`` None: the declared ones (:func:`default_dtypes`,
    :func:`default_head_dims`), others taken as given (a stand-in tested in float32 on a CPU).
    ``features``: capability -> the features its feature cases exercise (None: the declared
    ones); ``window`` >= 0: cases at that window too (a layer group's, :mod:`.group_check`).
    ``quick``: a short subset -- the first head dim only, fewer plain and feature cases; every
    group and rule still checked. Nothing runs until a check's ``run()``."""
    device = torch.device(device)
    declared_dtypes = dtypes is None
    all_dtypes = tuple(dtypes) if dtypes is not None else default_dtypes(spec)
    given_dims = tuple(head_dims) if head_dims is not None else None
    other = _other_cuda(device)
    multi = multi_token_kinds(spec, classes)
    checks: list[Check] = []
    for dtype in all_dtypes:
        def wrapper_set(dev: torch.device, dtype: torch.dtype = dtype) -> C.WrapperSet:
            return C.WrapperSet(
                spec.name, classes.get("paged_prefill"), classes.get("paged_decode"), classes.get("mixed"),
                classes.get("prefixed_ragged"), device=str(dev), dtype=dtype,
                workspace_bytes=(128 << 20) if dev.type == "cuda" else (1 << 20), device_indices=dev.type == "cuda",
                thorough=True, api_version=spec.api_version)

        ws = wrapper_set(device)
        for cap, kind in STEP_KINDS.items():
            if cap not in classes:
                continue
            cap_dtypes, head_dims = _for_capability(spec, cap, all_dtypes, declared_dtypes, given_dims)
            if dtype not in cap_dtypes or not head_dims:
                continue  # this capability declares other dtypes or head dims
            if quick:
                head_dims = head_dims[:1]
            fn = C.CHECKS[kind]
            asked = spec.supports(cap) if features is None else tuple(features.get(cap, ()))
            for group, case in _cases(kind, asked, head_dims, quick, window, spec.excludes.get(cap, ())):
                checks.append(Check(cap, group, dtype, str(case), functools.partial(fn, ws, case)))
            if kind in multi:
                for d in head_dims:
                    for case in C.multi_token_cases(d):
                        checks.append(Check(cap, "features", dtype, f"multi_token-{case}",
                                            functools.partial(fn, ws, case)))
            for d in head_dims:
                checks.append(Check(cap, "replan", dtype, f"{kind}-d{d}",
                                    functools.partial(reuse.check_replan, ws, kind, d)))
                checks.append(Check(cap, "replan", dtype, f"refused-{kind}-d{d}",
                                    functools.partial(reuse.check_refused, ws, kind, d)))
                windows = "-layer_windows" if "layer_windows" in spec.supports(cap) else ""
                checks.append(Check(cap, "layers", dtype, f"{kind}-d{d}{windows}",
                                    functools.partial(reuse.check_layers, ws, kind, d)))
            if cap in spec.capturable and device.type == "cuda":
                replay_multi = kind == "prefill" and kind in multi
                for d in head_dims:
                    checks.append(Check(cap, "replay", dtype, f"{kind}-d{d}" + ("-multi_token" if replay_multi else ""),
                                        functools.partial(reuse.check_replay, ws, kind, d, replay_multi)))
            if other is not None:  # the data on a device that is not the current one
                far = wrapper_set(other)
                d = head_dims[-1]
                for case in (C.shape_cases(kind, d)[0], *_at(PLAIN[kind]()[:1], (d,))):
                    checks.append(Check(cap, "device", dtype, f"{other}-{case}", functools.partial(fn, far, case)))
    return checks


def run_check(check: Check) -> Result:
    t0 = time.perf_counter()
    err, passed, msg, refused, rule = None, True, "", False, None
    try:
        err = check.run()
    except C.Refused as e:  # a refusal the contract allows (rows with fewer keys than queries)
        msg, refused = str(e), True
    except RuleError as e:
        passed, msg, rule, err = False, str(e), e.rule, e.error
    except Exception as e:  # a failing case is a result, not the end of the run
        passed, msg, rule = False, f"{type(e).__name__}: {e}", "runs"
    return Result(check.capability, check.group, dtype_name(check.dtype), check.name, passed, err, msg,
                  time.perf_counter() - t0, refused, rule)


def select_for_check(name: str, device: torch.device | str | None = None, registry: Any = None,
                     config: Any = None) -> tuple[Any, torch.device]:
    """The backend named ``name`` with every wrapper protocol it provides loaded, on ``device``
    (None: CUDA when usable and the backend runs there, else the CPU); ``config``: pins for a
    name several distributions register. Raises ``BackendUnavailable`` with the reasons when it
    cannot run there, ValueError when it provides nothing the suite covers."""
    from mstar_core.config import load_config
    from mstar_core.registry import get_registry, select_backend
    from mstar_core.registry.device import as_device

    registry = registry or get_registry()
    config = load_config(config)
    spec = registry.view(config.pins).get(name)
    if spec is not None and not any(c in STEP_KINDS for c in spec.provides):
        raise InputError(f"backend {name!r} provides only {', '.join(spec.provides)}, which mstar check does not "
                         f"cover: {'; '.join(f'{c}: {NOT_COVERED[c]}' for c in spec.provides if c in NOT_COVERED)}")
    if device is None:
        cuda = torch.cuda.is_available() and spec is not None and not registry.reasons(spec, device="cuda")
        device = "cuda" if cuda else "cpu"
    device = as_device(device)
    caps = tuple(c for c in (spec.provides if spec is not None else STEP_KINDS) if c in STEP_KINDS)
    sel = select_backend(capabilities=caps, requested=name, device=device, dtype=None, head_dim=None,
                         registry=registry, honor_env=False, config=config)
    return sel, device


def not_covered(spec: BackendSpec, classes: Mapping[str, Any]) -> dict[str, str]:
    """What ``spec`` provides or declares that the suite cannot check, and why."""
    out = {c: NOT_COVERED[c] for c in spec.provides if c in NOT_COVERED}
    declared = any("multi_token_decode" in spec.supports(c) for c in ("paged_decode", "paged_prefill"))
    if declared and not multi_token_kinds(spec, classes):
        out["multi_token_decode"] = (f"declared on paged_decode by a plugin API {spec.api_version} spec, whose "
                                     "managers ran it on the paged_prefill wrapper, which this backend does not "
                                     "provide; from plugin API 1.1 it is declared on the wrapper that runs it")
    if "decode" in multi_token_kinds(spec, classes) and "paged_decode" in spec.capturable:
        out["multi_token_decode replay"] = ("multi-token rows on the decode wrapper are checked eagerly; their graph "
                                            "replay is not checked yet")
    return out


def device_notes(device: torch.device) -> list[str]:
    """What the device checks could not do here."""
    if device.type != "cuda":
        return ["on a CPU every output is checked to be on the CPU; run `mstar check NAME --device cuda` on a GPU "
                "machine for the device checks (the output on q's device; with two GPUs, the data on one that is "
                "not the current device)"]
    if _other_cuda(device) is None:
        return ["one GPU: the device case (the data on a GPU that is not the current device) needs two"]
    return []


def check_backend(name: str, device: torch.device | str | None = None, dtypes: Sequence[torch.dtype] | None = None,
                  head_dims: Sequence[int] | None = None, registry: Any = None,
                  on_result: Callable[[Result], None] | None = None, config: Any = None, quick: bool = False,
                  on_start: Callable[[Sequence[Check]], None] | None = None,
                  groups: Sequence[str] | None = None) -> Report:
    """Run every check of the installed backend ``name`` (see :func:`plan_checks`; ``quick``: a
    short subset; ``groups``: only these of :data:`GROUPS`). ``on_start`` gets the checks before
    any runs, ``on_result`` each result. What the run leaves out is in the report's ``not_covered``."""
    sel, device = select_for_check(name, device, registry, config)
    spec = sel.backend
    check_given(spec, dtypes, head_dims)
    bad = [g for g in groups or () if g not in GROUPS]
    if bad:
        raise InputError(f"check: unknown group {', '.join(map(repr, bad))}; the groups are {', '.join(GROUPS)}")
    checks = plan_checks(spec, sel.classes, device, dtypes, head_dims, quick=quick)
    gaps = {**not_covered(spec, sel.classes), **left_out(spec, sel.classes, dtypes, head_dims, quick)}
    if groups:
        skipped = sorted({c.group for c in checks} - set(groups))
        checks = [c for c in checks if c.group in groups]
        if skipped:
            gaps["groups"] = f"{', '.join(skipped)} not run (--group {' '.join(groups)})"
    if on_start is not None:
        on_start(checks)
    results = []
    for check in checks:
        result = run_check(check)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return Report(name, spec.label, spec.api_version, str(device), results, gaps, device_notes(device))


def conformance_test(name: str, *, device: torch.device | str | None = None,
                     dtypes: Sequence[torch.dtype] | None = None, head_dims: Sequence[int] | None = None,
                     skip_unavailable: bool = False, quick: bool = False) -> Callable[..., None]:
    """A pytest test function, parametrized with one test per check of backend ``name``::

        test_conformance = conformance_test("mykernel")

    A backend that cannot run here fails collection with the reasons; ``skip_unavailable=True``
    turns that into one skipped test naming them (a GPU backend's suite on a CPU machine).
    ``quick``: the short subset (see :func:`plan_checks`)."""
    import pytest

    from mstar_core.registry import BackendUnavailable

    try:
        sel, dev = select_for_check(name, device)
    except BackendUnavailable as e:
        if not skip_unavailable:
            raise

        @pytest.mark.skip(reason=str(e))
        def test_conformance_unavailable() -> None:
            raise AssertionError("skipped")

        return test_conformance_unavailable
    check_given(sel.backend, dtypes, head_dims)
    checks = plan_checks(sel.backend, sel.classes, dev, dtypes, head_dims, quick=quick)

    @pytest.mark.parametrize("check", checks, ids=[c.id for c in checks])
    def test_conformance(check: Check) -> None:
        try:
            check.run()
        except C.Refused:  # allowed: rows with fewer keys than queries, refused at plan
            pass

    return test_conformance
