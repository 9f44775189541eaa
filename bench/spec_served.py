"""Speculative decoding through a served cluster, side by side with plain decoding in one run.

One `splitserve serve` cluster (a prefill and a decode worker, KV over NIXL, the gRPC API) serves
the default model with a model proposer loaded (`--server-method`); every request names its own
proposer (`SamplingParams.speculative`: "off", "ngram", "jacobi" or the server's), so all of them
run against the same server, round-robin per round, on held-out chat prompts
(bench/spec_training/smollm_data.py: never trained on). Greedy; answers end at the model's eos or
--max-tokens. Reports per concurrency and method: output tokens/s (all streams' tokens over the
level's wall time), the ratio to plain decoding, acceptance (from the decode worker's Prometheus
counters) and whether every output equals plain decoding's.

    python bench/spec_served.py                                   # eagle server: off ngram jacobi eagle at 1 and 8
    python bench/spec_served.py --server-method quantspec --methods off quantspec
    python bench/spec_served.py --methods off eagle --concurrency 1 2 4 8 16 32 --prompts 8   # the collapse sweep
"""
from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.servers import free_port, start_splitserve   # noqa: E402
from bench.spec_training.smollm_data import chat_ids, heldout_prompts   # noqa: E402


async def level(target: str, prompts: list[list[int]], concurrency: int, method: str, max_tokens: int,
                lookahead: str) -> tuple[float, list[list[int]]]:
    from router.client import AsyncClient
    client = AsyncClient(target)
    outs: list[list[int]] = [[] for _ in prompts]
    todo = iter(enumerate(prompts))
    if method == "off" or lookahead == "server":   # "server": no k named, as an OpenAI chat request
        la = {}
    else:
        la = {"auto_lookahead": True} if lookahead == "auto" else {"num_speculative_tokens": int(lookahead)}

    async def stream():
        for i, prompt in todo:
            async for msg in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, speculative=method, **la):
                outs[i].extend(msg.token_ids)
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(stream() for _ in range(concurrency)))
    finally:
        await client.close()
    return time.perf_counter() - t0, outs


def spec_counters(metrics_url: str) -> dict[str, dict[str, float]]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in re.findall(r"^splitserve_spec_(\w+)_total\{([^}]*)\} (\S+)$", text, re.M):
        method = re.search(r'method="([^"]+)"', labels)
        if method:
            bucket = out.setdefault(method.group(1), {})
            bucket[name] = bucket.get(name, 0.0) + float(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-method", default="eagle", help="the model proposer the server loads")
    ap.add_argument("--methods", nargs="+", default=["off", "ngram", "jacobi", "eagle"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per level (at least 2 per stream)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--lookahead", default="auto", help="k, or auto (each request names it), or server: requests "
                                                      "name none and get the server's default k (4)")
    ap.add_argument("--colocated", action="store_true", help="a colocated cluster instead of 1P1D")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per level; the median tokens/s is shown")
    ap.add_argument("--dtype", default="auto", help="the server's --dtype (auto: the model's own, float32 here)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `splitserve serve` arguments")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from cluster.config import default_model_dir
    model = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model)
    pool = [chat_ids(tok, p.text)[:1024] for p in heldout_prompts(max(a.prompts, 2 * max(a.concurrency)) * a.rounds)]
    metrics_port = free_port()
    log = Path(tempfile.mkdtemp(prefix="spec-served-")) / "server.log"
    server_k = "4" if a.lookahead == "server" else a.lookahead
    extra = ["--dtype", a.dtype, "--speculative", a.server_method, "--num-speculative-tokens", server_k,
             "--metrics-port", str(metrics_port), *a.extra]
    server = start_splitserve("colocated" if a.colocated else "pd", model, log, None, extra_args=extra)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        asyncio.run(level(server.target, pool[:2], 2, "off", 16, a.lookahead))   # warm-up
        print(f"model {model.name}, server --speculative {a.server_method} --num-speculative-tokens {a.lookahead} "
              f"--dtype {a.dtype}; {a.rounds} rounds, max {a.max_tokens} new tokens")
        print(f"{'conc':>4} {'method':>9} {'tok/s':>8} {'vs off':>7} {'accept':>7} {'tok/step':>8} {'= off':>6}")
        for conc in a.concurrency:
            n = max(a.prompts, 2 * conc)
            rates = {m: [] for m in a.methods}
            before = spec_counters(metrics_url)
            equal = {m: True for m in a.methods}
            for r in range(a.rounds):
                prompts = pool[r * n:(r + 1) * n] or pool[:n]
                order = a.methods[r % len(a.methods):] + a.methods[:r % len(a.methods)]
                outs = {}
                for m in order:
                    seconds, outs[m] = asyncio.run(level(server.target, prompts, conc, m, a.max_tokens, a.lookahead))
                    rates[m].append(sum(map(len, outs[m])) / seconds)
                for m in a.methods:
                    equal[m] &= outs[m] == outs.get("off", outs[m])
            after = spec_counters(metrics_url)
            base = statistics.median(rates["off"]) if "off" in rates else None
            for m in a.methods:
                c = {k: after.get(m, {}).get(k, 0.0) - before.get(m, {}).get(k, 0.0)
                     for k in ("draft_tokens", "accepted_tokens", "verify_steps", "emitted_tokens")}
                acc = c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else float("nan")
                per_step = c["emitted_tokens"] / c["verify_steps"] if c["verify_steps"] else float("nan")
                rate = statistics.median(rates[m])
                ratio = f"{rate / base:6.2f}x" if base else "-"
                print(f"{conc:>4} {m:>9} {rate:8.1f} {ratio:>7} {acc:7.3f} {per_step:8.2f} "
                      f"{'yes' if equal[m] else 'NO':>6}", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
