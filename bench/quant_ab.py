"""The quantized linear at 1 thread by thread CPU time (robust to a loaded machine): the default
model's layer shapes in Q4_1 and its Q8_0 LM head, at 1, 4, 8 and 16 rows. Run it on two builds
(e.g. with a change stashed) for an A/B:

    PYTHONPATH=. python bench/quant_ab.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_kernels import HEAD_SHAPE, LAYER_SHAPES, _copies  # noqa: E402

from kernels.cpu_quant import quant_linear  # noqa: E402

torch.set_num_threads(1)
res = {}
for fmt, shapes in (("q4_1", LAYER_SHAPES), ("q8_0", {"head": HEAD_SHAPE})):
    for name, shape in shapes.items():
        ws, _ = _copies(fmt, shape, 8 if name != "head" else 2)
        for rows in (1, 4, 8, 16):
            x = torch.randn(rows, shape[1]).to(torch.bfloat16)
            for w in ws[:2]: quant_linear(x, w)
            calls = []
            for _ in range(max(3, 40 // len(ws))):
                for w in ws:
                    t0 = time.thread_time(); quant_linear(x, w); calls.append(time.thread_time() - t0)
            res[(name, rows)] = statistics.median(calls) * 1e6
for rows in (1, 4, 8, 16):
    layer = sum(res[(n, rows)] for n in LAYER_SHAPES) * 30
    print(f"rows {rows}: " + " ".join(f"{n} {res[(n, rows)]:.0f}" for n in (*LAYER_SHAPES, "head")) +
          f" | 30 layers + head {1e-3 * (layer + res[('head', rows)]):.2f} ms")
