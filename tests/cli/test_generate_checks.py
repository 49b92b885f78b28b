"""``mstar generate``'s checks that come before transformers is imported or the model is read:
a misspelt backend (from the flag, the environment or a config), a bad ``--dtype`` or ``--compile``
flag fails at once, naming what would do. They run without the transformers extra."""

from __future__ import annotations

import pytest

from mstar_core.cli import main


@pytest.mark.parametrize("argv, env, config, message", [
    (["--backend", "refrence"], None, None, "attention backend 'refrence' (from argument) is unknown"),
    ([], "refrence", None, "attention backend 'refrence' (from env MSTAR_ATTENTION_BACKEND) is unknown"),
    ([], None, '[attention]\nbackend = "refrence"\n', "attention backend 'refrence' (from config) is unknown"),
    ([], None, '[attention.backend]\npaged_decode = "refrence"\n',
     "attention backend 'refrence' (from config, for paged_decode) is unknown"),
])
def test_a_backend_name_is_checked_before_the_model_is_read(tmp_path, capsys, monkeypatch, argv, env, config,
                                                             message):
    if env is not None:
        monkeypatch.setenv("MSTAR_ATTENTION_BACKEND", env)
    else:
        monkeypatch.delenv("MSTAR_ATTENTION_BACKEND", raising=False)
    if config is not None:
        (tmp_path / "c.toml").write_text(config)
        argv = [*argv, "--config", str(tmp_path / "c.toml")]
    # the model path does not exist: the backend's error comes first, so nothing was read
    assert main(["generate", str(tmp_path / "never-read"), "--prompt", "1", "--ids", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "Known backends:" in err and "(did you mean 'reference'?)" in err  # the names that would do


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "bf16"], "--dtype 'bf16' is not supported (did you mean 'bfloat16'?); choose one of auto, "),
    (["--compile", "--compile-backend", "inducter"],
     "--compile-backend 'inducter' is not a torch.compile backend (did you mean 'inductor'?)"),
    (["--compile", "--compile-backend", "eager", "--no-graphs"],
     "--compile compiles the graph steps and --no-graphs turns them off"),
])
def test_dtype_and_compile_flags_are_checked_before_the_model_is_read(tmp_path, capsys, argv, message):
    assert main(["generate", str(tmp_path / "never-read"), "--prompt", "1", "--ids", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
