"""Time from prefill done to decode ready, for one long prompt, pull with and without checksums.

    python bench/handoff.py [--model DIR] [--tokens 2000] [--transport nixl] [--repeats 3]

Two worker processes (tests/e2e/kv_worker.py: a real engine and a real transport each). Pull:
the producer prefills and publishes; the consumer reads, verifies (xxh3 per block) and waits for
the producer's ACK. Both report prefill + handoff. (The layer-wise push that overlapped the
transfer with the prefill was removed in issue #28: only tests and this script reached it.)
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch
    from cluster.config import default_model_dir
    from conftest import Worker, connect
    model = args.model or str(default_model_dir())
    block = 16
    n_blocks = 4 * (args.tokens // block + 2)
    kwargs = dict(block_size=block, num_blocks=n_blocks, dtype="bfloat16", max_batched_tokens=4096)
    p = Worker(model, args.transport, "bench-p", **kwargs)
    d = Worker(model, args.transport, "bench-d", **kwargs)
    try:
        connect(p, d)
        rows = {"pull": [], "pull, no checksum": []}
        for r in range(args.repeats + 1):
            for m, mode in enumerate(rows):
                # A fresh prompt for every run: no prefix-cache hits between modes.
                gen = torch.Generator().manual_seed(1000 * r + m)
                prompt = torch.randint(10, 8000, (args.tokens,), generator=gen).tolist()
                verify = mode != "pull, no checksum"
                p.call("set_verify", on=verify)
                d.call("set_verify", on=verify)
                rid = f"{mode}-{r}"
                pre = p.call("timed_prefill", rid=rid, prompt=prompt, timeout=300)
                out = d.call("pull", handle=pre["handle"], prompt=prompt, rid=rid, max_tokens=2, ready_only=True)
                total, handoff = pre["prefill_s"] + out["ready_s"], out["ready_s"]
                assert out["state"] == "done", out
                if r:   # the first round warms up
                    rows[mode].append((pre["prefill_s"], handoff, total))
        print(f"# {args.tokens}-token prompt, {Path(model).name}, bf16, transport {args.transport}; medians of "
              f"{args.repeats}")
        print(f"{'mode':>18} | {'prefill ms':>10} | {'done -> ready ms':>16} | {'total ms':>8}")
        for mode, vals in rows.items():
            pf, ho, tot = (statistics.median(v[i] for v in vals) * 1e3 for i in range(3))
            print(f"{mode:>18} | {pf:>10.1f} | {ho:>16.1f} | {tot:>8.1f}")
    finally:
        p.close()
        d.close()


if __name__ == "__main__":
    main()
