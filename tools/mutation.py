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
(so only mstar itself is imported again). A first run of each module's tests, split across the
workers, records which tests execute each line; a mutant then runs only those tests (all of them
for lines no test reached in-process, such as code run in a subprocess), the ones that caught most
slips per second first, stopping at the first failure. Each outcome goes to a journal as it comes,
so a run cut short goes on with --resume.

It is a tool to run before a change lands, not a CI step: a module takes minutes to hours.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
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
    """A pytest plugin: keep the named tests, in the given order; write the id of the first that fails."""

    def __init__(self, ids: list[str], killer: str) -> None:
        self.order = {t: i for i, t in enumerate(ids)}
        self.killer = killer
        self.named = False

    def pytest_runtest_logreport(self, report):  # type: ignore[no-untyped-def]
        if report.failed and not self.named:
            self.named = True
            Path(self.killer).write_text(report.nodeid)

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
    only = _Only(request["tests"], request["killer"])
    return int(pytest.main(_pytest_args(request["files"], stop_first=True), plugins=[only]))


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
        killer = Path(request.get("killer", ".mutation-killer"))
        killer.unlink(missing_ok=True)
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
        named = killer.read_text() if killer.exists() else ""
        print(json.dumps({"outcome": outcome, "seconds": time.perf_counter() - began, "tail": tail,
                          "killer": named}), flush=True)


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


def _test_files(tests: list[str], home: Path) -> list[Path]:
    """The test files under the map's entries (a folder stands for its ``test_*.py``), largest first."""
    files: list[Path] = []
    for t in tests:
        path = home / t
        found = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        files += [f for f in found if f not in files]
    return sorted(files, key=lambda f: -f.stat().st_size)


def trace(targets: list[Target], workers: list[Worker]) -> dict:
    """Run the targets' tests once, traced, split by file across the workers: which tests execute
    each line of each target, and how long each test takes. The targets share their tests."""
    files = _test_files(targets[0].tests, workers[0].home)
    shares: list[list[Path]] = [[] for _ in workers[:len(files)]]
    for i, f in enumerate(files):  # largest files dealt first, round and round
        shares[i % len(shares)].append(f)
    for w, share in zip(workers, shares, strict=False):
        w.send({"kind": "lines", "files": [str(w.home / f.relative_to(workers[0].home)) for f in share],
                "targets": [str(w.home / t.module) for t in targets], "out": str(w.home / ".mutation-lines.json"),
                "timeout": 3600}, None)
    merged: dict = {"hits": defaultdict(set), "seconds": {}}
    for w in workers[:len(shares)]:
        answer = w.answer()
        if answer["outcome"] != 0:
            raise SystemExit(f"{', '.join(t.module for t in targets)}: its tests do not pass unmutated (pytest exit "
                             f"{answer['outcome']}); fix them first:\n{answer['tail']}")
        data = json.loads((w.home / ".mutation-lines.json").read_text())
        for where, tests in data["hits"].items():
            # the workers' trees differ only in their root: key a line by its path in the tree
            merged["hits"][where.removeprefix(f"{w.home.resolve()}/")].update(tests)
        merged["seconds"].update(data["seconds"])
    return merged


class Journal:
    """Each slip's outcome as it comes, one JSON line, under the module's text: a run cut short goes
    on from there with ``--resume`` instead of planting its slips again."""

    def __init__(self, path: Path, source: str, commit: str) -> None:
        self.path = path
        self.head = {"sha256": hashlib.sha256(source.encode()).hexdigest(), "commit": commit}

    def load(self) -> tuple[str | None, dict[str, dict]]:
        """The commit of the run it holds and its outcomes by slip key; refused for another text."""
        if not self.path.exists():
            return None, {}
        lines = self.path.read_text().splitlines()
        head = json.loads(lines[0])
        if head["sha256"] != self.head["sha256"]:
            raise SystemExit(f"--resume: {self.path} was written for another text of its module; delete it or "
                             "run without --resume")
        done = {}
        for line in lines[1:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the last line of a run killed mid-write
                continue
            done[row["key"]] = row
        return head["commit"], done

    def start(self, keep: dict[str, dict], commit: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as f:
            f.write(json.dumps(dict(self.head, commit=commit)) + "\n")
            for row in keep.values():
                f.write(json.dumps(row) + "\n")

    def add(self, o: Outcome) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"key": o.mutant.key, "result": o.result, "seconds": round(o.seconds, 2),
                                "tests": o.tests, "detail": o.detail}) + "\n")


def run_module(target: Target, workers: list[Worker], progress: bool, data: dict, journal: Journal,
               only: tuple[str, set[str]] | None = None, resume: bool = False) -> tuple[list[Outcome], str | None]:
    """Every slip of ``target`` (``only``: (commit, keys): just those, the rest caught at that commit).
    Returns the outcomes and, when some came from a journal, the commit they were run at."""
    source = (ROOT / target.module).read_text()
    planted = list(mutants(target.module, source))
    seconds: dict[str, float] = data["seconds"]
    hits: dict[int, set[str]] = defaultdict(set)
    everywhere: set[int] = set()
    for where, tests in data["hits"].items():
        path, line = where.rsplit(":", 1)
        if path != target.module:
            continue
        real = {t for t in tests if t in seconds}
        hits[int(line)] |= real
        if len(real) < len(tests):
            everywhere.add(int(line))  # run at import: every test depends on it
    all_tests = sorted(seconds, key=seconds.__getitem__)
    total = sum(seconds.values())
    print(f"{target.module}: {len(planted)} mutants; its tests: {len(all_tests)} in {total:.1f} s", flush=True)

    then, done_before = journal.load() if resume else (None, {})
    if resume and then is None:
        print(f"  --resume: no journal of {target.module}; planting every slip", flush=True)
    journal.start(done_before, then or journal.head["commit"])
    queue: list[tuple[Mutant, list[str]]] = []
    outcomes: list[Outcome] = []
    for m in planted:
        if m.key in target.equivalent:
            outcomes.append(Outcome(m, "equivalent", 0.0, 0, target.equivalent[m.key]))
            continue
        if only is not None and m.key not in only[1]:
            outcomes.append(Outcome(m, "caught", 0.0, 0, f"caught at {only[0]}"))
            continue
        if m.key in done_before and done_before[m.key]["result"] != "survived":  # a survivor may meet new tests
            row = done_before[m.key]
            outcomes.append(Outcome(m, row["result"], row["seconds"], row["tests"], row["detail"]))
            continue
        lines = range(m.line, m.line + m.before.count("\n") + 1)
        reached = set().union(*(hits.get(n, set()) for n in lines))
        if any(n in everywhere for n in lines) or not reached:
            chosen = all_tests
        else:
            chosen = sorted(reached, key=seconds.__getitem__)
        queue.append((m, chosen))
    if done_before:
        print(f"  {len(done_before)} in the journal of the run at {then}; its survivors and the rest, "
              f"{len(queue)}, to plant", flush=True)

    # A test that caught slips before is the likeliest to catch the next: try tests by catches per
    # second (a new test counts one), so a caught slip costs its catching test, not all before it.
    kills: dict[str, int] = defaultdict(int)

    def order(chosen: list[str]) -> list[str]:
        return sorted(chosen, key=lambda t: -(kills[t] + 1) / (seconds[t] + 0.05))

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
                        "tests": order(chosen), "timeout": budget, "killer": str(w.home / ".mutation-killer")},
                       (m, len(chosen)))
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
                if a.get("killer"):
                    kills[a["killer"]] += 1
                outcomes.append(Outcome(m, result, a["seconds"], count, a["tail"][-600:]))
                journal.add(outcomes[-1])
                done += 1
                if progress:
                    rate = (time.monotonic() - began) / done
                    print(f"  [{done}/{len(queue)}] {result:8s} {m.describe()}  "
                          f"(~{rate * (len(queue) - done) / 60:.1f} min left)", flush=True)
    return outcomes, then


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


def write_report(path: Path, target: Target, outcomes: list[Outcome], commit: str, prior: str | None,
                 resumed: str | None = None) -> str:
    caught, counted = score(outcomes)
    by = defaultdict(int)
    for o in outcomes:
        by[o.result] += 1
    pct = 100.0 * caught / counted if counted else 0.0
    line = (f"{target.module}: {caught}/{counted} caught ({pct:.1f}%) at {commit}, {datetime.date.today()}; "
            + ", ".join(f"{k} {v}" for k, v in sorted(by.items())))
    rerun = [] if prior is None else [f"Only the survivors of the run at {prior} were planted again; the "
                                      "rest were caught there (the module is the same).", ""]
    if resumed is not None and resumed != commit:
        rerun += [f"Resumed: the slips caught before a run at {resumed} was cut short were caught there (the "
                  "module is the same); its survivors and the rest were planted at the commit above.", ""]
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
    parser.add_argument("--resume", action="store_true",
                        help="keep the outcomes in each module's journal in --out (a run cut short, same module "
                             "text) and plant the rest, its survivors again")
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
    traced: dict[tuple[str, ...], dict] = {}
    try:
        for t in chosen:
            key = tuple(t.tests)
            if key not in traced:  # once for every chosen module that shares these tests
                traced[key] = trace([c for c in chosen if tuple(c.tests) == key], workers)
            only = prior_survivors(out, t) if args.survivors else None
            journal = Journal(out / f"{slug(t)}.journal.jsonl", (ROOT / t.module).read_text(), commit)
            outcomes, resumed = run_module(t, workers, progress=not args.quiet, data=traced[key], journal=journal,
                                           only=only, resume=args.resume)
            summary.append(write_report(out / f"{slug(t)}.md", t, outcomes, commit, only and only[0], resumed))
            journal.path.unlink()  # the report holds it all now
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
