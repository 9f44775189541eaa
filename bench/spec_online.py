"""Online adaptation (`--spec-online`) through a served cluster: acceptance after a workload shift.

One `splitserve serve` cluster (a prefill and a decode worker, KV over NIXL, gRPC) serves the default
model with its EAGLE-3 head and online adaptation on, k fixed at 4, greedy. The traffic starts as
prose (held-out chat prompts about documentation, bench/spec_training/smollm_data.py), then shifts
to code: raw completions of Python source files (the head was trained on chat answers, never on a
model continuing a source file). Every `--interval` seconds of code traffic, a fixed evaluation set
(completions of held-out stdlib files, bench/spec_training/corpus.py, never part of the code
traffic) is served alone, and its mean accepted length per verification is read from the decode
worker's Prometheus counters, with the live head version. The first evaluation runs right at the
shift, on the head live then (the base head, or one adapted to the prose): every later one is
compared with it (the same prompts, the same greedy output, so the acceptance moves with the head
alone). Also checked: every evaluation's output
equals the first's (a head never changes the output).

    python bench/spec_online.py                       # 10 minutes of code traffic after the shift
    python bench/spec_online.py --minutes 4 --interval 60
"""
from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.servers import free_port, start_splitserve   # noqa: E402
from bench.spec_training.corpus import iter_stdlib_files, split_files   # noqa: E402
from bench.spec_training.smollm_data import chat_ids, pydoc_prompts, usr_doc_prompts   # noqa: E402


def code_prompts(tok, files, n: int, chars: int = 700, offset: int = 0) -> list[list[int]]:
    """Completions of source files: `chars` characters from the middle of each (a line start)."""
    out = []
    for f in files:
        if len(f.text) < 3 * chars:
            continue
        start = f.text.find("\n", len(f.text) // 3 + offset) + 1
        out.append(tok.encode(f.text[start:start + chars]))
        if len(out) == n:
            break
    return out


async def serve(target: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[list[int]]:
    from router.client import AsyncClient
    client = AsyncClient(target)
    outs: list[list[int]] = [[] for _ in prompts]
    todo = iter(enumerate(prompts))

    async def stream():
        for i, prompt in todo:
            async for msg in client.stream(prompt, max_tokens=max_tokens, temperature=0.0):
                outs[i].extend(msg.token_ids)
    try:
        await asyncio.gather(*(stream() for _ in range(concurrency)))
    finally:
        await client.close()
    return outs


def scrape(url: str) -> tuple[float, float, int]:
    """The eagle proposer's accepted tokens and verifications (all workers), and the live head version."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf'^splitserve_spec_{name}_total\{{[^}}]*method="eagle"[^}}]*\}} (\S+)$',
                                                text, re.M))
    versions = [int(float(v)) for v in re.findall(r"^splitserve_spec_head_version\{[^}]*\} (\S+)$", text, re.M)]
    return total("accepted_tokens"), total("verify_steps"), max(versions, default=0)


def evaluate(target: str, url: str, prompts, max_tokens: int) -> tuple[float, int, list[list[int]]]:
    a0, s0, _ = scrape(url)
    outs = asyncio.run(serve(target, prompts, 4, max_tokens))
    time.sleep(2.5)     # the router's copy of an idle worker's counters: one idle poll behind at most
    a1, s1, version = scrape(url)
    return (a1 - a0) / max(1.0, s1 - s0), version, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="code traffic after the shift")
    ap.add_argument("--interval", type=float, default=90.0, help="seconds of code traffic between evaluations")
    ap.add_argument("--prose-seconds", type=float, default=60.0)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `splitserve serve` arguments")
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from cluster.config import default_model_dir
    model = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model)
    train_files, heldout_files = split_files(iter_stdlib_files())
    eval_set = code_prompts(tok, heldout_files, a.eval_prompts)
    traffic = code_prompts(tok, train_files[::3], 400)
    prose = [chat_ids(tok, p.text)[:768] for p in (usr_doc_prompts() + pydoc_prompts()) if p.heldout][:200]
    metrics_port = free_port()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    log = Path(tempfile.mkdtemp(prefix="spec-online-")) / "server.log"
    extra = ["--speculative", "eagle", "--num-speculative-tokens", "4", "--spec-online",
             "--metrics-port", str(metrics_port), *a.extra]
    server = start_splitserve("pd", model, log, None, extra_args=extra)
    print(f"model {model.name}; server log {log}; eval: {len(eval_set)} held-out source files, "
          f"{a.max_tokens} new tokens each; code traffic: {len(traffic)} other files", flush=True)
    try:
        t0, used = time.monotonic(), 0
        while time.monotonic() - t0 < a.prose_seconds:
            asyncio.run(serve(server.target, prose[used:used + 8] or prose[:8], 4, a.max_tokens))
            used += 8
        base, version, reference = evaluate(server.target, url, eval_set, a.max_tokens)
        print(f"{'min':>5} {'version':>7} {'accepted/step':>13} {'vs shift':>8} {'output = shift':>13}", flush=True)
        print(f"{0.0:5.1f} {version:7d} {base:13.3f} {'1.00x':>8} {'yes':>13}", flush=True)
        shift, cursor = time.monotonic(), 0
        while time.monotonic() - shift < a.minutes * 60:
            until = time.monotonic() + a.interval
            while time.monotonic() < until:
                batch = traffic[cursor % len(traffic):cursor % len(traffic) + 8]
                asyncio.run(serve(server.target, batch, 4, a.max_tokens))
                cursor += 8
            rate, version, outs = evaluate(server.target, url, eval_set, a.max_tokens)
            print(f"{(time.monotonic() - shift) / 60:5.1f} {version:7d} {rate:13.3f} {rate / base:7.2f}x "
                  f"{'yes' if outs == reference else 'NO':>13}", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
