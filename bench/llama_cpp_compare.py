"""Batch-1 decode of our engine (`--quantization gguf`) beside llama.cpp's, on the same GGUF file.

    python bench/llama_cpp_compare.py --llama-venv /work/llama-venv [--model FILE.gguf]
        [--threads 2] [--new-tokens 128] [--rounds 3] [--repeats 3] [--out FILE.json]

llama.cpp runs through llama-cpp-python, installed in a venv of its own outside this repository
(never one of the project's dependencies):

    python -m venv /work/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /work/llama-venv/bin/pip install llama-cpp-python

Each round starts one child per engine, alternately (ours, llama.cpp, ours, ...), each in a fresh
process that loads the file, warms up and is timed alone. Both get the same prompt token ids (a
fixed English text, tokenized once by this script with the model's tokenizer), the same thread
count, greedy decoding and exactly --new-tokens tokens with no early stop (ours: ignore_eos;
llama.cpp: its low-level `Llama.eval`, one token at a time, the next token the argmax of the
logits, EOS never checked). Both are timed by the same formula as bench/quant.py's batch-1
decode (bench/vllm_offline.py's `measure`): t(n) is the best of --repeats runs of prompt + n
tokens, after a warm-up; prefill = t(1); decode tok/s = (N - 1) / (t(N) - t(1)), so the prompt's
time is not in the decode rate. Every timed run is a fresh sequence (ours: a distinct cache salt,
so no prefix-cache hit; llama.cpp: `reset()`, its KV cleared from position 0).

llama.cpp also reports its own timings (llama_perf_context: prompt-eval and eval ms over the run):
its eval ms per generated token, outside Python's loop, is printed beside. Each child's row also
says how busy the machine was with anything else meanwhile ("others' CPU", in cores, from
/proc/stat less the child's own CPU time): on a shared 2-core machine a figure taken beside
another process is not a figure of the engine (llama.cpp's OpenMP threads suffer most). Then,
per engine, --repeats more runs with every decode step timed alone (ours: `engine.step()`;
llama.cpp: argmax + `eval` of one token): the median step, and the best step, which is the figure
least moved by anything else running on the machine.

The llama.cpp child is this file run with the venv's Python (`--child llama`): at that point it
imports only the standard library and llama_cpp (numpy through it), nothing from splitserve.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARK = "COMPARE "
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden screw press into one system. Within "
          "fifty years printers were working in more than two hundred cities across Europe, and the")


def timed(generate, new: int, repeats: int) -> dict:
    """bench/vllm_offline.py's `measure` at batch 1 for one fixed prompt: t(n) the best of `repeats`
    runs of generate(n) after one warm-up; decode tok/s = (N - 1) / (t(N) - t(1))."""
    generate(2)

    def best(n: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            generate(n)
            times.append(time.perf_counter() - t0)
        return min(times)
    t1, tn = best(1), best(new)
    return {"t1_s": t1, "tn_s": tn, "prefill_ms": 1e3 * t1,
            "decode_tok_s": (new - 1) / (tn - t1) if tn > t1 else None}


def step_stats(times: list[float]) -> dict:
    """Single decode steps, timed one by one (all of --repeats runs): their median and their best.
    The best step is the figure least moved by other work on the machine."""
    times = sorted(times)
    return {"step_ms_median": 1e3 * times[len(times) // 2], "step_ms_min": 1e3 * times[0], "steps": len(times)}


# --------------------------------------------------------------------------- children

def child_ours(args) -> None:
    sys.path.insert(0, str(REPO))
    import torch

    from cluster.config import CacheConfig, EngineConfig
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams
    ids = json.loads(args.prompt_ids)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bfloat16", quantization="gguf",
                                    quantized_activations=args.quantized_activations,
                                    num_threads=args.threads, cache=CacheConfig(num_blocks=1024)))
    salts = iter(range(1 << 30))
    last: list = []

    def generate(n: int) -> None:
        out = engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0,
                                                    cache_salt=f"c{next(salts)}"))[0]
        assert len(out.token_ids) == n and out.num_cached_tokens == 0, (len(out.token_ids), out.num_cached_tokens)
        last[:] = out.token_ids
    rec = timed(generate, args.new_tokens, args.repeats)
    steps = []
    for _ in range(args.repeats):                     # the same request, one engine.step() at a time
        rid = engine.add_request(ids, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=0.0,
                                                     cache_salt=f"c{next(salts)}"))
        done, first = False, True
        while not done:
            t0 = time.perf_counter()
            deltas = engine.step()
            dt = time.perf_counter() - t0
            if not first:                             # the first step is the prefill (and the first token)
                steps.append(dt)
            first = False
            done = any(d.request_id == rid and d.finished for d in deltas)
    rec.update(step_stats(steps))
    print(MARK + json.dumps({"engine": "ours", **rec, "tokens": list(last), "torch_threads": torch.get_num_threads(),
                             "plan": engine.compute_setup().plan.describe()}), flush=True)


def child_llama(args) -> None:
    import importlib.metadata as md

    import llama_cpp
    import numpy as np
    ids = json.loads(args.prompt_ids)
    llm = llama_cpp.Llama(model_path=str(args.model), n_ctx=512, n_batch=512, n_ubatch=512,
                          n_threads=args.threads, n_threads_batch=args.threads, seed=0, verbose=False)   # flash_attn: off
    ctx = llm._ctx.ctx
    vocab = llm.n_vocab()
    last: list = []
    perf: list = []

    def generate(n: int) -> None:
        llm.reset()                                   # n_tokens = 0: eval() clears the KV from position 0
        llama_cpp.llama_perf_context_reset(ctx)
        llm.eval(ids)                                 # the prompt in one batch (n_batch >= its length)
        out = []
        for i in range(n):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,))
            tok = int(np.argmax(logits))              # greedy; EOS never stops the loop
            out.append(tok)
            if i + 1 < n:
                llm.eval([tok])
        p = llama_cpp.llama_perf_context(ctx)
        perf.append({"n": n, "t_p_eval_ms": p.t_p_eval_ms, "n_p_eval": p.n_p_eval, "t_eval_ms": p.t_eval_ms,
                     "n_eval": p.n_eval})
        last[:] = out
    rec = timed(generate, args.new_tokens, args.repeats)
    steps = []
    for _ in range(args.repeats):                     # the same loop, each eval of one token timed
        llm.reset()
        llm.eval(ids)
        for _ in range(args.new_tokens - 1):
            t0 = time.perf_counter()
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,))
            llm.eval([int(np.argmax(logits))])
            steps.append(time.perf_counter() - t0)
    rec.update(step_stats(steps))
    full = [p for p in perf if p["n"] == args.new_tokens][-args.repeats:]     # the timed N-token runs
    eval_ms = min(p["t_eval_ms"] / p["n_eval"] for p in full if p["n_eval"])
    print(MARK + json.dumps({"engine": "llama.cpp", **rec, "tokens": list(last),
                             "own_eval_ms_per_token": eval_ms, "own_eval_tok_s": 1e3 / eval_ms,
                             "own_prompt_eval_ms": min(p["t_p_eval_ms"] for p in full),
                             "own_counts": {"n_p_eval": full[-1]["n_p_eval"], "n_eval": full[-1]["n_eval"]},
                             "llama_cpp_python": md.version("llama_cpp_python"),
                             "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}),
          flush=True)


# --------------------------------------------------------------------------- parent

def busy_s() -> float:
    """The machine's busy CPU seconds so far (all cores; /proc/stat's first line less idle and iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(below: float, patience_s: float) -> float:
    """Waits (at most patience_s) for a 2-second window in which the machine is busy below `below`
    cores; returns the last window's figure."""
    deadline = time.monotonic() + patience_s
    while True:
        b0 = busy_s()
        time.sleep(2.0)
        load = (busy_s() - b0) / 2.0
        if load < below or time.monotonic() > deadline:
            return load
        print(f"  (machine busy: {load:.2f} cores; waiting for < {below})", flush=True)


def run_child(cmd: list[str], env: dict | None = None) -> dict:
    """The child's record, plus `others_cpu`: the cores' busy time that was not the child's, as a
    share of one core over the child's wall time (anything else running on the machine meanwhile)."""
    r0, b0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), busy_s(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    r1, b1, wall = resource.getrusage(resource.RUSAGE_CHILDREN), busy_s(), time.perf_counter() - t0
    own = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            return {**json.loads(line[len(MARK):]), "others_cpu": max(0.0, (b1 - b0) - own) / wall}
    raise RuntimeError(f"{cmd[:3]}: no result (exit {out.returncode}):\n{out.stderr[-3000:]}")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def prompt_ids(gguf: Path) -> list[int]:
    from cluster.config import resolve_model
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(resolve_model(gguf) / "tokenizer.json")).encode(PROMPT, add_special_tokens=False).ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-venv", type=Path, default=Path("/work/llama-venv"),
                    help="a venv with llama-cpp-python (outside this repository)")
    ap.add_argument("--model", type=Path, default=None, help="a .gguf file (default: the default model's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantized-activations", choices=["none", "int8"], default="none",
                    help="ours: int8 activations into the 4-bit layers (llama.cpp quantizes its own to 8 bits)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each one child per engine, alternating")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per t(n) in each child (best taken)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quiet-below", type=float, default=0.3,
                    help="before each child, wait for a 2 s window with the machine busy below this many cores")
    ap.add_argument("--quiet-patience", type=float, default=300, help="seconds to wait for that, per child")
    ap.add_argument("--child", choices=["ours", "llama"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "llama":
        child_llama(args)
        return
    sys.path.insert(0, str(REPO))
    if args.model is None:
        from cluster.config import default_model_file
        args.model = default_model_file()
    if args.child == "ours":
        child_ours(args)
        return
    ids = prompt_ids(args.model)
    common = ["--model", str(args.model), "--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
              "--quantized-activations", args.quantized_activations,
              "--repeats", str(args.repeats), "--prompt-ids", json.dumps(ids)]
    venv_py = args.llama_venv / "bin" / "python"
    if not venv_py.exists():
        sys.exit(f"{venv_py} not found: build the venv (see this file's docstring)")
    llama_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    print(f"{args.model.name}: prompt {len(ids)} tokens, {args.new_tokens} new, {args.threads} threads, "
          f"{args.rounds} rounds x {args.repeats} repeats; CPU: {cpu_model()}", flush=True)
    rows = []
    for r in range(args.rounds):
        order = ["ours", "llama"] if r % 2 == 0 else ["llama", "ours"]
        rec = {}
        for who in order:
            wait_quiet(args.quiet_below, args.quiet_patience)
            if who == "ours":
                rec["ours"] = run_child([sys.executable, __file__, "--child", "ours", *common])
            else:
                rec["llama"] = run_child([str(venv_py), __file__, "--child", "llama", *common], env=llama_env)
            print(json.dumps({"round": r, **{k: v for k, v in rec[who].items() if k != "tokens"}}), flush=True)
        rows.append(rec)

    def med(who, key):
        vals = [row[who][key] for row in rows if row[who][key] is not None]
        return statistics.median(vals) if vals else float("nan")
    same = [next((i for i, (a, b) in enumerate(zip(row["ours"]["tokens"], row["llama"]["tokens"])) if a != b),
                 args.new_tokens) for row in rows]
    lc = rows[-1]["llama"]
    print(f"\nllama-cpp-python {lc['llama_cpp_python']}; {lc['system_info']}")
    print(f"our plan: {rows[-1]['ours']['plan']}")
    print("\n| round | ours decode tok/s | llama.cpp decode tok/s | ours / llama.cpp | ours prefill ms "
          "| llama.cpp prefill ms | llama.cpp own eval ms/token | step ms median, ours / llama.cpp | best step ms, ours / llama.cpp "
          "| others' CPU, cores (ours / llama.cpp) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r, row in enumerate(rows):
        o, l = row["ours"], row["llama"]
        ratio = f"{o['decode_tok_s'] / l['decode_tok_s']:.2f}x" if o["decode_tok_s"] and l["decode_tok_s"] else "n/a"
        print(f"| {r + 1} | {o['decode_tok_s'] or float('nan'):.1f} | {l['decode_tok_s'] or float('nan'):.1f} | "
              f"{ratio} | {o['prefill_ms']:.1f} | {l['prefill_ms']:.1f} | "
              f"{l['own_eval_ms_per_token']:.2f} | {o['step_ms_median']:.2f} / {l['step_ms_median']:.2f} | "
              f"{o['step_ms_min']:.2f} / {l['step_ms_min']:.2f} | {o['others_cpu']:.2f} / {l['others_cpu']:.2f} |")
    ratios = [row["ours"]["decode_tok_s"] / row["llama"]["decode_tok_s"] for row in rows
              if row["ours"]["decode_tok_s"] and row["llama"]["decode_tok_s"]] or [float("nan")]
    print(f"| median | {med('ours', 'decode_tok_s'):.1f} | {med('llama', 'decode_tok_s'):.1f} | "
          f"{statistics.median(ratios):.2f}x | {med('ours', 'prefill_ms'):.1f} | {med('llama', 'prefill_ms'):.1f} | "
          f"{med('llama', 'own_eval_ms_per_token'):.2f} | {med('ours', 'step_ms_median'):.2f} / "
          f"{med('llama', 'step_ms_median'):.2f} | {min(r['ours']['step_ms_min'] for r in rows):.2f} / "
          f"{min(r['llama']['step_ms_min'] for r in rows):.2f} | |")
    print(f"\ngreedy tokens equal to llama.cpp's for the first {same} of {args.new_tokens} "
          f"(our bf16 activations against llama.cpp's 8-bit quantized ones)")
    if args.out:
        args.out.write_text(json.dumps({"prompt_ids": ids, "rounds": rows, "cpu": cpu_model()}, indent=1))


if __name__ == "__main__":
    main()
