"""The Triton attention kernels on a GPU: correctness against their torch references, then speed.

    python bench/kernel_speed.py [--peak-tbps 4.8] [--dtype bfloat16] [--skip-engine] [--smoke] [--json out.json]

On CUDA:
  1. correctness: store_kv, paged decode (with and without split-KV), verification and prefill
     over a cached prefix against kernels/reference.py, on moderate ragged shapes;
  2. paged decode attention at batch 64, 8k context (Llama-3-8B attention: 32 query heads, 8 KV
     heads, head dim 128, 16-token blocks): achieved HBM bandwidth (K/V bytes read / time) against
     the GPU's peak, from the table below keyed by device name or --peak-tbps; also batch 8 and
     batch 1 at 32k, where split-KV carries the load; verification (k=4) at batch 64, 8k;
  3. prefill attention against torch SDPA (causal, GQA), same shape, in TFLOP/s (outputs compared);
  4. the engine's decode tokens/s with --attention-backend triton against torch, on a random-weight
     Llama shape with head dim 128 (built in a temp folder; needs transformers).
Without CUDA it runs only part 1, under TRITON_INTERPRET=1 on small shapes, and says so; with
--smoke it also walks parts 2-4 on tiny shapes (to test the script; the figures mean nothing).
Part 1 runs each kernel with its first autotune config (autotuning every dtype/shape variant would
compile hundreds of kernels); parts 2-4 autotune and check their own outputs too.
Goals on an H200 (issue #7): decode >= 70% of peak bandwidth; prefill >= 0.8x SDPA.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:   # must precede the first import of kernels: triton picks the interpreter at decoration
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cuda" if CUDA else "cpu"
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from kernels import reference as ref  # noqa: E402
from kernels.decode import default_partition, paged_decode_attention, paged_verify_attention  # noqa: E402
from kernels.prefill import block_m_for, prefill_attention, prefill_tiles  # noqa: E402
from kernels.store_kv import store_kv  # noqa: E402

# Peak HBM bandwidth, TB/s, by a substring of torch.cuda.get_device_name (first match wins).
PEAK_TBPS = [("GH200", 4.0), ("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("H800", 3.35),
             ("B200", 8.0), ("A100-SXM4-80GB", 2.04), ("A100 80GB PCIe", 1.94), ("A100", 1.56),
             ("L40", 0.864), ("L4", 0.3), ("A10G", 0.6), ("RTX 4090", 1.01), ("RTX 3090", 0.936)]


def peak_tbps(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((bw for key, bw in PEAK_TBPS if key in name), None)


def paged(ctx_lens, bs, hkv, d, dtype, device, seed=0):
    """Caches holding every sequence's context in shuffled blocks, and their block tables."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in ctx_lens]
    perm = torch.randperm(sum(need), generator=g).to(device)
    tables = torch.zeros(len(ctx_lens), max(need), dtype=torch.int32, device=device)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at:at + n].int()
        at += n
    shape = (sum(need), bs, hkv, d)
    k = torch.randn(shape, device=device, dtype=dtype)
    v = torch.randn(shape, device=device, dtype=dtype)
    return k, v, tables


def i32(xs, device):
    return torch.tensor(xs, dtype=torch.int32, device=device)


def starts_of(qlens):
    return [sum(qlens[:i]) for i in range(len(qlens))]


def check(name, got, want, dtype, results):
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    err = (got.float() - want.float()).abs().max().item()
    ok = torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    results.append(dict(check=name, dtype=str(dtype)[6:], max_abs_err=err, ok=ok))
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<44} {str(dtype)[6:]:<9} max |err| {err:.2e}", flush=True)
    return ok


def correctness(device, small: bool, dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> list:
    """Every kernel against its reference: ragged lengths with block boundaries, GQA/MQA, windows."""
    results = []
    heads = [(4, 2, 16), (8, 1, 32)] if small else [(32, 8, 128), (16, 1, 64)]
    lens = [1, 16, 17, 100] if small else [1, 16, 17, 1000, 4097]
    for hq, hkv, d in heads:
        for dtype in dtypes:
            tag = f"h{hq}/{hkv} d{d}"
            kc, vc, tables = paged(lens, 16, hkv, d, dtype, device)
            g = torch.Generator(device=device).manual_seed(1)
            # store_kv: scatter a handful of tokens into free-standing copies.
            k_new = torch.randn(5, hkv, d, device=device, dtype=dtype, generator=g)
            slots = torch.tensor([3, 40, -1, 0, 17], device=device)
            got = (kc.clone(), vc.clone())
            want = (kc.clone(), vc.clone())
            store_kv(k_new, k_new, *got, slots)
            ref.store_kv_ref(k_new, k_new, *want, slots)
            check(f"store_kv {tag}", torch.stack(got), torch.stack(want), dtype, results)
            ctx = i32(lens, device)
            q = torch.randn(len(lens), hq, d, device=device, dtype=dtype, generator=g)
            for window in (None, 7):
                for part in (None, 32 if small else 512):
                    args = (q, kc, vc, tables, ctx, d ** -0.5, window)
                    check(f"decode {tag} window={window} partition={part}",
                          paged_decode_attention(*args, partition_size=part), ref.paged_decode_attention_ref(*args),
                          dtype, results)
                qlens = [1, 3, 5, 2][:len(lens)] + [4] * (len(lens) - 4)
                qv = torch.randn(sum(qlens), hq, d, device=device, dtype=dtype, generator=g)
                args = (qv, kc, vc, tables, i32(starts_of(qlens), device), i32(qlens, device), ctx, max(qlens),
                        d ** -0.5, window)
                check(f"verify {tag} window={window}",
                      paged_verify_attention(*args, partition_size=32 if small else 512),
                      ref.paged_verify_attention_ref(*args), dtype, results)
                plens = [1, 16, 9, 60 if small else 700] + [300] * (len(lens) - 4)
                qp = torch.randn(sum(plens), hq, d, device=device, dtype=dtype, generator=g)
                args = (qp, kc, vc, tables, i32(starts_of(plens), device), i32(plens, device),
                        i32([max(n, c) for n, c in zip(plens, lens)], device), max(plens), d ** -0.5, window)
                check(f"prefill {tag} window={window}", prefill_attention(*args), ref.prefill_attention_ref(*args),
                      dtype, results)
    return results


def bench_ms(fn) -> float:
    fn()   # autotune and compile outside the timing
    if not CUDA:   # --smoke: one interpreted call, to run the script's paths, not to time anything
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def pinned_configs():
    """Correctness first runs every kernel with one config (the first its pruner keeps, so fp32
    gets its own space's): autotuning each of the many dtype/shape specializations would compile
    hundreds of variants. Returns a restorer, which also forgets the pinned choices: the timed
    parts share their autotune keys and must tune, not reuse the pin."""
    from kernels.decode import _split_kv_kernel
    from kernels.prefill import _prefill_kernel
    saved = [(k, k.early_config_prune) for k in (_split_kv_kernel, _prefill_kernel)]
    for k, prune in saved:
        k.early_config_prune = (lambda configs, nargs, _p=prune, **kw:
                                (_p(configs, nargs, **kw) if _p else configs)[:1])

    def restore():
        for k, prune in saved:
            k.early_config_prune = prune
            k.cache.clear()
    return restore


def decode_speed(dtype, peak, results, hq=32, hkv=8, d=128, bs=16,
                 shapes=((64, 8192), (8, 8192), (1, 32768)), verify=(64, 8192, 4)):
    print(f"\npaged decode attention, {hq}/{hkv} heads, head dim {d}, {bs}-token blocks, {str(dtype)[6:]}")
    for batch, ctx_len in shapes:
        kc, vc, tables = paged([ctx_len] * batch, bs, hkv, d, dtype, DEV)
        q = torch.randn(batch, hq, d, device=DEV, dtype=dtype)
        ctx = i32([ctx_len] * batch, DEV)
        part = default_partition(ctx_len, batch, hkv, torch.device(DEV))
        out = torch.empty_like(q)
        ms = bench_ms(lambda: paged_decode_attention(q, kc, vc, tables, ctx, d ** -0.5, None, ctx_len, part, out))
        got = out.clone()
        want = ref.paged_decode_attention_ref(q, kc, vc, tables, ctx, d ** -0.5)
        ok = torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        nbytes = 2 * batch * ctx_len * hkv * d * kc.element_size() + 2 * q.numel() * q.element_size()
        tbps = nbytes / ms / 1e9
        share = f"{100 * tbps / peak:.0f}% of {peak} TB/s" if peak else "peak unknown (--peak-tbps)"
        print(f"  batch {batch:>3} ctx {ctx_len:>6} partition {part}: {ms * 1e3:8.1f} us  {tbps:5.2f} TB/s  {share}"
              f"  {'ok' if ok else 'MISMATCH'}", flush=True)
        results.append(dict(bench="decode", batch=batch, context=ctx_len, partition=part, us=ms * 1e3, tbps=tbps,
                            peak_share=tbps / peak if peak else None, ok=ok))
        del kc, vc
    batch, ctx_len, k = verify
    kc, vc, tables = paged([ctx_len] * batch, bs, hkv, d, dtype, DEV)
    q = torch.randn(batch * (k + 1), hq, d, device=DEV, dtype=dtype)
    starts, qlens, ctx = (i32(x, DEV) for x in (starts_of([k + 1] * batch), [k + 1] * batch, [ctx_len] * batch))
    part = default_partition(ctx_len, batch, hkv, torch.device(DEV))
    out = torch.empty_like(q)
    ms = bench_ms(lambda: paged_verify_attention(q, kc, vc, tables, starts, qlens, ctx, k + 1, d ** -0.5, None,
                                                 ctx_len, part, out))
    want = ref.paged_verify_attention_ref(q, kc, vc, tables, starts, qlens, ctx, k + 1, d ** -0.5)
    ok = torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    tbps = 2 * batch * ctx_len * hkv * d * kc.element_size() / ms / 1e9
    print(f"  verify k={k} batch {batch} ctx {ctx_len} partition {part}: {ms * 1e3:8.1f} us  {tbps:5.2f} TB/s"
          f"  {'ok' if ok else 'MISMATCH'}", flush=True)
    results.append(dict(bench="verify", batch=batch, context=ctx_len, k=k, us=ms * 1e3, tbps=tbps, ok=ok))


def prefill_call(q, kc, vc, tables, starts, qlens, ctx, max_q, scale, out):
    """The timed prefill launch, as the backend makes it: the tile map built on the host and
    copied to the device once, outside the timing (its .tolist() sync and copy are per step,
    not per layer, in the engine)."""
    block_m = block_m_for(q.shape[-1], q.dtype)
    tiles = i32(prefill_tiles(qlens.tolist(), ctx.tolist(), q.shape[1] // kc.shape[2], block_m), q.device).view(-1, 2)
    return lambda: prefill_attention(q, kc, vc, tables, starts, qlens, ctx, max_q, scale, tiles=tiles, out=out,
                                     block_m=block_m)


def prefill_speed(dtype, results, batch=4, seq=4096, hq=32, hkv=8, d=128, bs=16):
    import torch.nn.functional as F
    print(f"\nprefill attention vs SDPA, {batch} x {seq} tokens, {hq}/{hkv} heads, head dim {d}, {str(dtype)[6:]}")
    q = torch.randn(batch, seq, hq, d, device=DEV, dtype=dtype)
    k = torch.randn(batch, seq, hkv, d, device=DEV, dtype=dtype)
    v = torch.randn(batch, seq, hkv, d, device=DEV, dtype=dtype)
    kc, vc, tables = paged([seq] * batch, bs, hkv, d, dtype, DEV)
    pos = torch.arange(seq, device=DEV)
    slots = (tables[:, pos // bs].long() * bs + pos % bs).reshape(-1)
    store_kv(k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), kc, vc, slots)
    qf = q.reshape(-1, hq, d)
    starts, qlens = i32(starts_of([seq] * batch), DEV), i32([seq] * batch, DEV)
    out = torch.empty_like(qf)
    ms_t = bench_ms(prefill_call(qf, kc, vc, tables, starts, qlens, qlens, seq, d ** -0.5, out))
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)  # noqa: E731
    ms_s = bench_ms(sdpa)
    ok = torch.allclose(out.view(batch, seq, hq, d).float(), sdpa().transpose(1, 2).float(), atol=2e-2, rtol=2e-2)
    flops = 4 * batch * hq * d * seq * seq / 2   # causal: half the score matrix
    tt, ts = flops / ms_t / 1e9, flops / ms_s / 1e9
    print(f"  triton {ms_t:7.3f} ms {tt:6.1f} TFLOP/s | SDPA {ms_s:7.3f} ms {ts:6.1f} TFLOP/s | "
          f"{tt / ts:.2f}x of SDPA  {'ok' if ok else 'MISMATCH'}", flush=True)
    results.append(dict(bench="prefill", batch=batch, seq=seq, triton_ms=ms_t, sdpa_ms=ms_s, ratio=tt / ts, ok=ok))
    # The same tokens as the last 1/4 of each sequence over a cached 3/4 prefix (no SDPA equivalent).
    n = seq // 4
    qp = q[:, -n:].reshape(-1, hq, d)
    ms_p = bench_ms(prefill_call(qp, kc, vc, tables, i32(starts_of([n] * batch), DEV), i32([n] * batch, DEV), qlens,
                                 n, d ** -0.5, torch.empty_like(qp)))
    fp = 4 * batch * hq * d * n * (seq - n / 2)
    print(f"  over a cached prefix ({seq - n} cached + {n} new): {ms_p:7.3f} ms {fp / ms_p / 1e9:6.1f} TFLOP/s")
    results.append(dict(bench="prefill_prefix", batch=batch, cached=seq - n, new=n, ms=ms_p, tflops=fp / ms_p / 1e9))


def engine_speed(dtype, results, batch=64, prompt_len=2048, new=128, hidden=4096, layers=4, heads=(32, 8)):
    import transformers
    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
    from cluster.engine.engine import LLMEngine
    from engine_vs_transformers import bench_ours
    from tiny_models import make_tokenizer
    print(f"\nengine decode, random Llama (hidden {hidden}, {layers} layers, {heads[0]}/{heads[1]} heads of "
          f"{hidden // heads[0]}), batch {batch}, prompt {prompt_len}, {new} new tokens")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 8,
                                       num_hidden_layers=layers, num_attention_heads=heads[0],
                                       num_key_value_heads=heads[1], max_position_embeddings=8192,
                                       bos_token_id=0, eos_token_id=1)
        with torch.device(DEV):   # random init on the GPU: seconds instead of a minute on the host
            model = transformers.LlamaForCausalLM(cfg).to(dtype)
        model.save_pretrained(tmp)
        del model
        make_tokenizer(Path(tmp), bos=True)
        rates = {}
        for backend in ("torch", "triton"):
            try:
                engine = LLMEngine(EngineConfig(
                    model=tmp, dtype=str(dtype)[6:], device=DEV, attention_backend=backend,
                    cache=CacheConfig(num_blocks=batch * (prompt_len + new) // 16 + 64),
                    scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192)))
                t0 = time.perf_counter()
                _, rates[backend] = bench_ours(engine, batch, prompt_len, new, repeats=2)
                print(f"  {backend:>6}: {rates[backend]:9.0f} decode tok/s ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
                del engine
                if CUDA:
                    torch.cuda.empty_cache()
            except Exception as exc:   # report and go on: the kernel figures above still stand
                print(f"  {backend:>6}: failed: {type(exc).__name__}: {exc}", flush=True)
        if len(rates) == 2:
            print(f"  triton / torch: {rates['triton'] / rates['torch']:.2f}x")
        results.append(dict(bench="engine_decode", batch=batch, prompt=prompt_len, new=new, tok_s=rates))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peak-tbps", type=float, default=None, help="peak HBM bandwidth (default: by device name)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="without CUDA: also walk the timing sections on tiny shapes under the interpreter "
                         "(tests the script, measures nothing)")
    ap.add_argument("--correctness-dtypes", nargs="+", default=["bfloat16", "float16", "float32"],
                    choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--correctness-only", action="store_true", help="no timing sections")
    ap.add_argument("--json", type=Path, default=None,
                    help="also write every figure to this file, after each section (added to what it holds)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    t_start = time.perf_counter()
    if CUDA:
        name = torch.cuda.get_device_name()
        peak = peak_tbps(name, args.peak_tbps)
        import triton
        print(f"# {name}, peak {peak} TB/s, torch {torch.__version__}, triton {triton.__version__}")
    else:
        name, peak = "cpu (TRITON_INTERPRET=1)", None
        print("# no CUDA device: correctness only, under the Triton interpreter on small shapes; "
              "the timings need a GPU")
    results = []
    save = Saver(args.json, dict(device=name, peak_tbps=peak), results)
    dtypes = [getattr(torch, d) for d in args.correctness_dtypes]
    print(f"correctness against kernels/reference.py ({', '.join(args.correctness_dtypes)})", flush=True)
    restore = pinned_configs()
    results += correctness(DEV, small=not CUDA, dtypes=dtypes)
    restore()
    failed = sum(not r["ok"] for r in results)
    print(f"  {len(results) - failed} ok, {failed} failed ({time.perf_counter() - t_start:.0f} s)", flush=True)
    save()
    if CUDA and not args.correctness_only:
        for section in (lambda: decode_speed(dtype, peak, results), lambda: prefill_speed(dtype, results),
                        *(() if args.skip_engine else (lambda: engine_speed(dtype, results),))):
            section()
            save()
    elif args.smoke and not args.correctness_only:
        decode_speed(dtype, None, results, hq=4, hkv=2, d=16, bs=4, shapes=((3, 70), (1, 130)), verify=(2, 40, 3))
        prefill_speed(dtype, results, batch=2, seq=48, hq=4, hkv=2, d=16, bs=4)
        if not args.skip_engine:
            engine_speed(torch.float32, results, batch=2, prompt_len=12, new=3, hidden=64, layers=1, heads=(4, 2))
        save()
    failed = sum(r.get("ok") is False for r in results)
    print(f"\n{failed} check(s) failed; {time.perf_counter() - t_start:.0f} s in all")
    return 1 if failed else 0


class Saver:
    """Writes the figures so far after each section, so a run cut short keeps what it measured.
    An existing file's results (an earlier run of the same check) are kept ahead of this run's."""

    def __init__(self, path: Path | None, header: dict, results: list):
        self.path, self.header, self.results = path, header, results
        self.earlier = []
        if path is not None and path.exists():
            try:
                self.earlier = json.loads(path.read_text()).get("results", [])
            except (ValueError, AttributeError):
                self.earlier = []

    def __call__(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(dict(self.header, results=self.earlier + self.results), indent=1))
            tmp.replace(self.path)   # whole or not at all, even when the step is killed mid-write


if __name__ == "__main__":
    sys.exit(main())
