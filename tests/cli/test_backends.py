"""``mstar backends`` in process: the sub-parser, the table and the JSON on a CPU machine with
the real plugin modules (no kernel library installed) and one broken plugin."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mstar_core import BackendSpec, Registry
from mstar_core.backends.reference.plugin import REFERENCE
from mstar_core.cli import backends as cli
from mstar_core.cli import main
from mstar_core.features import FEATURES

pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture
def registry(fake_entry_points, make_ep, monkeypatch):
    fake_entry_points(
        make_ep("flashinfer", "mstar_flashinfer.plugin", "mstar-flashinfer", "0.1.0"),
        make_ep("broken", "mstar_broken_plugin_xyz", "mstar-broken", "9.9"),
    )
    reg = Registry()
    monkeypatch.setattr(cli, "get_registry", lambda: reg)
    return reg


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mstar")
    cli.register(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["backends", *argv])


def test_json_shows_flashinfer_installed_but_unavailable_and_the_reference_picked(registry, capsys):
    args = _args("--json", "--device", "cpu")
    assert args.func is cli.run
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    fi = next(b for b in data["backends"] if b["name"] == "flashinfer")
    assert (fi["distribution"], fi["version"], fi["available"]) == ("mstar-flashinfer", "0.1.0", False)
    assert fi["reasons"] == ["runs on cuda, not on cpu",
                             "flashinfer is not installed (install flashinfer-python>=0.5.3,<=0.7.4)"]
    assert fi["head_dims"] == "64, 128, 256" and fi["dtypes"] == ["float16", "bfloat16"]
    assert {cap: a["pick"] for cap, a in data["auto"].items()} == dict.fromkeys(
        ("paged_prefill", "paged_decode", "mixed", "prefixed_ragged", "bounded"), "reference")
    assert "flashinfer" in data["auto"]["paged_decode"]["rejected"]
    assert data["failed_plugins"] == [{"entry_point": "broken", "distribution": "mstar-broken", "version": "9.9",
                                       "stage": "load", "error": data["failed_plugins"][0]["error"], "backends": [],
                                       "outcome": "none of its backends is registered"}]
    assert "mstar_broken_plugin_xyz" in data["failed_plugins"][0]["error"]


def test_table_says_when_the_env_forces_a_backend(registry, capsys, monkeypatch):
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "fa3")  # cannot run here
    args = _args("--device", "cpu")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "MSTAR_ATTENTION_BACKEND=fa3: every selection uses it" in out
    assert "paged_decode     reference" in out  # the auto column is the rule's own pick


def test_table(registry, capsys):
    args = _args("--head-dim", "64", "--device", "cpu")  # without --device a CUDA machine judges cuda
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "attention backends on cpu" in out and "head_dim 64" in out
    assert "mstar-flashinfer 0.1.0" in out
    assert "unavailable: runs on cuda, not on cpu; flashinfer is not installed" in out
    assert "paged_decode     reference" in out and "passed over flashinfer:" in out
    assert "broken (mstar-broken 9.9) at load: ModuleNotFoundError" in out
    assert out.rstrip().endswith("; none of its backends is registered")


def test_bad_dtype_is_a_clear_error(registry):
    with pytest.raises(ValueError, match="--dtype 'float9' is not a torch dtype"):
        cli.run(_args("--dtype", "float9"))


# -- attention features ---------------------------------------------------------------------------

SINK = "does not support feature sink_logits (learned per-head sink logits in the softmax denominator)"
FP8 = "does not support feature fp8_e4m3 (FP8 (e4m3) KV cache with per-layer K/V scales)"
SOFT_CAP = "does not support feature soft_cap (logit soft-cap (soft_cap * tanh(scores / soft_cap)))"
TOGETHER = "does not support features sink_logits with"
ALL_SIX = ["fp8_e4m3", "fp8_e5m2", "soft_cap", "sink_logits", "layer_windows", "multi_token_decode"]


@pytest.fixture
def run_json(capsys):
    def run(*argv: str) -> dict:
        args = _args("--json", "--device", "cpu", *argv)
        assert args.func(args) == 0
        return json.loads(capsys.readouterr().out)

    return run


@pytest.fixture
def run_text(capsys):
    def run(*argv: str) -> str:
        args = _args("--device", "cpu", *argv)
        assert args.func(args) == 0
        return capsys.readouterr().out

    return run


def test_features_per_backend_and_capability_in_json(registry, run_json):
    data = run_json()
    assert data["known_features"] == FEATURES and list(data["known_features"]) == ALL_SIX
    assert data["features_requested"] == [] and data["features_description"] == "plain attention"
    by_name = {b["name"]: b for b in data["backends"]}
    for name, b in by_name.items():  # exactly what each spec declares, every provided capability named
        spec = registry.get(name)
        assert b["features"] == {cap: list(spec.supports(cap)) for cap in spec.provides}
    ref = by_name["reference"]["features"]
    assert ref["paged_decode"] == ALL_SIX and ref["bounded"] == []
    assert ref["prefixed_ragged"] == ["soft_cap", "sink_logits", "layer_windows"]
    fi = by_name["flashinfer"]["features"]
    # multi-token decode rows on the prefill wrapper, which runs them
    assert fi["paged_prefill"] == ["fp8_e4m3", "fp8_e5m2", "soft_cap", "layer_windows", "sink_logits",
                                   "multi_token_decode"]
    assert fi["paged_decode"] == fi["mixed"] == ["fp8_e4m3", "fp8_e5m2", "soft_cap", "layer_windows", "sink_logits"]
    # plain attention: nothing is refused for a feature
    assert not any("feature" in r for a in data["auto"].values() for rs in a["rejected"].values() for r in rs)


def test_features_per_backend_and_capability_in_the_table(registry, run_text):
    out = run_text()
    lines = out.splitlines()
    i = lines.index("features per capability:")
    assert lines[i + 1:i + 8] == [
        "  flashinfer  paged_prefill: fp8_e4m3, fp8_e5m2, soft_cap, layer_windows, sink_logits, multi_token_decode",
        "              paged_decode, mixed: fp8_e4m3, fp8_e5m2, soft_cap, layer_windows, sink_logits",
        "              prefixed_ragged: soft_cap, layer_windows",
        "  reference   paged_prefill, paged_decode: " + ", ".join(ALL_SIX),
        "              mixed: " + ", ".join(ALL_SIX[:5]),
        "              prefixed_ragged: soft_cap, sink_logits, layer_windows",
        "              bounded: none",
    ]
    j = lines.index("known features (feature, the option that asks for it, what it is):")
    legend = lines[j + 1:j + 7]
    assert [line.split()[0] for line in legend] == ALL_SIX
    assert "--sink-logits" in legend[3] and "learned per-head sink logits" in legend[3]
    assert "--kv-dtype fp8_e5m2" in legend[1] and "--decode-query-tokens 2..8" in legend[5]
    # plain attention: the header and the auto section read as before
    assert "auto judged for dtype float32, head_dim 128)" in lines[0]
    assert "auto picks:" in lines and "features:" not in lines[0]


def test_fp8_soft_cap_and_sink_logits_on_cpu_explain_every_pick(registry, run_json):
    data = run_json("--kv-dtype", "fp8_e4m3", "--soft-cap", "30", "--sink-logits")
    assert data["features_requested"] == ["fp8_e4m3", "soft_cap", "sink_logits"]
    assert data["features_description"] == "kv_dtype fp8_e4m3, soft_cap 30, sink_logits"
    auto = data["auto"]
    # The reference serves every paged capability and the dense one (FP8 is not asked of the
    # prefixed ragged wrappers: the dense manager dequantises the prefix); its bounded declares no
    # features at all, so bounded has no pick.
    assert {cap: a["pick"] for cap, a in auto.items()} == {
        "paged_prefill": "reference", "paged_decode": "reference", "mixed": "reference",
        "prefixed_ragged": "reference", "bounded": None}
    for cap in ("paged_prefill", "paged_decode", "mixed"):
        reasons = auto[cap]["rejected"]["flashinfer"]
        # FlashInfer has each of the three there, not sink logits together with either of the others
        assert reasons[-2:] == [f"{TOGETHER} soft_cap together in {cap}", f"{TOGETHER} fp8_e4m3 together in {cap}"]
        assert not any(r.startswith((FP8, SOFT_CAP, SINK)) for r in reasons)
        assert list(auto[cap]["rejected"]) == ["flashinfer"]
    assert "reference" not in auto["prefixed_ragged"]["rejected"]
    assert auto["prefixed_ragged"]["rejected"]["flashinfer"][-1] == f"{SINK} in prefixed_ragged"
    assert auto["bounded"]["rejected"]["reference"] == [f"{FP8} in bounded", f"{SOFT_CAP} in bounded",
                                                        f"{SINK} in bounded"]
    # the other spelling asks for the same
    assert run_json("--kv-dtype", "FP8-E4M3", "--soft-cap", "30", "--sink-logits")["auto"] == auto


def test_fp8_soft_cap_and_sink_logits_on_cpu_in_the_table(registry, run_text):
    out = run_text("--kv-dtype", "fp8-e4m3", "--soft-cap", "30", "--sink-logits")
    assert out.splitlines()[0].endswith(
        "auto judged for dtype float32, head_dim 128, features: kv_dtype fp8_e4m3, soft_cap 30, sink_logits)")
    auto = out[out.index("auto picks (for features fp8_e4m3, soft_cap, sink_logits):"):]
    assert "  paged_decode     reference\n" in auto
    assert "passed over flashinfer: runs on cuda, not on cpu; " in auto
    assert f"; {TOGETHER} fp8_e4m3 together in paged_decode\n" in auto
    assert f"  bounded          (none: no backend can run it here)\n" \
           f"                     passed over reference: {FP8} in bounded; {SOFT_CAP} in bounded; {SINK} in bounded" \
           in auto
    assert "  prefixed_ragged  reference\n" in auto
    assert f"{FP8} in prefixed_ragged" not in auto


DEQUANTISED = "the dense manager dequantises an FP8 cache's prefix: its wrappers read K/V in the model dtype"


def test_features_not_asked_of_a_capability_are_named_with_why(registry, run_json, run_text):
    auto = run_json("--kv-dtype", "fp8_e5m2", "--decode-query-tokens", "2")["auto"]
    assert auto["prefixed_ragged"]["not_asked"] == {"fp8_e5m2": DEQUANTISED,
                                                    "multi_token_decode": "it reaches paged_decode only"}
    assert auto["paged_decode"]["not_asked"] == {}
    assert auto["mixed"]["not_asked"] == {"multi_token_decode": "it reaches paged_decode only"}
    assert auto["bounded"]["not_asked"] == {"multi_token_decode": "it reaches paged_decode only"}
    assert run_json()["auto"]["prefixed_ragged"]["not_asked"] == {}
    out = run_text("--kv-dtype", "fp8_e4m3")
    assert (f"  prefixed_ragged  reference\n"
            f"                     fp8_e4m3 is not asked of prefixed_ragged: {DEQUANTISED}\n"
            f"                     passed over flashinfer: ") in out
    assert out.count("is not asked of") == 1


@pytest.fixture
def toy(registry):
    """A third-party backend: paged decode on CPU in float32, with a soft-cap and nothing else."""
    registry.register(BackendSpec(name="toy", provides={"paged_decode": REFERENCE.provides["paged_decode"]},
                                  devices=("cpu",), dtypes=(torch.float32,), features={"paged_decode": ("soft_cap",)},
                                  priority=1), distribution="mstar-toy", version="2.0")
    return registry


def test_a_third_party_backend_is_picked_for_what_it_declares(toy, run_json, run_text):
    data = run_json("--soft-cap", "30")
    assert next(b for b in data["backends"] if b["name"] == "toy")["features"] == {"paged_decode": ["soft_cap"]}
    assert data["auto"]["paged_decode"]["pick"] == "toy"
    assert data["auto"]["mixed"]["pick"] == "reference"  # toy does not provide it
    assert "  toy         paged_decode: soft_cap" in run_text().splitlines()


def test_a_third_party_backend_is_passed_over_naming_the_feature_it_lacks(toy, run_json, run_text):
    data = run_json("--soft-cap", "30", "--sink-logits")
    assert data["auto"]["paged_decode"]["pick"] == "reference"
    assert data["auto"]["paged_decode"]["rejected"]["toy"] == [f"{SINK} in paged_decode"]
    out = run_text("--soft-cap", "30", "--sink-logits")
    assert f"passed over toy: {SINK} in paged_decode\n" in out
    # asked for nothing, toy is the pick again
    assert run_json()["auto"]["paged_decode"]["pick"] == "toy"


@pytest.mark.parametrize("argv,message", [
    (["--soft-cap", "0"], "--soft-cap '0' must be a finite float > 0"),
    (["--soft-cap", "-1"], "--soft-cap '-1' must be a finite float > 0"),
    (["--soft-cap", "nan"], "--soft-cap 'nan' must be a finite float > 0"),
    (["--soft-cap", "inf"], "--soft-cap 'inf' must be a finite float > 0"),
    (["--soft-cap", "thirty"], "--soft-cap 'thirty' must be a finite float > 0"),
    (["--kv-dtype", "fp16"], "--kv-dtype 'fp16' is not supported; choose one of auto, fp8_e4m3, fp8_e5m2"),
    (["--kv-dtype", "fp8"], "--kv-dtype 'fp8' is not supported; choose one of auto, fp8_e4m3, fp8_e5m2"),
    (["--layer-windows", "128,-2"], "entry 1 ('-2') must be an int >= 0, or -1 for a full layer"),
    (["--layer-windows", "128,,64"], "--layer-windows '128,,64': entry 1 ('') must be an int >= 0"),
    (["--layer-windows", "4k"], "--layer-windows '4k': entry 0 ('4k') must be an int >= 0"),
    (["--decode-query-tokens", "0"], "--decode-query-tokens '0' must be an int in 1..8"),
    (["--decode-query-tokens", "9"], "--decode-query-tokens '9' must be an int in 1..8"),
    (["--decode-query-tokens", "two"], "--decode-query-tokens 'two' must be an int in 1..8"),
])
def test_bad_feature_values_are_one_clear_line_and_exit_2(capsys, argv, message):
    assert main(["backends", "--device", "cpu", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.startswith("mstar backends: error: backends: ") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_feature_values_at_the_edges_are_accepted(registry, run_json):
    data = run_json("--decode-query-tokens", "8", "--layer-windows=-1,0,4096", "--soft-cap", "1e-3",
                    "--kv-dtype", "auto")
    assert data["features_requested"] == ["soft_cap", "layer_windows", "multi_token_decode"]
    assert data["auto"]["paged_decode"]["pick"] == "reference"
    # one window for every layer asks for no per-layer windows
    assert run_json("--layer-windows", "128,128", "--decode-query-tokens", "1")["features_requested"] == []


def test_json_and_table_say_why_the_paged_manager_cannot_be_built(monkeypatch, capsys):
    """A decode-only plugin and no reference: auto picks it for paged_decode, and the paged
    manager (which needs every paged kind) has no picks, with the selection's reason."""
    reg = Registry(discover=False)
    reg.register(BackendSpec(name="dec", provides={"paged_decode": REFERENCE.provides["paged_decode"]},
                             devices=("cpu",), dtypes=(torch.float32,), api_version="1.1"),
                 distribution="dec-mstar", version="0.1")
    monkeypatch.setattr(cli, "get_registry", lambda: reg)
    args = _args("--json", "--device", "cpu")
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["auto"]["paged_decode"]["pick"] == "dec" and data["auto"]["paged_prefill"]["pick"] is None
    assert data["paged"]["picks"] is None and data["paged"]["multi_token_wrapper"] is None
    assert "none serves paged_prefill" in data["paged"]["error"]
    args = _args("--device", "cpu")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "the paged manager cannot be built here: no attention backend can run here" in out
    assert "none serves paged_prefill" in out


def test_the_auto_column_shows_the_paged_managers_picks_when_multi_token_rows_move_one(monkeypatch, capsys):
    """Decode asked alone must run multi-token rows itself; in the paged group the reference's
    prefill wrapper runs them and the decode-only plugin keeps decode. The column shows the
    group's picks, the ones the manager takes."""
    reg = Registry(discover=False)
    reg.register(REFERENCE, distribution="mstar-core", version="0")
    reg.register(BackendSpec(name="dec", provides={"paged_decode": REFERENCE.provides["paged_decode"]},
                             devices=("cpu",), dtypes=(torch.float32,), api_version="1.1", priority=1),
                 distribution="dec-mstar", version="0.1")
    monkeypatch.setattr(cli, "get_registry", lambda: reg)
    args = _args("--json", "--device", "cpu", "--decode-query-tokens", "3")
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["paged"]["picks"] == {"paged_prefill": "reference", "paged_decode": "dec", "mixed": "reference"}
    assert data["paged"]["multi_token_wrapper"] == "paged_prefill"
    assert {c: data["auto"][c]["pick"] for c in data["paged"]["picks"]} == data["paged"]["picks"]
    assert "dec" not in data["auto"]["paged_decode"]["rejected"]


# -- --config FILE -------------------------------------------------------------------------------

def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "mstar.toml"
    path.write_text(text)
    return str(path)


def test_a_config_table_shows_each_capabilitys_pick_in_json_and_the_table(registry, run_json, run_text, tmp_path):
    assert run_json()["config"] is None and "picks under this config" not in run_text()
    cfg = _toml(tmp_path, '[attention.backend]\npaged_decode = "reference"\nmixed = "flashinfer"\n'
                          '[attention.pins]\nreference = "mstar-core"\n[kv]\nprefix_cache = true\n')
    data = run_json("--config", cfg)["config"]
    assert (data["file"], data["backend"], data["pins"], data["prefix_cache"]) == (
        cfg, {"paged_decode": "reference", "mixed": "flashinfer"}, {"reference": "mstar-core"}, True)
    picks = data["picks"]
    assert list(picks) == ["paged_prefill", "paged_decode", "mixed", "prefixed_ragged", "bounded"]
    assert picks["paged_decode"] == {"asks": "reference", "pick": "reference", "error": None}
    assert picks["paged_prefill"] == {"asks": "auto", "pick": "reference", "error": None}
    assert picks["mixed"]["asks"] == "flashinfer" and picks["mixed"]["pick"] is None
    assert "attention backend 'flashinfer' (mstar-flashinfer 0.1.0, from config, for mixed) cannot run here" in \
        picks["mixed"]["error"] and "runs on cuda, not on cpu" in picks["mixed"]["error"]
    lines = run_text("--config", cfg).splitlines()
    at = lines.index("picks under this config:")
    assert lines[at - 1] == (f"config {cfg!r}: attention.backend = {{paged_decode = 'reference', mixed = "
                             "'flashinfer'}; attention.pins: reference = mstar-core; kv.prefix_cache = true")
    assert lines[at + 1:at + 3] == ["  paged_prefill    reference (auto)", "  paged_decode     reference (named)"]
    assert lines[at + 3].startswith("  mixed            (none: attention backend 'flashinfer' (mstar-flashinfer")


def test_a_misspelt_config_backend_is_named_once_with_a_did_you_mean(registry, run_json, run_text, tmp_path,
                                                                     monkeypatch):
    cfg = _toml(tmp_path, '[attention]\nbackend = "refrence"\n')
    picks = run_json("--config", cfg)["config"]["picks"]
    assert all(p["pick"] is None and "(did you mean 'reference'?)" in p["error"] for p in picks.values())
    monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", "reference")
    lines = run_text("--config", cfg).splitlines()
    at = lines.index("picks under this config (MSTAR_ATTENTION_BACKEND=reference overrides its backend: below):")
    assert lines[at + 1].startswith("  paged_prefill    (none: attention backend 'refrence' (from config) is unknown")
    assert lines[at + 2:at + 6] == [f"  {cap:<16} (none: as for paged_prefill)"
                                    for cap in ("paged_decode", "mixed", "prefixed_ragged", "bounded")]


@pytest.fixture
def two_toys(fake_module, make_ep, fake_entry_points, monkeypatch):
    """``toy``, a paged decode backend on CPU, registered by two distributions: neither serves it
    until a pin says which."""
    from mstar_core import hookimpl

    for module, desc in (("toy_a_plugin", "a"), ("toy_b_plugin", "b")):
        toy = BackendSpec(name="toy", provides={"paged_decode": REFERENCE.provides["paged_decode"]}, devices=("cpu",),
                          dtypes=(torch.float32,), priority=1, description=desc)

        @hookimpl
        def hook(register, toy=toy):
            register(toy)

        fake_module(module, mstar_register_backends=hook)
    fake_entry_points(make_ep("toy", "toy_a_plugin", "toy-a", "1.0"), make_ep("toy", "toy_b_plugin", "toy-b", "1.0"))
    reg = Registry()
    monkeypatch.setattr(cli, "get_registry", lambda: reg)
    return reg


def test_a_config_pin_settles_a_name_two_distributions_register(two_toys, run_json, tmp_path, capsys):
    data = run_json("--config", _toml(tmp_path, '[attention.pins]\ntoy = "toy-b"\n'))
    assert "toy" in data["auto"]["paged_decode"]["rejected"]  # auto alone passes the conflicted name over
    assert data["config"]["picks"]["paged_decode"] == {"asks": "auto", "pick": "toy", "error": None}
    named = run_json("--config", _toml(tmp_path, '[attention]\nbackend = "toy"\n'))["config"]["picks"]
    assert "registered by 2 distributions (toy-a 1.0 and toy-b 1.0)" in named["paged_decode"]["error"]
    # a pin to a distribution that does not register the name is the config's error
    assert main(["backends", "--device", "cpu", "--config", _toml(tmp_path, '[attention.pins]\ntoy = "toy-c"\n')]) == 2
    err = capsys.readouterr().err
    assert "backend 'toy' is pinned to distribution 'toy-c', which does not register it" in err and \
        err.count("\n") == 1
