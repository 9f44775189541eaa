"""Quantized-weight linear (kernels/cpu_quant.py) against the bf16 C linear (kernels/cpu_ops.linear)
on the default model's linear shapes, at several row counts and thread counts.

    python bench/quant_kernels.py [--rows 1 8 32 512] [--threads 2 1] [--layers 30]
                                  [--formats bf16 q8_0 q4_1 q4_1-a8 int8] [--budget 0.3]

`q4_1-a8` is Q4_1 with `act_int8=True` (activations quantized to int8 per block inside the kernel:
not the default, its results carry the activations' rounding), timed as a format of its own.
`bf16-gemm` is torch's F.linear on the bf16 weight (what `--quantization none` runs at prefill
sizes); `q4_1-dq` / `q8_0-dq` the weight dequantized to bf16 in C and then torch's GEMM (what
QuantLinear runs for passes of DENSE_MIN_ROWS rows on: cluster/model/quant_linear.py), the whole
matrix at once; `q4_1-dq256` the same 256 weight rows at a time (a tile that stays in L2).

Each layer shape is held `--layers` times at distinct addresses (the 30 layers of a decode step:
106M weights, 66 MB even in Q4_1, more than a 32 MB last-level cache), the LM head 3 times, and
a measurement walks all copies in turn, so weights come from memory as they do in a real step. Prints, per
shape, microseconds per call (median) and the effective GB/s of weight bytes (packed bytes for the
quantized formats: scales included), then the whole set: the layers' four linears 30 times plus
the LM head once, in ms, and its speedup over bf16. Activations are bf16 throughout.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu_ops  # noqa: E402
from kernels.cpu_quant import QuantizedWeight, dequantize_into, quant_linear  # noqa: E402

HIDDEN, INTER, HEADS_DIM, KV_DIM, VOCAB = 576, 1536, 576, 192, 49152
LAYER_SHAPES = {"qkv": (HEADS_DIM + 2 * KV_DIM, HIDDEN), "o": (HIDDEN, HEADS_DIM),
                "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
HEAD_SHAPE = (VOCAB, HIDDEN)
HEAD_COPIES = 3   # 53 MB in Q4_1: one copy (18 MB) would stay in the last-level cache


def _copies(fmt: str, shape: tuple[int, int], count: int):
    """`count` weights of `shape` in `fmt` at distinct addresses (one quantized, then cloned)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0] + shape[1])) * 0.05
    if fmt.startswith("bf16"):
        w = w.to(torch.bfloat16)
        return [w.clone() for _ in range(count)], w.numel() * 2
    qw = QuantizedWeight.quantize(w, fmt.split("-")[0])
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return [QuantizedWeight(qw.format, qw.n, qw.k, clone(qw.quants), clone(qw.scales), clone(qw.mins))
            for _ in range(count)], qw.nbytes


def _dense(x: torch.Tensor, qw: QuantizedWeight, chunk: int) -> torch.Tensor:
    """Dequantize `chunk` weight rows at a time into one scratch and multiply (0: all at once)."""
    chunk = chunk or qw.n
    scratch = _SCRATCH.setdefault((chunk, qw.k), torch.empty(chunk, qw.k, dtype=x.dtype))
    parts = []
    for n0 in range(0, qw.n, chunk):
        rows = min(chunk, qw.n - n0)
        parts.append(torch.nn.functional.linear(x, dequantize_into(qw, scratch[:rows], n0)))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


_SCRATCH: dict = {}


def _call(fmt: str, x: torch.Tensor, w) -> torch.Tensor:
    if fmt == "bf16":
        return cpu_ops.linear(x, w, None)
    if fmt == "bf16-gemm":
        return torch.nn.functional.linear(x, w)
    if "-dq" in fmt:
        return _dense(x, w, int(fmt.split("-dq")[1] or 0))
    return quant_linear(x, w, act_int8=fmt.endswith("-a8"))


def _time(fmt: str, x: torch.Tensor, weights: list, budget: float) -> float:
    """Seconds per call: the median of calls made in passes over every copy until `budget`
    seconds (a median, so that a call whose thread lost its core to another process does not
    count, as one would in a mean or a best pass)."""
    for w in weights[:2]:
        _call(fmt, x, w)
    calls: list[float] = []
    while sum(calls) < budget or len(calls) < len(weights):
        for w in weights:
            t0 = time.perf_counter()
            _call(fmt, x, w)
            calls.append(time.perf_counter() - t0)
    return statistics.median(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--formats", nargs="+", default=["bf16", "q8_0", "q4_1", "q4_1-a8", "int8"])
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timing per measurement")
    args = ap.parse_args()
    if cpu_ops.load() is None:
        sys.exit("no C compiler: the C ops are not built here")
    print(f"{cpu_ops.cpu_signature().split('|')[0] or platform.processor()}; torch {torch.__version__}")
    shapes = {**LAYER_SHAPES, "lm_head": HEAD_SHAPE}
    sets = {(f, name): _copies(f, shape, HEAD_COPIES if name == "lm_head" else args.layers)
            for f in args.formats for name, shape in shapes.items()}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            x = {name: torch.randn(rows, shape[1]).to(torch.bfloat16) for name, shape in shapes.items()}
            print(f"\n{threads} thread(s), {rows} row(s): us per call (GB/s of weight bytes)")
            print(f"{'shape':>16} | " + " | ".join(f"{f:>16}" for f in args.formats))
            totals = dict.fromkeys(args.formats, 0.0)
            for name, (n, k) in shapes.items():
                cells = []
                for f in args.formats:
                    weights, nbytes = sets[(f, name)]
                    sec = _time(f, x[name], weights, args.budget)
                    totals[f] += sec * (1 if name == "lm_head" else args.layers)
                    cells.append(f"{sec * 1e6:9.1f} ({nbytes / sec / 1e9:4.1f})")
                print(f"{name + f' {n}x{k}':>16} | " + " | ".join(f"{c:>16}" for c in cells))
            base = totals.get("bf16")
            cells = [f"{t * 1e3:7.2f} ms" + (f" {base / t:4.2f}x" if base else "") for t in totals.values()]
            print(f"{f'{args.layers} layers + head':>16} | " + " | ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
