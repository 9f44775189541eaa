"""Test-time compute: quality against compute, through a served cluster's `test_time` extension.

The default model (SmolLM2-135M-Instruct, its GGUF) answers short arithmetic questions with known
answers (`QUESTIONS`: fixed, sums, differences and small products), as chat requests over the
OpenAI API of one `splitserve serve` cluster (colocated by default; `--pd` for 1 prefill + 1
decode worker). The answer is the last integer of a reply (`ANSWER`, the vote's answer_pattern).
For each configuration it prints the accuracy, the completion tokens (every sample's, as `usage`
counts them), the samples run and the wall time:

  greedy          one sample at temperature 0
  majority@N      N samples at --temperature, the most frequent answer
  best_of@N       N samples, the highest mean token logprob
  early@N         majority@N with early_stop (a first wave of 3, the rest only if the vote is open)

and the tokens early stop saved against majority@N, with the accuracy each kept.

    PYTHONPATH=. python bench/test_time.py [--samples 5] [--questions 16] [--temperature 0.7] [--pd]

docs/test_time.md has the figures.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.servers import REPO, Server, _http_healthy, _spawn, _wait_ready, free_port   # noqa: E402
from router.test_time_policy import extract_answer   # noqa: E402

ANSWER = r"(-?\d+)"
QUESTIONS = (("What is 2 + 3?", 5), ("What is 7 + 5?", 12), ("What is 10 + 10?", 20), ("What is 9 - 4?", 5),
             ("What is 6 + 8?", 14), ("What is 3 * 4?", 12), ("What is 15 - 7?", 8), ("What is 4 + 4?", 8),
             ("What is 11 + 22?", 33), ("What is 5 * 5?", 25), ("What is 20 - 5?", 15), ("What is 8 + 1?", 9),
             ("What is 12 + 13?", 25), ("What is 2 * 6?", 12), ("What is 30 + 40?", 70), ("What is 100 - 1?", 99),
             ("What is 9 + 9?", 18), ("What is 7 * 3?", 21), ("What is 50 + 25?", 75), ("What is 16 - 8?", 8))
SUFFIX = " Answer with the number."


def busy_s() -> float:
    """The machine's busy CPU seconds so far (all cores: /proc/stat less idle and iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def start_server(pd: bool, max_samples: int) -> Server:
    port, http_port = free_port(), free_port()
    while http_port == port:
        http_port = free_port()
    topology = ["--prefill", "1", "--decode", "1"] if pd else ["--colocated"]
    cmd = [sys.executable, "-m", "cluster.launch.cli", "serve", *topology, "--host", "127.0.0.1", "--port", str(port),
           "--http-port", str(http_port), "--max-test-time-samples", str(max(16, max_samples))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = Path(tempfile.mkdtemp(prefix="test-time-")) / "server.log"
    server = Server("test-time", _spawn(cmd, env, log, {}), f"http://127.0.0.1:{http_port}", log, {"cmd": cmd})
    return _wait_ready(server, lambda: _http_healthy(server.target), 600.0)


def ask(client, model: str, question: str, max_tokens: int, temperature: float, seed: int,
        test_time: dict | None) -> tuple[str | None, int, int]:
    """(the answer chosen, completion tokens, samples run)."""
    extra = {"test_time": {**test_time, "answer_pattern": ANSWER}} if test_time else {}
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question + SUFFIX}],
                                       max_tokens=max_tokens, temperature=temperature, seed=seed,
                                       extra_body=extra).model_dump()
    text = r["choices"][0]["message"]["content"] or ""
    runs = r["test_time"]["samples_run"] if test_time else 1
    return extract_answer(text, ANSWER), r["usage"]["completion_tokens"], runs


def configs(n: int) -> dict[str, dict | None]:
    return {"greedy": None, f"majority@{n}": {"strategy": "majority", "samples": n},
            f"best_of@{n}": {"strategy": "best_of", "samples": n},
            f"early@{n}": {"strategy": "majority", "samples": n, "early_stop": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    ap.add_argument("--temperature", type=float, default=0.7, help="the sampled configurations' temperature")
    ap.add_argument("--max-tokens", type=int, default=24, help="per sample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pd", action="store_true", help="1 prefill + 1 decode worker instead of one colocated")
    a = ap.parse_args()
    import openai
    server = start_server(a.pd, a.samples)
    try:
        client = openai.OpenAI(base_url=f"{server.target}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        ask(client, model, QUESTIONS[0][0], 4, 0.0, 0, None)           # warm-up
        questions = QUESTIONS[:a.questions]
        print(f"model {model}, {len(questions)} questions, max {a.max_tokens} tokens per sample, "
              f"temperature {a.temperature} (greedy: 0), {'1P1D' if a.pd else 'colocated'}")
        print(f"{'config':>12} {'accuracy':>9} {'tokens':>7} {'samples':>8} {'wall s':>7}")
        rows = {}
        b0, own0, w0 = busy_s(), sum(os.times()[:2]), time.monotonic()
        for name, tt in configs(a.samples).items():
            t0, right, tokens, runs = time.monotonic(), 0, 0, 0
            for i, (q, expected) in enumerate(questions):
                got, used, ran = ask(client, model, q, a.max_tokens, 0.0 if tt is None else a.temperature,
                                     a.seed + 1000 * i, tt)
                right += got == str(expected)
                tokens, runs = tokens + used, runs + ran
            rows[name] = (right / len(questions), tokens)
            print(f"{name:>12} {right / len(questions):9.0%} {tokens:7d} {runs:8d} {time.monotonic() - t0:7.1f}",
                  flush=True)
        n = a.samples
        full, early = rows[f"majority@{n}"], rows[f"early@{n}"]
        print(f"early stop saved {full[1] - early[1]} of {full[1]} tokens ({1 - early[1] / full[1]:.0%}); "
              f"accuracy {full[0]:.0%} -> {early[0]:.0%}")
        busy = max(0.0, busy_s() - b0 - (sum(os.times()[:2]) - own0)) / ((time.monotonic() - w0) * os.cpu_count())
        print(f"CPU busy with other work (and the server's processes): {busy:.0%} of {os.cpu_count()} cores")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
