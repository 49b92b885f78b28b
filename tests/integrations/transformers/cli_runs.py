"""``mstar generate`` run in-process by the CLI tests: its JSON report, or the last line of the
error it exits with (never a traceback)."""

from __future__ import annotations

import json

from mstar_core.cli import main


def run_json(capsys, *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def fails(capsys, *argv: str) -> str:
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def run_text(capsys, *argv: str) -> tuple[str, str]:
    """``mstar generate``'s text report: (stdout, stderr)."""
    assert main(["generate", *argv]) == 0, capsys.readouterr().err
    got = capsys.readouterr()
    return got.out, got.err
