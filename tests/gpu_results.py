"""Where the GPU tests put what they measured: ``$OUT/<name>.json`` (nothing without ``OUT``),
with the device and the versions of the libraries that ran."""

from __future__ import annotations

import json
import os
import pathlib
from importlib.metadata import PackageNotFoundError, version

import torch


def write_results(name: str, results: list[dict], distributions: tuple[str, ...]) -> None:
    out = os.environ.get("OUT")
    if not out or not results:
        return
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in distributions:
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:  # the version is informative only
            info[dist] = "not installed"
    p = pathlib.Path(out) / f"{name}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"info": info, "results": results}, indent=1))
