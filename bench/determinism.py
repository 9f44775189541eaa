"""The batch-invariant mode: what it costs and whether the default mode needs it here, in one run.

    python bench/determinism.py [--model bench|default|DIR] [--batches 1 8 32] [--threads 2]
    python bench/determinism.py --cluster      # the served matrix instead (1P1D, 2P2D, colocated x spec methods)
    python bench/determinism.py --device cuda --model bench   # on a GPU: the Triton kernels' mode
    python bench/determinism.py --profile-prefill             # where the prefill cost goes (8 x 512 tokens)

1. Throughput with the mode off and on, side by side (engine in-process, bf16, greedy, eos
   ignored; decode tok/s = B * (new - 1) / (t(new) - t(1)), prefill tok/s = B * prompt / t(1),
   the formulas of bench/engine_vs_transformers.py; each batch measured off, on, off, on, and the
   best t(1) and t(new) of each mode kept).
   Decode is the difference of two timings, so it is the noisier figure.
2. Divergence of each mode on this machine: 20 greedy requests (8 short prompts and 2 of ~700
   tokens, each sent twice) in one batch against each prompt alone.
3. With --cluster: 32 concurrent greedy requests against a served cluster in the mode, every
   completion compared with the single engine alone (`splitserve generate --deterministic`).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import sys
import tempfile
from pathlib import Path

import torch

# The repository first, then its tests (tiny_models).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from engine_vs_transformers import make_bench_model, time_ours  # noqa: E402


def _engine(model_dir, deterministic: bool, threads: int, spec: str = "off", device: str = "cpu"):
    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from cluster.engine.engine import LLMEngine
    from decode.spec.speculator import make_speculator
    kwargs = {} if model_dir is None else {"model": model_dir}
    return LLMEngine(EngineConfig(**kwargs, dtype="bfloat16", device=device, num_threads=threads,
                                  deterministic=deterministic,
                                  cache=CacheConfig(memory_budget_bytes=4 << 30),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=2048),
                                  speculative=SpeculativeConfig(method=spec, num_speculative_tokens=4)),
                     speculator_factory=make_speculator)


def throughput(model_dir, threads, batches, prompt_len, new, repeats, device) -> None:
    engines = {mode: _engine(model_dir, mode == "on", threads, device=device) for mode in ("off", "on")}
    print(f"# throughput, bf16, {threads} threads, prompt {prompt_len}, {new} new tokens")
    print(f"{'batch':>5} | {'decode off':>10} | {'decode on':>9} | {'on/off':>6} | {'prefill off':>11} | "
          f"{'prefill on':>10} | {'on/off':>6}")
    for b in batches:
        best = {"off": (1e9, 1e9), "on": (1e9, 1e9)}   # (t(1 token), t(new tokens)), best over rounds
        for _ in range(2):   # interleaved: drift of a noisy machine hits both modes alike
            for mode, engine in engines.items():
                t1, tn = time_ours(engine, b, prompt_len, new, repeats)
                best[mode] = (min(best[mode][0], t1), min(best[mode][1], tn))
        (po, do), (pn, dn) = ((b * prompt_len / t1, b * (new - 1) / (tn - t1)) for t1, tn in (best["off"], best["on"]))
        print(f"{b:>5} | {do:>10.0f} | {dn:>9.0f} | {dn / do:>6.2f} | {po:>11.0f} | {pn:>10.0f} | {pn / po:>6.2f}",
              flush=True)


def _divergence_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lengths = [12, 30, 45, 60, 80, 100, 130, 160, 700, 720]
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]
    return prompts + prompts


def divergence(model_dir, threads, device) -> None:
    from cluster.types import SamplingParams
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    print("# divergence: 20 greedy requests in one batch vs each alone (48 tokens)")
    for mode in ("off", "on"):
        engine = _engine(model_dir, mode == "on", threads, device=device)
        prompts = _divergence_prompts(engine.model_config.vocab_size)
        alone = [list(engine.generate([p], sp)[0].token_ids) for p in prompts]
        engine.pool.reset_prefix_cache()
        batch = [list(c.token_ids) for c in engine.generate(prompts, sp)]
        equal = sum(a == b for a, b in zip(alone, batch))
        first = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(alone, batch) if a != b]
        print(f"mode {mode:>3}: {equal}/20 equal to alone" + (f"; first differing token at {first}" if first else ""),
              flush=True)


def profile_prefill(model_dir, threads, device) -> None:
    """One prefill pass of 8 x 512 tokens per mode, timed inside the linears and the layers'
    attention and MLP modules (best of 3)."""
    import collections
    import time

    from cluster.model import linear
    from cluster.model.llama import MLP, Attention
    from cluster.types import SamplingParams
    print("# prefill of 8 x 512 tokens, best of 3: total, inside linears, the rest of attention + MLP")
    for mode in ("off", "on"):
        engine = _engine(model_dir, mode == "on", threads, device=device)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(5, engine.model_config.vocab_size, (512,), generator=g).tolist() for _ in range(8)]
        engine.generate(prompts, SamplingParams(max_tokens=1, cache_salt="warm"))
        spent = collections.Counter()
        patched = []
        for cls, key in ((linear.InvariantLinear, "linear"), (linear.Fp32UpcastLinear, "linear"),
                         (linear.SmallBatchLinear, "linear"), (linear.PackedLinear, "linear"),
                         (torch.nn.Linear, "linear"), (Attention, "layers"), (MLP, "layers")):
            def timed(self, *a, _orig=cls.forward, _key=key, **k):
                t0 = time.perf_counter()
                out = _orig(self, *a, **k)
                spent[_key] += time.perf_counter() - t0
                return out
            patched.append((cls, cls.forward))
            cls.forward = timed
        try:
            best = None
            for r in range(3):
                spent.clear()
                t0 = time.perf_counter()
                engine.generate(prompts, SamplingParams(max_tokens=1, cache_salt=f"r{r}"))
                total = time.perf_counter() - t0
                if best is None or total < best[0]:
                    best = (total, spent["linear"], spent["layers"] - spent["linear"])
        finally:
            for cls, orig in patched:
                cls.forward = orig
        total, lin, rest = best
        print(f"mode {mode:>3}: {total * 1e3:.0f} ms; linears {lin * 1e3:.0f} ms; attention and elementwise "
              f"{rest * 1e3:.0f} ms", flush=True)


def _cluster_matrix(threads) -> None:
    from cluster.launch.app import ClusterConfig
    from cluster.config import CacheConfig, EngineConfig, SpeculativeConfig
    from cluster.types import SamplingParams
    from router.client import AsyncClient
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
    from cluster_harness import ClusterThread
    from test_deterministic_cluster import PROMPTS  # the suite's 32 prompts
    new = 32
    ref_engine = _engine(None, True, threads)
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    reference = [list(ref_engine.generate([p], sp)[0].token_ids) for p in PROMPTS]
    del ref_engine
    print("# served, 32 concurrent greedy requests, deterministic mode, vs `generate` alone")
    for topology in ("1P1D", "2P2D", "colocated"):
        for spec in ("off", "ngram", "draft", "eagle"):
            engine = EngineConfig(deterministic=True, cache=CacheConfig(num_blocks=1024),
                                  speculative=SpeculativeConfig(method=spec, num_speculative_tokens=4))
            shape = ({"colocated": True} if topology == "colocated" else
                     {"num_prefill": int(topology[0]), "num_decode": int(topology[2]), "transport": "nixl",
                      "local_prefill_max_tokens": 4})
            cluster = ClusterThread(ClusterConfig(http_port=None, engine=engine, port=0, **shape))

            async def go(target=cluster.target, spec=spec):
                client = AsyncClient(target)
                extra = {} if spec == "off" else {"speculative": spec}
                try:
                    return await asyncio.gather(*(client.generate(p, max_tokens=new, ignore_eos=True, **extra)
                                                  for p in PROMPTS))
                finally:
                    await client.close()
            try:
                outs = asyncio.run(go())
                cluster.wait_idle()
            finally:
                cluster.stop()
            equal = sum(list(o.token_ids) == r for o, r in zip(outs, reference))
            print(f"{topology:>9} {spec:>5}: {equal}/32 equal", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default", help="bench (the 55M shape of engine_vs_transformers), default, or a DIR")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cluster", action="store_true", help="the served matrix only (about 10 minutes)")
    ap.add_argument("--device", default="cpu", help="the engine's device (cuda: the Triton kernels)")
    ap.add_argument("--profile-prefill", action="store_true", help="only the prefill time breakdown")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    from kernels import cpu_ops
    print(f"# {cpu_ops.cpu_signature().split('|')[0] or platform.processor()}, torch {torch.__version__}")
    if args.cluster:
        _cluster_matrix(args.threads)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = (None if args.model == "default" else
                     make_bench_model(Path(tmp), torch.bfloat16) if args.model == "bench" else Path(args.model))
        if args.profile_prefill:
            profile_prefill(model_dir, args.threads, args.device)
            return
        # Divergence first: the figure this bench exists for, kept when a time limit cuts the run.
        divergence(model_dir, args.threads, args.device)
        throughput(model_dir, args.threads, args.batches, args.prompt_len, args.new_tokens, args.repeats,
                   args.device)


if __name__ == "__main__":
    main()
