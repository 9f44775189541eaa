"""Where a speculative step's time goes, in one engine, beside plain decoding.

For each `method:k` (k ignored for `off`; k may be `auto`) a fresh engine on the default model
serves the same held-out chat prompts (greedy), `--streams` at a time in a closed loop (a request
that ends is replaced at once, so prompt chunks share steps with decodes as they do when served);
the speculator's `propose` and its features pass (`after_forward` + `keep`) are timed around their
calls. Prints tokens/s, the ratio to the first row, ms per engine step, of which drafting and the
features pass, tokens per step, and the step policy's measured tokens/s per batch size and cap
(decode/spec/step_policy.py) with the share of steps each cap was chosen. `--rounds` repeats the
runs in turn (the machine is shared: compare medians).

    PYTHONPATH=. python bench/spec_step_cost.py --dtype bfloat16 --runs off block:4 block:2 eagle:4
    PYTHONPATH=. python bench/spec_step_cost.py --dtype bfloat16 --streams 8 --runs off quantspec:auto quantspec:4
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.spec_training.smollm_data import chat_ids, heldout_prompts
from cluster.config import (
    EngineConfig,
    SpeculativeConfig,
    default_model_dir,
    default_model_file,
)
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from decode.spec.speculator import make_speculator


class Timer:
    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


def run(method: str, k: int | str, prompts: list[list[int]], dtype: str, max_tokens: int, threads: int,
        streams: int) -> dict:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k) if method != "off" else SpeculativeConfig()
    engine = LLMEngine(EngineConfig(model=default_model_file(), num_threads=threads, dtype=dtype, speculative=spec),
                       speculator_factory=make_speculator)
    engine.generate(prompts[:1], SamplingParams(max_tokens=8))           # warm-up
    drafting, features = Timer(), Timer()
    speculator = engine.speculator
    if method in speculator.proposers:
        proposer = speculator.proposers[method]
        proposer.propose = drafting.wrap(proposer.propose)
    if speculator.features is not None:
        speculator.features.after_forward = features.wrap(speculator.features.after_forward)
        speculator.features.keep = features.wrap(speculator.features.keep)
    # The step policies (decode/spec/step_policy.py): `auto` requests', the server's fixed k's.
    policies = {name: p for name in ("step_policy", "fixed_policy") if (p := getattr(speculator, name, None))}
    chosen: dict[tuple[int, int], int] = {}
    for policy in policies.values():
        policy.choose = _counted(policy.choose, chosen)
    tokens = steps = 0
    pending = list(prompts)
    t0, cpu0 = time.perf_counter(), time.process_time()
    while pending or engine.has_unfinished():
        while pending and len(engine.requests.seqs) < streams:
            engine.add_request(pending.pop(0), SamplingParams(max_tokens=max_tokens))
        tokens += sum(len(d.token_ids) for d in engine.step())
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"tok_s": tokens / wall, "step_ms": 1000 * wall / steps, "cpu_ms": 1000 * cpu / steps,
            "cpu_tok_s": tokens / cpu, "draft_ms": 1000 * drafting.seconds / steps,
            "features_ms": 1000 * features.seconds / steps, "per_step": tokens / steps,
            "policy": {name: p.table() for name, p in policies.items() if p.arms}, "chosen": chosen}


def _counted(choose, chosen: dict):
    """`choose`, counting the steps each (batch bucket, cap) was chosen for."""
    def counted(batch, measured):
        setting = choose(batch, measured)
        key = (1 << max(0, (batch - 1).bit_length()), setting.cap)
        chosen[key] = chosen.get(key, 0) + 1
        return setting
    return counted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=["off", "block:4", "block:2", "eagle:4"], help="method:k (k: auto)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=1, help="requests running at once (closed loop)")
    ap.add_argument("--rounds", type=int, default=1, help="the runs repeated in turn; medians are shown")
    a = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    prompts = [chat_ids(tok, p.text)[:1024] for p in heldout_prompts(a.prompts)]
    print(f"dtype {a.dtype}, {a.threads} threads, {a.prompts} held-out prompts, {a.max_tokens} new tokens, "
          f"{a.streams} streams, {a.rounds} rounds (medians)")
    results: dict[str, list[dict]] = {spec: [] for spec in a.runs}
    for _ in range(a.rounds):
        for spec in a.runs:
            method, _, k = spec.partition(":")
            results[spec].append(run(method, k if k == "auto" else int(k or 4), prompts, a.dtype, a.max_tokens,
                                     a.threads, a.streams))
    print(f"{'run':>14} {'tok/s':>7} {'ratio':>6} {'per cpu s':>9} {'ratio':>6} {'ms/step':>8} {'cpu ms':>7} {'draft':>6} {'feats':>6} {'tok/step':>8}")
    base = cpu_base = None
    for spec, rs in results.items():
        r = {key: statistics.median(x[key] for x in rs) for key in ("tok_s", "cpu_tok_s", "step_ms", "cpu_ms",
                                                                     "draft_ms", "features_ms", "per_step")}
        base, cpu_base = base or r["tok_s"], cpu_base or r["cpu_tok_s"]
        print(f"{spec:>14} {r['tok_s']:7.1f} {r['tok_s'] / base:5.2f}x "
              f"{r['cpu_tok_s']:9.1f} {r['cpu_tok_s'] / cpu_base:5.2f}x {r['step_ms']:8.1f} {r['cpu_ms']:7.1f} {r['draft_ms']:6.2f} "
              f"{r['features_ms']:6.2f} {r['per_step']:8.2f}   (tok/s of the rounds: "
              f"{', '.join(format(x['tok_s'], '.1f') for x in rs)})", flush=True)
    for spec, rs in results.items():
        if rs[-1]["policy"]:
            print(f"{spec}: step policy, last round: measured tok/s by batch bucket and cap {rs[-1]['policy']}; "
                  f"steps per (bucket, cap) chosen {dict(sorted(rs[-1]['chosen'].items()))}")


if __name__ == "__main__":
    main()
