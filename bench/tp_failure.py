"""What a rank failing mid-run does to the other: two ranks of `mstar bench --tp 2`, started by
this script (not torchrun, which would kill the survivor itself), rank 1 raising at its Nth
step. Prints, per rank, the exit status, the seconds it ran and the end of its stderr.

    python3 bench/tp_failure.py [--graphs] [--timeout 20] [--device cuda] [--fail-at 10] [--out DIR]

With --out, also writes tp_failure-graphs or tp_failure-eager (.json, .md) there. Target: neither
rank hangs; rank 0 ends within the timeout plus the watchdog's grace after rank 1 failed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def child(fail_at: int, argv: list[str]) -> int:
    from mstar_core import GraphRunner, cli

    if os.environ["RANK"] == "1":
        real, calls = GraphRunner.launch, 0

        def launch(self, *a, **kw):
            nonlocal calls
            calls += 1
            if calls == fail_at:
                raise ValueError(f"rank 1 fails on purpose at its step {fail_at}")
            return real(self, *a, **kw)

        GraphRunner.launch = launch
    return cli.main(argv)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fail-at", type=int, default=10)
    ap.add_argument("--out", default=None, help="also write the result and its targets here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    argv = ["bench", "--tp", "2", "--device", a.device, "--tp-timeout", str(a.timeout), "--steps", "200",
            "--layers", "2", "--hidden", "1024", "--qo-heads", "8", "--kv-heads", "2", "--head-dim", "128",
            *(["--graphs", "--preplan"] if a.graphs else [])]
    if a.child:
        return child(a.fail_at, argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, t0 = [], time.monotonic()
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, __file__, "--child", "--fail-at", str(a.fail_at), "--timeout", str(a.timeout),
               "--device", a.device, *(["--graphs"] if a.graphs else [])]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True))
    ended: dict[int, float] = {}
    deadline = t0 + 4 * a.timeout + 120
    while len(ended) < 2 and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.monotonic() - t0
        time.sleep(0.05)
    out = {"graphs": a.graphs, "timeout_s": a.timeout, "fail_at": a.fail_at, "ranks": {}}
    for r, p in enumerate(procs):
        hung = r not in ended
        if hung:
            p.kill()
        err = p.communicate()[1]
        tail = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("  ")][-3:]
        out["ranks"][r] = {"exit": None if hung else p.returncode, "seconds": round(ended.get(r, float("nan")), 1),
                           "hung": hung, "stderr_tail": tail}
    print(json.dumps(out, indent=2))
    if a.out:
        write(a.out, out)
    return 0


def write(folder: str, out: dict) -> None:
    import report

    from mstar_core.distributed import STALL_GRACE_S

    r0, r1 = out["ranks"][0], out["ranks"][1]
    lag = r0["seconds"] - r1["seconds"]
    out["targets"] = {
        "no rank hangs": report.target(not (r0["hung"] or r1["hung"]), "both end", not (r0["hung"] or r1["hung"])),
        "rank 0 ends after rank 1 failed (s)": report.target(lag, f"< timeout + {STALL_GRACE_S:g} s grace",
                                                             lag < out["timeout_s"] + STALL_GRACE_S),
    }
    out["env"] = report.environment()
    mode = "graphs" if out["graphs"] else "eager"
    report.write(folder, f"tp_failure-{mode}", out, [
        f"# A rank failing mid-run ({mode}, rank 1 raises at its step {out['fail_at']}, "
        f"timeout {out['timeout_s']:g} s)",
        "", report.environment_line(out["env"]), "",
        *report.table(("rank", "exit", "seconds", "hung", "stderr tail"),
                      ((r, x["exit"], x["seconds"], x["hung"], " / ".join(x["stderr_tail"]))
                       for r, x in out["ranks"].items())),
        "", *report.targets_table(out["targets"])], echo=False)


if __name__ == "__main__":
    sys.exit(main())
