"""`bench/serve_vs_vllm.py` on two checkouts of splitserve, alternated, printed side by side.

    python bench/before_after.py --before /path/to/old/checkout [--rounds 2] [--modes colocated pd]
        [-- serve_vs_vllm arguments...]

For a change that must leave serving speed alone (a refactor): each round runs the old tree's
serve_vs_vllm.py in the old tree and this tree's in this tree, one after the other (never at the same
time), with the same arguments, so that a machine's drift lands on both. Prints per mode and
concurrency the output tok/s of every run and the ratio after/before of their medians. Each run's
own JSON and logs stay under --out/{before,after}-N.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run_tree(tree: Path, out: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "bench" / "serve_vs_vllm.py"), "--out", str(out), *args]
    print("$", " ".join(cmd), f"(in {tree})", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads((out / "serve_vs_vllm.json").read_text())["modes"]


def tok_s(result: dict) -> dict[tuple[str, str], float]:
    return {(mode, str(c)): level["output_tok_s"] for mode, m in result.items() for c, level in m["levels"].items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the old checkout (its own bench/serve_vs_vllm.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "bench" / "results" / "before_after")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for serve_vs_vllm.py (after --)")
    a = ap.parse_args()
    rest = [x for x in a.rest if x != "--"] or ["--modes", "colocated", "pd", "--no-engine-baseline"]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(a.rounds):
        for name, tree in (("before", a.before.resolve()), ("after", HERE)):
            runs[name].append(tok_s(run_tree(tree, a.out / f"{name}-{i}", rest)))
    keys = sorted(runs["after"][0], key=lambda k: (k[0], int(k[1])))
    print(f"{'mode':<12} {'conc':>4}  {'before tok/s':>24}  {'after tok/s':>24}  after/before (medians)")
    for key in keys:
        before = [r[key] for r in runs["before"] if key in r]
        after = [r[key] for r in runs["after"]]
        ratio = statistics.median(after) / statistics.median(before) if before else float("nan")
        print(f"{key[0]:<12} {key[1]:>4}  {' '.join(f'{x:7.1f}' for x in before):>24}  "
              f"{' '.join(f'{x:7.1f}' for x in after):>24}  {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
