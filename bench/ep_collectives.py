"""Expert parallelism's collectives on this machine: what a mixture-of-experts layer pays to
exchange tokens between two ranks, for the three ways of laying a batch out over the ranks.

    PYTHONPATH=. python bench/ep_collectives.py [--hidden 1024] [--experts 64] [--top-k 8]
        [--tokens 1,8,64,512] [--rounds 5] [--dtype bfloat16]

- `tp-attention` (what splitserve builds, docs/parallel.md): every rank holds every token (the
  attention is tensor-parallel and ends in an all-reduce), each rank runs its experts' share,
  and the MoE block ends in one all-reduce of [T, H]: two all-reduces a layer.
- `dp-all-to-all`: attention data-parallel (each rank T/2 tokens, no collective in attention);
  the MoE block dispatches each token once to each other rank that holds one of its top-k
  experts and combines the partial sums back (two all-to-all of those rows, plus one of the row
  counts, as DeepEP-style kernels do).
- `dp-gather-scatter`: attention data-parallel; the MoE block all-gathers the tokens (T/2 -> T
  rows) and reduce-scatters the partial sums back (T -> T/2): the all-gather + reduce-scatter
  scheme. Where gloo lacks reduce-scatter, an all-reduce of T rows stands in (said in the output).

Routing is uniform at random (seeded, the same on both ranks). Two gloo processes on 127.0.0.1,
each pinned to its own core with one thread; each figure is the median over --rounds rounds of
the methods interleaved, microseconds per layer. A benchmark, not a test: the share of the
machine busy with other work is printed beside the figures.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.append(str(Path(__file__).resolve().parent))

from llama_cpp_compare import busy_s

WORLD = 2


def routed_rows(tokens: int, experts: int, top_k: int, rank: int, seed: int) -> tuple[int, int]:
    """Rows this rank's share of `tokens` sends to the other rank (tokens with at least one top-k
    expert there) and receives from it, under uniform routing; experts [r*E/2, (r+1)*E/2) on r."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    owner = picks // (experts // WORLD)
    half = tokens // WORLD
    mine = slice(rank * half, (rank + 1) * half)
    theirs = slice((1 - rank) * half, (2 - rank) * half)
    send = int((owner[mine] == 1 - rank).any(dim=1).sum())
    recv = int((owner[theirs] == rank).any(dim=1).sum())
    return send, recv


def tp_attention(x_full: torch.Tensor) -> None:
    dist.all_reduce(x_full)     # the attention's output projection
    dist.all_reduce(x_full)     # the MoE block's partial sums


def dp_all_to_all(x_half: torch.Tensor, send: int, recv: int, rank: int) -> None:
    kept = x_half.shape[0] - send
    in_splits, out_splits = [kept, kept], [kept, kept]     # to / from each rank, by rank
    in_splits[1 - rank], out_splits[1 - rank] = send, recv
    counts = torch.tensor(in_splits, dtype=torch.int64)
    dist.all_to_all_single(torch.empty_like(counts), counts)        # the row counts
    out = torch.empty(kept + recv, x_half.shape[1], dtype=x_half.dtype)
    dist.all_to_all_single(out, x_half, out_splits, in_splits)      # dispatch
    back = torch.empty_like(x_half)
    dist.all_to_all_single(back, out, in_splits, out_splits)        # combine


def dp_gather_scatter(x_half: torch.Tensor, x_full: torch.Tensor, has_rs: bool) -> None:
    dist.all_gather_single(x_full, x_half)
    if has_rs:
        dist.reduce_scatter_single(x_half, x_full)
    else:
        dist.all_reduce(x_full)


def _time(fn, n: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dist.barrier()
    return 1e6 * (time.perf_counter() - t0) / n


def _measure(tokens: int, rank: int, dtype: torch.dtype, has_rs: bool, args) -> dict:
    """Microseconds per layer of each method for `tokens` tokens (the methods interleaved)."""
    x_full = torch.randn(max(tokens, WORLD), args.hidden).to(dtype)
    x_half = x_full[: x_full.shape[0] // WORLD].clone()
    send, recv = routed_rows(x_full.shape[0], args.experts, args.top_k, rank, seed=tokens)
    methods = {"tp-attention": lambda: tp_attention(x_full),
               "dp-all-to-all": lambda: dp_all_to_all(x_half, send, recv, rank),
               "dp-gather-scatter": lambda: dp_gather_scatter(x_half, x_full, has_rs)}
    n = 100 if tokens < 512 else 20
    for fn in methods.values():   # warm-up: connections, buffers
        for _ in range(5):
            fn()
    samples = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            samples[name].append(_time(fn, n))
    return {name: statistics.median(v) for name, v in samples.items()} | {"rows_sent": send,
                                                                          "tokens": x_full.shape[0]}


def _rank(rank: int, port: int, args, out) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    dtype = getattr(torch, args.dtype)
    probe = torch.zeros(2, 4, dtype=dtype)
    try:
        dist.reduce_scatter_single(probe[:1], probe)
        has_rs = True
    except (RuntimeError, NotImplementedError, ValueError):
        has_rs = False
    for tokens in args.tokens:
        figures = _measure(tokens, rank, dtype, has_rs, args)
        if rank == 0:
            out[tokens] = figures
    if rank == 0:
        out["reduce_scatter"] = has_rs
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[2, 8, 64, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    b0, t0 = busy_s(), time.monotonic()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(29500 + os.getpid() % 1000, args, out), nprocs=WORLD)
        out = dict(out)
    busy = (busy_s() - b0) / (time.monotonic() - t0) / (os.cpu_count() or 1)
    print(f"2 gloo ranks, hidden {args.hidden}, {args.experts} experts top-{args.top_k}, {args.dtype}; "
          f"microseconds per layer, median of {args.rounds} rounds; machine busy {busy:.0%} during the run "
          f"(the two ranks' own share included)")
    if not out.pop("reduce_scatter"):
        print("gloo has no reduce_scatter here: dp-gather-scatter's second half is an all-reduce of T rows")
    print("| tokens | rows sent a rank (all-to-all) | tp-attention (2 all-reduce) | dp-all-to-all | "
          "dp-gather-scatter |")
    print("|---:|---:|---:|---:|---:|")
    for tokens in sorted(out):
        r = out[tokens]
        print(f"| {r['tokens']} | {r['rows_sent']} | {r['tp-attention']:.0f} | {r['dp-all-to-all']:.0f} | "
              f"{r['dp-gather-scatter']:.0f} |")


if __name__ == "__main__":
    main()
