"""The table of `bench/gpu_issue16.sh`'s bench runs: one row per (batch, mode, tp) from the JSON
each `mstar bench --json` printed, and tp 2's speed-up over tp 1.

    python3 bench/tp_summary.py DIR   (reads DIR/bench-*.txt; prints markdown)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path) -> dict | None:
    text = path.read_text()
    try:  # the JSON object is what the run printed on stdout; stderr lines may surround it
        return json.loads(text[text.index("{"): text.rindex("}") + 1])
    except ValueError:
        return None


def main(d: str) -> int:
    rows = {}
    for p in sorted(Path(d).glob("bench-*.txt")):
        r = load(p)
        if r is None:
            print(f"<!-- {p.name}: no result -->")
            continue
        mode = "graphs+preplan" if r["graphs"] else "eager"
        rows[(r["options"]["batch"], mode, r["tp"])] = r
    if not rows:
        return 1
    some = next(iter(rows.values()))
    o = some["options"]
    print(f"model: {o['layers']} layers, hidden {o['hidden']}, MLP {2 * o['hidden']}, {o['qo_heads']} query / "
          f"{o['kv_heads']} KV heads of {o['head_dim']}, context {o['context']}, {some['dtype']}, backend "
          f"{some['backend']}; {o['steps']} timed steps after {o['warmup']}\n")
    print("| batch | mode | tp | median step ms | tokens/s | host ms | GPU step ms | all-reduces alone ms | share | "
          "speed-up vs tp 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (batch, mode, tp), r in sorted(rows.items()):
        base = rows.get((batch, mode, 1))
        up = f"{base['median_step_ms'] / r['median_step_ms']:.2f}x" if base and tp != 1 else ""
        gpu = f"{r['gpu_step_ms']:.3f}" if r["gpu_step_ms"] is not None else "-"
        ar = f"{r['allreduce_ms']:.3f}" if r["allreduce_ms"] is not None else "-"
        share = f"{r['allreduce_share']:.0%}" if r["allreduce_share"] is not None else "-"
        print(f"| {batch} | {mode} | {tp} | {r['median_step_ms']:.3f} | {r['tokens_per_s']:.0f} | "
              f"{r['median_host_ms']:.3f} | {gpu} | {ar} | {share} | {up} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
