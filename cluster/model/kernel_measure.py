"""Times each candidate path of the kernel plan for one model's shapes on this machine.

Random tensors of the model's shapes, never its weights: a plan can be measured by a driver
process that has not loaded the model. Each row-dependent op is timed at every bucket size up to
the batch limits (norms and RoPE at the pass's row count, decode attention at the number of decode
rows over a representative context); the linear path, one per model, is timed over all of a
layer's projections and the LM head at decode and prefill sizes, with enough distinct weight
copies that they do not stay in cache (a real step streams every layer's weights).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from cluster.config import cache_dir
from cluster.model.attention import AttentionBatch, TorchAttentionBackend
from cluster.model.kernel_plan import (C_ROWS_ALL, ActPath, AttentionPath, BatchBuckets, KernelPlan, LinearPath, NormPath,
                                       RopePath)
from cluster.model.linear import linear_module, packing_available
from cluster.model.llama import RotaryTable
from cluster.model.model_config import ModelConfig
from cluster.model.ops import _torch_norm_fused, _torch_norm_ops, apply_rope
from kernels import cpu_ops

log = logging.getLogger(__name__)

_WEIGHT_SPAN = 64 << 20      # distinct weight bytes cycled through when timing linears (beyond L3)
_LINEAR_ROWS = (1, 8, 32, 512)   # decode sizes, and one prefill chunk
_CONTEXT = 256               # keys per sequence when timing decode attention


def _best_time(fn, budget_s: float = 0.005, repeats: int = 3, give_up_s: float = float("inf")) -> float:
    """Best of `repeats` runs of as many calls as fit in budget_s (after a warm-up). A call slower
    than `give_up_s` is timed once: it cannot win, and a slow candidate may take seconds a call."""
    t0 = time.perf_counter()
    fn()
    if time.perf_counter() - t0 > give_up_s:
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    fn()
    calls = max(1, min(200, int(budget_s / max(time.perf_counter() - t0, 1e-7))))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _linear_candidates(dtype: torch.dtype, c_ops) -> dict[str, tuple[LinearPath, int]]:
    """name -> (layout, rows up to which the C kernel runs)."""
    cands = {"plain": (LinearPath.PLAIN, 0)}
    if c_ops is not None:
        cands["plain+fused_c"] = (LinearPath.PLAIN, c_ops.LINEAR_MAX_ROWS)
        cands["plain+fused_c_all"] = (LinearPath.PLAIN, C_ROWS_ALL)
    if packing_available(dtype, torch.device("cpu")):
        cands["packed"] = (LinearPath.PACKED, 0)
    if dtype in (torch.bfloat16, torch.float16):
        cands["fp32_upcast"] = (LinearPath.FP32_UPCAST, 0)
        if c_ops is not None:
            cands["fp32_upcast+fused_c"] = (LinearPath.FP32_UPCAST, c_ops.LINEAR_MAX_ROWS)
    return cands


_GIVE_UP_RATIO = 3.0   # a linear candidate this much slower than the best so far at a size is timed once


def _measure_linear(mc: ModelConfig, dtype: torch.dtype, max_rows: int, c_ops) -> tuple[tuple[LinearPath, int], dict]:
    candidates = _linear_candidates(dtype, c_ops)
    h, i = mc.hidden_size, mc.intermediate_size
    shapes = [(mc.q_size + 2 * mc.kv_size, h), (h, mc.q_size), (2 * i, h), (h, i)]
    layer_bytes = sum(o * k for o, k in shapes) * dtype.itemsize
    copies = max(1, min(mc.num_layers, _WEIGHT_SPAN // max(layer_bytes, 1)))
    linears = [torch.nn.Linear(k, o, bias=False, dtype=dtype) for _ in range(copies) for o, k in shapes]
    linears.append(torch.nn.Linear(h, mc.vocab_size, bias=False, dtype=dtype))
    modules = {name: [linear_module(m, layout, c_rows) for m in linears]
               for name, (layout, c_rows) in candidates.items()}
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for rows in sorted({min(r, max_rows) for r in _LINEAR_ROWS}):
        inputs = {k: torch.randn(rows, k, dtype=dtype) for k in (h, mc.q_size, i)}

        def run(mods):
            for m in mods:
                m.forward(inputs[m.in_features])
        # The fastest at the last size first, so that a slow one gives up after a single call.
        order = sorted(candidates, key=lambda name: times[name][-1] if times[name] else 0.0)
        with torch.inference_mode():
            best = float("inf")
            for name in order:
                t = _best_time(lambda: run(modules[name]), budget_s=0.05, repeats=3, give_up_s=_GIVE_UP_RATIO * best)
                times[name].append(t)
                best = min(best, t)
    best_per_size = [min(ts[j] for ts in times.values()) for j in range(len(times["plain"]))]
    # One layout for every size: the least total slowdown against the best candidate at each size.
    score = {name: sum(t / b for t, b in zip(ts, best_per_size)) for name, ts in times.items()}
    best = min(candidates, key=score.__getitem__)
    return candidates[best], {name: [round(t * 1e6, 1) for t in ts] for name, ts in times.items()}


# Decode-sized passes (up to this many rows) take the fused C norm, RoPE and activation unless torch's
# op is clearly faster (C_MARGIN): with all of them on C a pure-decode pass runs each layer as one
# call (fused_layer.py, decode_block; 85 -> 157 tok/s at batch 1 on the default model's GGUF), a
# gain the per-op timing cannot see; and these ops take microseconds, where one descheduled
# timing on a busy machine flipped a choice (rope at 1 row measured on torch disabled the one-call
# layer: 10.5 -> 14.8 ms a step, cached until the plan version changed).
FUSED_DECODE_ROWS = 64
C_MARGIN = 2.0


def _prefer_c(t_c: float, t_torch: float, rows: int) -> bool:
    return t_c < t_torch * (C_MARGIN if rows <= FUSED_DECODE_ROWS else 1.0)


def _measure_norm(rows: int, hidden: int, dtype: torch.dtype, c_ops) -> NormPath:
    x = torch.randn(rows, hidden, dtype=dtype)
    w = torch.rand(hidden, dtype=dtype) + 0.5
    # 16-bit: only candidates that round like transformers (normalise, round, times weight), so
    # a row's result does not change with the bucket its batch falls in.
    torch_path, torch_fn = ((NormPath.TORCH_FUSED, lambda: _torch_norm_fused(x, w, 1e-5)) if dtype == torch.float32
                            else (NormPath.TORCH_OPS, lambda: _torch_norm_ops(x, w, 1e-5)))
    if c_ops is None:
        return torch_path
    t_torch = _best_time(torch_fn)
    t_c = _best_time(lambda: c_ops.rms_norm(x, w, 1e-5))
    return NormPath.FUSED_C if _prefer_c(t_c, t_torch, rows) else torch_path


def _measure_act(rows: int, inter: int, dtype: torch.dtype, c_ops) -> ActPath:
    if c_ops is None:
        return ActPath.TORCH
    gate_up = torch.randn(rows, 2 * inter, dtype=dtype)
    t_torch = _best_time(lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
    t_c = _best_time(lambda: c_ops.silu_mul(gate_up))
    return ActPath.FUSED_C if _prefer_c(t_c, t_torch, rows) else ActPath.TORCH


def _measure_rope(rows: int, mc: ModelConfig, dtype: torch.dtype, rotary, c_ops) -> RopePath:
    if c_ops is None:
        return RopePath.TORCH
    heads, d = mc.num_heads + mc.num_kv_heads, mc.head_dim
    qkv = torch.randn(rows, (heads + mc.num_kv_heads) * d, dtype=dtype)
    positions = torch.randint(0, rotary.cos.shape[0], (rows,))
    per_layer = 1.0 / max(1, mc.num_layers)

    def torch_rope():   # the cos/sin gather happens once per pass: its share per layer counts
        cos, sin = rotary.lookup(positions, dtype)
        return apply_rope(qkv[:, : heads * d].view(rows, heads, d), cos, sin)
    lookup = _best_time(lambda: rotary.lookup(positions, dtype))
    t_torch = _best_time(torch_rope) - lookup * (1 - per_layer)
    t_c = _best_time(lambda: c_ops.rope_(qkv, positions, rotary.cos, rotary.sin, heads, d))
    return RopePath.FUSED_C if _prefer_c(t_c, t_torch, rows) else RopePath.TORCH


def _measure_decode_attention(mc: ModelConfig, dtype: torch.dtype, c_ops, max_decode: int,
                              buckets: BatchBuckets) -> AttentionPath:
    """One path for every batch size: the least total slowdown over the decode buckets."""
    if c_ops is None:
        return AttentionPath.SDPA
    bs = 16
    per_seq = -(-_CONTEXT // bs)
    sizes = [b for b in buckets.sizes if b <= max_decode] or [1]
    cache = torch.randn(2, sizes[-1] * per_seq + 1, bs, mc.num_kv_heads, mc.head_dim, dtype=dtype)
    ratios = {AttentionPath.SDPA: 0.0, AttentionPath.FUSED_C: 0.0}
    for batch in sizes:
        tables = tuple(tuple(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(batch))
        attn = AttentionBatch(num_decode=batch, decode_context_lens=(_CONTEXT,) * batch,
                              decode_block_tables=tables, prefills=(),
                              slot_mapping=torch.zeros(batch, dtype=torch.long), block_size=bs)
        q = torch.randn(batch, mc.num_heads, mc.head_dim, dtype=dtype)
        times = {}
        for path in ratios:
            plan = replace(KernelPlan.reference(dtype), decode_attention=path)
            backend = TorchAttentionBackend(mc.num_heads, mc.num_kv_heads, mc.head_dim, torch.device("cpu"), plan)
            meta = backend.prepare(attn)
            times[path] = _best_time(lambda: backend._decode(q, cache[0], cache[1], None, meta.decode))
        for path, t in times.items():
            ratios[path] += t / min(times.values())
    return min(ratios, key=ratios.__getitem__)


def measure_kernel_plan(mc: ModelConfig, dtype: torch.dtype, buckets: BatchBuckets = BatchBuckets(),
                        max_rows: int = 4096, max_decode: int = 256, dense_linears: bool = True) -> KernelPlan:
    """Measure every choice with the current torch thread count; buckets above `max_rows` rows
    (`max_decode` decode rows) take the choice of the largest bucket measured. The limits are
    fixed rather than the engine's batch limits, so one cached plan serves every configuration.
    `dense_linears=False` (every linear of the model quantized: the layout never applies) keeps
    the reference layout untimed, most of the measurement's time (20 of 22 s on the default model)."""
    t0 = time.perf_counter()
    c_ops = cpu_ops if cpu_ops.supports(dtype) and cpu_ops.load(cache_dir()) is not None else None
    rotary = RotaryTable(mc.rope, mc.head_dim, min(mc.max_position_embeddings, 8192))
    if dense_linears:
        (linear, linear_c_rows), linear_times = _measure_linear(mc, dtype, max_rows, c_ops)
    else:
        (linear, linear_c_rows), linear_times = (KernelPlan.reference(dtype).linear, 0), "not timed (quantized)"
    norm, rope, act = [], [], []
    for size in buckets.sizes:
        rows = min(size, max(1, max_rows))
        if norm and rows < size:   # above the limit: the largest measured bucket's choice
            norm.append(norm[-1]), rope.append(rope[-1]), act.append(act[-1])
            continue
        norm.append(_measure_norm(rows, mc.hidden_size, dtype, c_ops))
        rope.append(_measure_rope(rows, mc, dtype, rotary, c_ops))
        act.append(_measure_act(rows, mc.intermediate_size, dtype, c_ops))
    attention = _measure_decode_attention(mc, dtype, c_ops, max_decode, buckets)
    plan = KernelPlan(linear, tuple(norm), tuple(rope), tuple(act), attention, buckets,
                      origin="measured" if dense_linears else "measured, linears quantized",
                      linear_c_rows=linear_c_rows)
    log.info("kernel plan measured in %.1f s with %d threads: %s; linear us per pass at rows %s: %s",
             time.perf_counter() - t0, torch.get_num_threads(), plan.describe(),
             sorted({min(r, max_rows) for r in _LINEAR_ROWS}), linear_times)
    return plan
