"""Which implementation of each hot op a model runs with on this machine: the kernel plan.

The fastest way to run a linear layer, a norm or decode attention on a CPU depends on the CPU
(AVX-512 bf16 or AMX, cache sizes), the thread count and the number of rows in the pass, and the
ranking flips between machines. So the plan is measured, not assumed (`kernel_measure.py`), once
per model shape, dtype, thread count, CPU and code version, cached on disk, and then handed as a
value to every worker of a cluster: timing noise can never make a prefill and a decode worker
compute the same rows differently.

Row-dependent choices are kept per bucket of `BatchBuckets` (the same ladder CUDA graphs capture
at). The linear path is one choice per model: it decides the weights' layout in memory.
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch is imported where used: cluster.config holds a plan and stays light
    import torch

PLAN_VERSION = 6   # bump when a path's meaning changes: cached plans of older versions are ignored
# 6: decode-sized passes prefer the fused C ops (kernel_measure.py C_MARGIN); plans measured before may be noisy
# linear_c_rows meaning "every pass": on a CPU whose BLAS has no fast 16-bit GEMM (AVX2 without
# AVX-512 bf16), the C kernel on bf16 weights beats BLAS at prefill sizes too (docs/benchmarks.md, #30).
C_ROWS_ALL = 1 << 30


def _torch():
    """torch, imported where a plan meets tensors (see the top)."""
    import torch  # noqa: PLC0415 - torch is heavy: cluster.config and the router hold plans without it
    return torch


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN's packed weights, where this CPU has them: its bf16 and fp16 paths need AVX-512
    (bw/vl/dq) or AVX-NE-CONVERT, and refuse to pack on an AVX2-only CPU."""
    torch = _torch()
    linear_pointwise = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available() and linear_pointwise is not None):
        return False
    if dtype == torch.float32:
        return True
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    check = getattr(torch.ops.mkldnn, supported, None) if supported else None
    return bool(check is not None and check())


class LinearPath(str, enum.Enum):
    PLAIN = "plain"                  # torch F.linear in the model's dtype
    INVARIANT = "invariant"          # one fixed reduction order per row at any row count (batch-invariant mode)
    PACKED = "packed"                # oneDNN-packed 16-bit weights (CPU)
    FP32_UPCAST = "fp32_upcast"      # 16-bit model, weights kept in float32 (2x weight memory)


class NormPath(str, enum.Enum):
    TORCH_FUSED = "torch_fused"      # torch.rms_norm (weight multiply in fp32 for 16-bit inputs)
    TORCH_OPS = "torch_ops"          # transformers' sequence: fp32 normalise, round, times weight
    FUSED_C = "fused_c"              # kernels/cpu_ops.py, transformers' rounding, residual add fused
    TRITON = "triton"                # kernels/batch_invariant.py: one program per row (CUDA, batch-invariant mode)


class RopePath(str, enum.Enum):
    TORCH = "torch"
    FUSED_C = "fused_c"              # in place on the fused qkv projection, same rounding as torch


class ActPath(str, enum.Enum):
    TORCH = "torch"                  # F.silu(gate) * up on the halves of the fused projection
    FUSED_C = "fused_c"              # one pass, vectorised exp (a few ulp from torch's silu)


class AttentionPath(str, enum.Enum):
    SDPA = "sdpa"                    # gather blocks, torch scaled_dot_product_attention
    FUSED_C = "fused_c"              # decode: one call for every decode row, reads the paged cache in place;
                                     # prefill: kernels/cpu/prefill_attn.c (AVX-512 register tiles)


@dataclass(frozen=True)
class BatchBuckets:
    """A ladder of row counts. A pass of n rows belongs to the smallest bucket >= n (the last
    bucket takes everything above it). Kernel choices are made per bucket; CUDA graphs capture one
    graph per decode bucket and pad a batch up to its bucket."""
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"bucket sizes must be increasing positive integers, got {self.sizes}")

    def index(self, rows: int) -> int:
        for i, size in enumerate(self.sizes):
            if rows <= size:
                return i
        return len(self.sizes) - 1

    def bucket(self, rows: int) -> int:
        """The padded size for `rows` (rows itself above the last bucket)."""
        size = self.sizes[self.index(rows)]
        return max(size, rows)


@dataclass(frozen=True)
class KernelPlan:
    linear: LinearPath
    norm: tuple[NormPath, ...]                 # per bucket of rows in the pass
    rope: tuple[RopePath, ...]                 # per bucket of rows in the pass
    act: tuple[ActPath, ...]                   # per bucket of rows in the pass
    # One choice for every batch: decode rows and speculative verification rows then compute the
    # same position with the same arithmetic whatever the batch (the C kernel is per row).
    decode_attention: AttentionPath
    buckets: BatchBuckets = BatchBuckets()
    linear_c_rows: int = 0                     # plain or fp32_upcast: passes of up to this many rows use the C kernel
                                               # (C_ROWS_ALL: every pass)
    origin: str = "reference"                  # "reference", "measured" or "cached": for the log
    # Batch-invariant mode: every row's result is bitwise independent of the rest of the pass.
    # Attention then computes every token (decode, verification, prefill chunk) as a decode row
    # of its own, so a position's logits never depend on how it was batched or chunked.
    batch_invariant: bool = False
    # Prefill chunks' causal attention (not measured: the C kernel is chosen wherever it is built
    # vectorised, 1.3-2.2x SDPA from 128 to 2048 tokens; docs/kernels.md).
    prefill_attention: AttentionPath = AttentionPath.SDPA

    def __post_init__(self) -> None:
        n = len(self.buckets.sizes)
        for name in ("norm", "rope", "act"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"kernel plan: {name} has {len(getattr(self, name))} entries for {n} buckets")

    @classmethod
    def reference(cls, dtype: torch.dtype, device: torch.device | str = "cpu",
                  buckets: BatchBuckets = BatchBuckets()) -> KernelPlan:
        """torch ops only (what runs where the C ops cannot: CUDA, no compiler, `--kernels torch`);
        linears packed where oneDNN packing exists."""
        torch = _torch()
        n = len(buckets.sizes)
        linear = LinearPath.PACKED if packing_available(dtype, torch.device(device)) else LinearPath.PLAIN
        # torch's fused norm is one op but ~2x slower than the plain ops on thousands of 16-bit rows.
        norm = tuple(NormPath.TORCH_FUSED if dtype == torch.float32 or size <= 64 else NormPath.TORCH_OPS
                     for size in buckets.sizes)
        return cls(linear, norm, (RopePath.TORCH,) * n, (ActPath.TORCH,) * n, AttentionPath.SDPA, buckets)

    @classmethod
    def invariant(cls, dtype: torch.dtype, device: torch.device | str = "cpu",
                  buckets: BatchBuckets = BatchBuckets()) -> KernelPlan:
        """The batch-invariant plan: one choice for every row count, never measured (a measured
        choice could differ between buckets). On CPU every op is a per-row C kernel (linears too,
        at any row count); on CUDA linears and norms are the Triton kernels of
        kernels/batch_invariant.py and the rest torch's elementwise ops."""
        torch = _torch()
        n = len(buckets.sizes)
        if torch.device(device).type == "cpu":
            return cls(LinearPath.INVARIANT, (NormPath.FUSED_C,) * n, (RopePath.FUSED_C,) * n, (ActPath.FUSED_C,) * n,
                       AttentionPath.FUSED_C, buckets, origin="batch-invariant", batch_invariant=True)
        return cls(LinearPath.INVARIANT, (NormPath.TRITON,) * n, (RopePath.TORCH,) * n, (ActPath.TORCH,) * n,
                   AttentionPath.SDPA, buckets, origin="batch-invariant", batch_invariant=True)

    def uses_c_ops(self) -> bool:
        return (self.linear_c_rows > 0 or NormPath.FUSED_C in self.norm or RopePath.FUSED_C in self.rope or ActPath.FUSED_C in self.act
                or AttentionPath.FUSED_C in (self.decode_attention, self.prefill_attention))

    def describe(self) -> str:
        def runs(choices) -> str:   # "fused_c<=64, torch_ops" style: where each choice applies
            out, sizes = [], self.buckets.sizes
            for i, c in enumerate(choices):
                if i + 1 < len(choices) and choices[i + 1] == c:
                    continue
                out.append(f"{c.value}<={sizes[i]}" if i + 1 < len(choices) else c.value)
            return ", ".join(out)
        c = (" (fused_c, all rows)" if self.linear_c_rows >= C_ROWS_ALL
             else f" (fused_c<={self.linear_c_rows} rows)" if self.linear_c_rows else "")
        return (f"linear {self.linear.value}{c}; norm {runs(self.norm)}; rope {runs(self.rope)}; act {runs(self.act)}; "
                f"decode attention {self.decode_attention.value}; prefill attention {self.prefill_attention.value} "
                f"({self.origin})")

    def to_json(self) -> str:
        return json.dumps({"version": PLAN_VERSION, **asdict(self)}, default=lambda e: e.value)

    @classmethod
    def from_json(cls, text: str) -> KernelPlan:
        raw = json.loads(text)
        if raw.pop("version", None) != PLAN_VERSION:
            raise ValueError("kernel plan of another version")
        return cls(linear=LinearPath(raw["linear"]), norm=tuple(NormPath(v) for v in raw["norm"]),
                   rope=tuple(RopePath(v) for v in raw["rope"]), act=tuple(ActPath(v) for v in raw["act"]),
                   decode_attention=AttentionPath(raw["decode_attention"]),
                   buckets=BatchBuckets(tuple(raw["buckets"]["sizes"])), origin=raw.get("origin", "cached"),
                   linear_c_rows=int(raw.get("linear_c_rows", 0)),
                   batch_invariant=bool(raw.get("batch_invariant", False)),
                   prefill_attention=AttentionPath(raw.get("prefill_attention", "sdpa")))
