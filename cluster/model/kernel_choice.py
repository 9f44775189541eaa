"""Resolve a model's kernel plan (cached, or measured once) and apply it to a loaded model.

The cache key holds everything a measured choice depends on: the model's shapes, the dtype, the
thread count, the CPU (model name and flags), torch's version and the C ops' source. A cluster's
driver resolves the plan once and hands it to every worker in its EngineConfig.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import replace

import torch

from cluster.config import cache_dir
from cluster.model.kernel_measure import measure_kernel_plan
from cluster.model.kernel_plan import PLAN_VERSION, AttentionPath, KernelPlan, LinearPath
from cluster.model.linear import apply_linear_path
from cluster.model.model_config import TORCH_DTYPES, ModelConfig, load_model_config
from cluster.model.moe import apply_moe_path, moe_path_for
from cluster.model.quant_linear import DENSE_MIN_ROWS, set_dense_rows
from kernels import cpu_ops

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "torch")   # auto: measured on CPU, torch ops on other devices; torch: torch ops only


def plan_key(mc: ModelConfig, dtype: torch.dtype, threads: int) -> str:
    shape = (mc.hidden_size, mc.intermediate_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.vocab_size,
             mc.num_layers, mc.q_size, mc.kv_size)
    parts = [PLAN_VERSION, shape, str(dtype), threads, cpu_ops.cpu_signature(),
             torch.__version__, hashlib.sha256(cpu_ops.SOURCE.read_bytes()).hexdigest()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def resolve_kernel_plan(mc: ModelConfig, dtype: torch.dtype, device: torch.device, mode: str,
                        threads: int | None = None) -> KernelPlan:
    """The plan for this model on this machine with `threads` torch threads (default: the
    current setting, which the measurement then runs with)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    if mode == "torch" or device.type != "cpu":
        return KernelPlan.reference(dtype, device)
    previous = torch.get_num_threads()
    threads = threads or previous
    path = cache_dir() / "kernel_plans" / f"{plan_key(mc, dtype, threads)}.json"
    try:
        plan = KernelPlan.from_json(path.read_text())
        log.info("kernel plan from %s: %s", path, plan.describe())
        return replace(plan, origin="cached")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.info("measuring this CPU's kernels for the model's shapes (once; cached in %s)", path,
             extra={"phase": "measuring this CPU's kernels (first start only)"})
    torch.set_num_threads(threads)
    try:
        plan = measure_kernel_plan(mc, dtype)
    finally:
        torch.set_num_threads(previous)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(plan.to_json())
    os.replace(f.name, path)   # atomic: a concurrent reader sees the old file or the whole new one
    return plan


def apply_kernel_plan(model: torch.nn.Module, plan: KernelPlan) -> None:
    """Lay the model's linear weights out for the plan and make its passes follow it."""
    if plan.uses_c_ops():
        if cpu_ops.load(cache_dir()) is None:
            raise RuntimeError("the kernel plan uses the fused C ops, which could not be built here "
                               "(no C compiler?); run with kernels='torch' (--kernels torch)")
    count = apply_linear_path(model, plan.linear, plan.linear_c_rows)
    if count:
        log.info("%d linear layers laid out for the %s path", count, plan.linear.value)
    # Quantized layers: prefill-sized passes on a dequantized GEMM, but for batch-invariant mode,
    # where a row must not depend on the row count (the GEMM's blocking does).
    set_dense_rows(model, None if plan.batch_invariant else DENSE_MIN_ROWS)
    params = next(model.parameters(), None)
    if params is not None and apply_moe_path(model, moe_path_for(plan, params.device.type)):
        log.info("experts computed on the %s path", moe_path_for(plan, params.device.type).value)
    if hasattr(model, "kernel_plan"):
        model.kernel_plan = plan



def invariant_plan(dtype: torch.dtype, device: torch.device) -> KernelPlan:
    """The batch-invariant plan, or a clear error where its kernels cannot run."""
    if device.type == "cpu" and not cpu_ops.supports(dtype):
        raise ValueError(f"deterministic mode on CPU runs float32 or bfloat16, not {dtype}; "
                         "pass --dtype bfloat16 or float32")
    if device.type == "cpu" and cpu_ops.load(cache_dir()) is None:
        raise ValueError("deterministic mode on CPU needs the fused C ops, which could not be built here "
                         "(no C compiler?)")
    return KernelPlan.invariant(dtype, device)


def engine_config_plan(config, threads: int | None = None) -> KernelPlan:
    """The plan for an EngineConfig: the one it carries, else resolved for its model, dtype,
    device and `threads` (the batch-invariant plan with `deterministic`, never measured).
    `pack_weights=False` keeps plain linears whatever a measured plan says."""
    plan = config.kernel_plan
    if plan is None:
        mc = load_model_config(config.model)
        dtype = plan_dtype(config)
        if config.deterministic:
            return invariant_plan(dtype, torch.device(config.device))
        plan = resolve_kernel_plan(mc, dtype, torch.device(config.device), config.kernels, threads)
        plan = c_prefill_plan(plan, config.kernels, config.device.split(":")[0], dtype)
    if plan.batch_invariant:
        return plan
    if not config.pack_weights and plan.linear is not LinearPath.PLAIN:
        plan = replace(plan, linear=LinearPath.PLAIN, linear_c_rows=0)
    device_type = config.device.split(":")[0]
    if config.cache.kv_cache_dtype != "auto":
        return fused_decode_plan(plan, config.kernels, device_type, plan_dtype(config), "a quantized KV cache")
    if config.cuda_graphs == "on" and device_type == "cpu":   # replays read static tables: the C kernel's
        return fused_decode_plan(plan, config.kernels, device_type, plan_dtype(config), "decode graphs on CPU")
    return plan


def resolved_engine_config(config, threads: int | None = None):
    """`config` with what this node decides resolved once, for every worker of a cluster: the
    dtype (`--dtype auto` follows the CPU) and the kernel plan (`engine_config_plan`)."""
    plan = engine_config_plan(config, threads)
    return replace(config, dtype=str(plan_dtype(config)).removeprefix("torch."), kernel_plan=plan)


def fused_decode_plan(plan: KernelPlan, kernels: str, device_type: str, dtype: torch.dtype, why: str) -> KernelPlan:
    """Decode attention on the fused C kernel wherever it builds, whatever the measurement chose:
    a quantized KV cache is read in place there (the SDPA path would gather and dequantize every
    step's whole context), and CPU decode graphs replay only on it. `--kernels torch` keeps the
    torch path."""
    if kernels == "torch" or device_type != "cpu" or plan.decode_attention is AttentionPath.FUSED_C:
        return plan
    if cpu_ops.load(cache_dir()) is None or not cpu_ops.supports(dtype):
        return plan
    log.info("%s: decode attention on the fused C kernel", why)
    return replace(plan, decode_attention=AttentionPath.FUSED_C)


def c_prefill_plan(plan: KernelPlan, kernels: str, device_type: str, dtype: torch.dtype) -> KernelPlan:
    """Prefill attention on the C kernel wherever it is built vectorised (AVX-512): it beats SDPA
    at every prompt length measured (bench/prefill_attention.py), so it is not measured per start.
    `--kernels torch` keeps SDPA."""
    if kernels == "torch" or device_type != "cpu" or plan.prefill_attention is AttentionPath.FUSED_C:
        return plan
    if cpu_ops.load(cache_dir()) is None or not cpu_ops.supports(dtype) or not cpu_ops.has_prefill_attention():
        return plan
    return replace(plan, prefill_attention=AttentionPath.FUSED_C)


def plan_dtype(config) -> torch.dtype:
    """The dtype an EngineConfig computes in: its --dtype, or for "auto" `auto_dtype`'s choice."""
    if config.dtype != "auto":
        return TORCH_DTYPES[config.dtype]
    return auto_dtype(load_model_config(config.model).dtype, config.device.split(":")[0])


def auto_dtype(checkpoint: torch.dtype, device_type: str) -> torch.dtype:
    """`--dtype auto`: on a CPU, bfloat16 where it computes bf16 natively (AVX-512 BF16, AMX),
    whatever the checkpoint stores (as vLLM's auto halves a float32 checkpoint), else float32
    (emulated bf16 is slower there than float32: docs/benchmarks.md, "What bf16 costs"); on
    other devices the checkpoint's own dtype."""
    if device_type != "cpu":
        return checkpoint
    return torch.bfloat16 if cpu_ops.native_bf16() else torch.float32
