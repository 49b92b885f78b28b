"""Mutation testing: plant one slip at a time in a module and run the tests that reach it.

    python tools/mutation.py mstar_core/sampling.py mstar_core/kv/   # modules, or folders of them
    python tools/mutation.py --list                                  # what tools/mutation.toml maps

A slip (tools/mutants.py says which) is *caught* when a test fails or hangs with it planted. Each
module's tests are named in tools/mutation.toml, with the slips that change nothing a caller can
observe (equivalent) listed beside them and why. The score per module is caught / (planted -
equivalent); the report lists every slip that survived with its line, so it can be read as a list
of missing tests.

How it stays fast on 2 cores: each worker owns a copy of the tree and a process that has imported
torch, pytest and transformers once; a mutant is written into the copy and run in a forked child
(so only mstar itself is imported again). A first run of each module's tests records which tests
execute each line; a mutant then runs only those tests (all of them for lines no test reached
in-process, such as code run in a subprocess), fastest first, stopping at the first failure.

It is a tool to run before a change lands, not a CI step: a module takes minutes to hours.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from mutants import Mutant, mutants  # noqa: E402

CONFIG = ROOT / "tools" / "mutation.toml"
PRELOAD = ("torch", "numpy", "pytest", "hypothesis", "pluggy", "transformers")


# -- the worker: a forking server in its own copy of the tree -------------------------------------


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        out = dest / name.decode()
        if src.is_symlink():  # a plugin's package is a link to the top-level one: keep it a link
            out.parent.mkdir(parents=True, exist_ok=True)
            out.symlink_to(os.readlink(src))
        elif src.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)


class _Lines:
    """A pytest plugin: which tests execute which lines of the target files."""

    def __init__(self, files: set[str]) -> None:
        self.files = files
        self.current = "<collection>"
        self.hits: dict[str, set[str]] = defaultdict(set)  # "file:line" -> test ids
        self.seconds: dict[str, float] = {}

    def _local(self, frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "line":
            self.hits[f"{frame.f_code.co_filename}:{frame.f_lineno}"].add(self.current)
        return self._local

    def _global(self, frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code.co_filename in self.files:
            self.hits[f"{frame.f_code.co_filename}:{frame.f_lineno}"].add(self.current)
            return self._local
        return None

    def start(self) -> None:
        import threading
        sys.settrace(self._global)
        threading.settrace(self._global)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):  # type: ignore[no-untyped-def]
        self.current = item.nodeid
        began = time.perf_counter()
        result = yield
        self.seconds[item.nodeid] = time.perf_counter() - began
        self.current = "<between>"
        return result

    def pytest_runtest_logreport(self, report):  # type: ignore[no-untyped-def]
        if report.failed:
            self.hits.setdefault("<failed>", set()).add(report.nodeid)


class _Only:
    """A pytest plugin: keep the named tests, in the given order."""

    def __init__(self, ids: list[str]) -> None:
        self.order = {t: i for i, t in enumerate(ids)}

    def pytest_collection_modifyitems(self, session, config, items):  # type: ignore[no-untyped-def]
        kept = [i for i in items if i.nodeid in self.order]
        kept.sort(key=lambda i: self.order[i.nodeid])
        items[:] = kept


def _pytest_args(files: list[str], stop_first: bool) -> list[str]:
    # no:unraisableexception: its collections of the whole (frozen) heap at exit cost a second a run
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception", "-p", "no:threadexception",
            "-o", "addopts=--import-mode=importlib",
            "--no-header", "-W", "ignore"]
    return args + (["-x"] if stop_first else []) + files


def _child(request: dict, log: str) -> int:
    """In the forked child: run pytest as asked; the exit code is pytest's."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.setsid()  # its own group: a timeout kills the subprocesses its tests started too
    import torch
    torch.set_num_threads(1)
    if request["kind"] == "lines":
        tracer = _Lines({str(Path(p).resolve()) for p in request["targets"]})
        tracer.start()
        code = pytest.main(_pytest_args(request["files"], stop_first=False), plugins=[tracer])
        sys.settrace(None)
        home = os.getcwd()
        theirs = sorted(name for name, mod in list(sys.modules.items())
                        if not (getattr(mod, "__file__", None) or home).startswith(home))
        with open(request["out"], "w") as f:
            json.dump({"hits": {k: sorted(v) for k, v in tracer.hits.items()}, "seconds": tracer.seconds,
                       "modules": theirs}, f)
        return int(code)
    return int(pytest.main(_pytest_args(request["files"], stop_first=True), plugins=[_Only(request["tests"])]))


def serve() -> None:
    """The worker's loop: one JSON request a line on stdin, one JSON answer a line on stdout."""
    _preload(list(PRELOAD))
    stamp = time.time()
    sys.path.insert(0, os.getcwd())
    log = os.path.join(os.getcwd(), ".mutation-child.log")
    for line in sys.stdin:
        request = json.loads(line)
        path = Path(request.get("path", ""))
        original = path.read_text() if request.get("source") is not None else None
        if original is not None:
            stamp = _write(path, request["source"], stamp)
        began = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = _child(request, log)
            finally:
                os._exit(code)
        outcome = _wait(pid, request["timeout"])
        if original is not None:
            stamp = _write(path, original, stamp)
        if request["kind"] == "lines" and outcome == 0:
            _preload(json.loads(Path(request["out"]).read_text())["modules"])
        tail = ""
        if outcome not in (0, 1, "timeout"):
            tail = Path(log).read_text(errors="replace")[-2000:]
        print(json.dumps({"outcome": outcome, "seconds": time.perf_counter() - began, "tail": tail}), flush=True)


def _write(path: Path, text: str, stamp: float) -> float:
    """Each write a newer mtime than the last: a cached .pyc of another version never passes for it."""
    path.write_text(text)
    stamp += 2.0
    os.utime(path, (stamp, stamp))
    return stamp


def _preload(names: list[str]) -> None:
    """Import, once, every library module the tests imported (not the tree's own): a forked child
    then imports only mstar and its tests."""
    for name in names:
        if name not in sys.modules and not name.startswith("__mp_main__"):
            try:
                __import__(name)
            except Exception:  # a module that only imports in some contexts: the child imports it itself
                pass
    gc.freeze()  # what is loaded now is never collected: a child's collections skip it


def _wait(pid: int, timeout: float) -> int | str:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
                time.sleep(0.5)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


class Worker:
    def __init__(self, home: Path) -> None:
        self.home = home
        _copy_tree(home)
        env = dict(os.environ, PYTHONPATH=str(home), OMP_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, str(home / "tools" / "mutation.py"), "--serve"], cwd=home,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.busy: tuple[object, float] | None = None

    def send(self, request: dict, tag: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        self.busy = (tag, time.monotonic())

    def answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mutation worker in {self.home} stopped")
        self.busy = None
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


# -- the driver -----------------------------------------------------------------------------------


@dataclass
class Target:
    module: str
    tests: list[str]
    equivalent: dict[str, str] = field(default_factory=dict)


def load_config() -> dict[str, Target]:
    raw = tomllib.loads(CONFIG.read_text())
    targets = {}
    for module, entry in raw["modules"].items():
        unknown = set(entry) - {"tests", "equivalent"}
        if unknown:
            raise SystemExit(f"{CONFIG.name}: {module}: unknown keys {sorted(unknown)} (known: tests, equivalent)")
        eq = {e["key"]: e["why"] for e in entry.get("equivalent", [])}
        targets[module] = Target(module, list(entry["tests"]), eq)
    return targets


def pick(targets: dict[str, Target], asked: list[str]) -> list[Target]:
    chosen: list[Target] = []
    for a in asked:
        a = a.rstrip("/")
        found = [t for m, t in targets.items() if m == a or m.startswith(a + "/")]
        if not found:
            raise SystemExit(f"no module in {CONFIG.name} is or lies under {a!r}; known: {', '.join(targets)}")
        chosen += [t for t in found if t not in chosen]
    return chosen


@dataclass
class Outcome:
    mutant: Mutant
    result: str  # caught, timeout, crashed, survived, equivalent, error (pytest's own: exit 5 and up)
    seconds: float
    tests: int
    detail: str = ""


def slug(target: Target) -> str:
    return target.module.replace("/", ".").removesuffix(".py")


def prior_survivors(out: Path, target: Target) -> tuple[str, set[str]]:
    """The commit of ``target``'s last report and the keys of the slips that survived there.
    Refused when the module changed since (its other slips were caught in another text)."""
    path = out / f"{slug(target)}.md"
    if not path.exists():
        raise SystemExit(f"--survivors: no report of {target.module} in {out}; run it whole first")
    text = path.read_text()
    commit = text.split(" at ", 1)[1].split(",", 1)[0].split(" ")[0]
    then = subprocess.run(["git", "show", f"{commit.removesuffix('+changes')}:{target.module}"], cwd=ROOT,
                          capture_output=True, text=True)
    if commit.endswith("+changes") or then.returncode or then.stdout != (ROOT / target.module).read_text():
        raise SystemExit(f"--survivors: {target.module} is not what its report at {commit} planted in; run it whole")
    survived = text.split("## survived", 1)[1].split("\n## ", 1)[0] if "## survived" in text else ""
    return commit, set(re.findall(r"key: `(.*)`", survived))


def run_module(target: Target, workers: list[Worker], progress: bool,
               only: tuple[str, set[str]] | None = None) -> list[Outcome]:
    """Every slip of ``target`` (``only``: (commit, keys): just those, the rest caught at that commit)."""
    source = (ROOT / target.module).read_text()
    planted = list(mutants(target.module, source))
    w0 = workers[0]
    out = w0.home / ".mutation-lines.json"
    base_files = [str(w0.home / t) for t in target.tests]
    w0.send({"kind": "lines", "files": base_files, "targets": [str(w0.home / target.module)], "out": str(out),
             "timeout": 3600}, None)
    answer = w0.answer()
    if answer["outcome"] != 0:
        raise SystemExit(f"{target.module}: its tests do not pass unmutated (pytest exit {answer['outcome']}); "
                         f"fix them first:\n{answer['tail']}")
    data = json.loads(out.read_text())
    seconds: dict[str, float] = data["seconds"]
    hits: dict[int, set[str]] = defaultdict(set)
    everywhere: set[int] = set()
    for where, tests in data["hits"].items():
        line = int(where.rsplit(":", 1)[1])
        real = {t for t in tests if t in seconds}
        hits[line] |= real
        if len(real) < len(tests):
            everywhere.add(line)  # run at import: every test depends on it
    all_tests = sorted(seconds, key=seconds.__getitem__)
    total = sum(seconds.values())
    print(f"{target.module}: {len(planted)} mutants; its tests: {len(all_tests)} in {total:.1f} s", flush=True)

    queue: list[tuple[Mutant, list[str]]] = []
    outcomes: list[Outcome] = []
    for m in planted:
        if m.key in target.equivalent:
            outcomes.append(Outcome(m, "equivalent", 0.0, 0, target.equivalent[m.key]))
            continue
        if only is not None and m.key not in only[1]:
            outcomes.append(Outcome(m, "caught", 0.0, 0, f"caught at {only[0]}"))
            continue
        lines = range(m.line, m.line + m.before.count("\n") + 1)
        reached = set().union(*(hits.get(n, set()) for n in lines))
        if any(n in everywhere for n in lines) or not reached:
            chosen = all_tests
        else:
            chosen = sorted(reached, key=seconds.__getitem__)
        queue.append((m, chosen))

    pending = list(queue)
    done = 0
    began = time.monotonic()
    while pending or any(w.busy for w in workers):
        for w in workers:
            if w.busy is None and pending:
                m, chosen = pending.pop(0)
                files = sorted({str(w.home / t.split("::")[0]) for t in chosen})
                budget = 30.0 + 3.0 * sum(seconds[t] for t in chosen)
                w.send({"kind": "mutant", "path": str(w.home / m.module), "source": m.source, "files": files,
                        "tests": chosen, "timeout": budget}, (m, len(chosen)))
        busy = [w for w in workers if w.busy]
        ready, _, _ = select.select([w.proc.stdout for w in busy], [], [])
        for w in busy:
            if w.proc.stdout in ready:
                assert w.busy is not None
                tag = w.busy[0]
                assert isinstance(tag, tuple)
                m, count = tag
                a = w.answer()
                result = _result(a["outcome"])
                outcomes.append(Outcome(m, result, a["seconds"], count, a["tail"][-600:]))
                done += 1
                if progress:
                    rate = (time.monotonic() - began) / done
                    print(f"  [{done}/{len(queue)}] {result:8s} {m.describe()}  "
                          f"(~{rate * (len(queue) - done) / 60:.1f} min left)", flush=True)
    return outcomes


def _result(outcome: int | str) -> str:
    """pytest's exit: 0 all passed (survived), 1 a test failed, 2-4 collection or a conftest
    failed to import (the slip breaks import: caught); a signal (a crash) is caught too."""
    if outcome == "timeout":
        return "timeout"
    if outcome == 0:
        return "survived"
    if outcome in (1, 2, 3, 4):
        return "caught"
    return "crashed" if isinstance(outcome, int) and outcome < 0 else "error"


def score(outcomes: list[Outcome]) -> tuple[int, int]:
    counted = [o for o in outcomes if o.result != "equivalent"]
    caught = [o for o in counted if o.result in ("caught", "timeout", "crashed")]
    return len(caught), len(counted)


def write_report(path: Path, target: Target, outcomes: list[Outcome], commit: str, prior: str | None) -> str:
    caught, counted = score(outcomes)
    by = defaultdict(int)
    for o in outcomes:
        by[o.result] += 1
    pct = 100.0 * caught / counted if counted else 0.0
    line = (f"{target.module}: {caught}/{counted} caught ({pct:.1f}%) at {commit}, {datetime.date.today()}; "
            + ", ".join(f"{k} {v}" for k, v in sorted(by.items())))
    rerun = [] if prior is None else [f"Only the survivors of the run at {prior} were planted again; the "
                                      "rest were caught there (the module is the same).", ""]
    lines = [f"# {target.module} at {commit}, {datetime.date.today()}", "", line, "", *rerun,
             f"tests: {', '.join(target.tests)}", ""]
    for kind in ("survived", "error"):
        rows = [o for o in outcomes if o.result == kind]
        if rows:
            lines += [f"## {kind} ({len(rows)})", ""]
            for o in sorted(rows, key=lambda o: o.mutant.line):
                lines.append(f"- {o.mutant.describe()}  key: `{o.mutant.key}`")
                if kind == "error":
                    lines.append(f"  {o.detail!r}")
            lines.append("")
    eq = [o for o in outcomes if o.result == "equivalent"]
    if eq:
        lines += [f"## equivalent ({len(eq)})", ""]
        lines += [f"- {o.mutant.describe()}: {o.detail}" for o in sorted(eq, key=lambda o: o.mutant.line)]
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python tools/mutation.py")
    parser.add_argument("modules", nargs="*", help="modules or folders named in tools/mutation.toml")
    parser.add_argument("--list", action="store_true", help="the modules mapped, their tests and mutant counts")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(ROOT / "results" / "cpu" / "mutation"),
                        help="folder for one report per module and summary.txt")
    parser.add_argument("--quiet", action="store_true", help="no line per mutant")
    parser.add_argument("--survivors", action="store_true",
                        help="plant only the slips that survived in each module's last report in --out (after "
                             "adding tests; refused where the module changed since)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    targets = load_config()
    if args.list:
        for t in targets.values():
            n = sum(1 for _ in mutants(t.module, (ROOT / t.module).read_text()))
            print(f"{t.module}: {n} mutants, {len(t.equivalent)} equivalent; tests {' '.join(t.tests)}")
        return 0
    if not args.modules:
        parser.error("name modules or folders (or --list)")
    chosen = pick(targets, args.modules)
    out = Path(args.out)
    if args.survivors:
        for t in chosen:
            prior_survivors(out, t)  # refused before any worker starts
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "mstar_core", "tests"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    commit += "+changes" if dirty else ""
    scratch = Path(tempfile.mkdtemp(prefix="mstar-mutation-"))
    workers = [Worker(scratch / f"w{i}") for i in range(max(1, args.workers))]
    summary = []
    try:
        for t in chosen:
            only = prior_survivors(out, t) if args.survivors else None
            outcomes = run_module(t, workers, progress=not args.quiet, only=only)
            summary.append(write_report(out / f"{slug(t)}.md", t, outcomes, commit, only and only[0]))
            print(summary[-1], flush=True)
    finally:
        for w in workers:
            w.close()
        shutil.rmtree(scratch, ignore_errors=True)
    stamp = "# mutation scores: caught / (planted - equivalent), per module (python tools/mutation.py)"
    prior = (out / "summary.txt").read_text().splitlines() if (out / "summary.txt").exists() else []
    keep = [p for p in prior[1:] if p and not any(p.startswith(t.module + ":") for t in chosen)]
    (out / "summary.txt").write_text("\n".join([stamp, *sorted(keep + summary)]) + "\n")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
