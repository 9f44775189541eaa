"""A linear layer on weight-only quantized weights (kernels/cpu_quant.py): GGUF Q8_0/Q4_0/Q4_1
blocks packed as loaded, or a float weight quantized at load (int8 per channel, Q8_0, Q4_1).
On CPU the C kernel: activations float32 or bfloat16, output in their dtype; any number of rows,
each row's result independent of the others (so it also serves the batch-invariant mode). On
CUDA the Triton kernel (kernels/quant_gemm.py) over the same packed tensors, moved with the
module; its tiles follow the row count, so rows there are not batch-invariant.

Passes of at least `dense_rows` rows (prefill) on CPU instead dequantize the weight, in C, into a
reusable scratch matrix in the activations' dtype and multiply it with torch's GEMM: the kernel
streams the weight once per 8 rows and is bound by its FMAs there, where the GEMM is faster. A
GEMM's blocking follows the row count, so the kernel plan turns this off in batch-invariant mode
(`dense_rows` None: the kernel for every pass); the engine's plan sets it (kernel_choice.py)."""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_ops, cpu_quant
from kernels.cpu_quant import QuantFormat, QuantizedWeight, quant_linear

# Rows from which a pass dequantizes and runs the GEMM: measured with bench/quant_kernels.py
# (docs/quantization.md, "Prefill on stored blocks").
DENSE_MIN_ROWS = 32
# With bf16 dot products (kernels/cpu/quant_dot.c) the quantized kernel stays ahead of the
# dequantized GEMM up to about this many rows (1 thread, default model: 170 vs 178 ms a step at 64
# rows; TTFT of 512 tokens 798 vs 689 ms: docs/quantization.md).
DOT_DENSE_MIN_ROWS = 128
# Weight rows dequantized per GEMM (a multiple of the 8-row tile): a larger matrix (the LM head)
# goes in chunks of this many, so the scratch stays a layer's size (a whole 49152x576 head would
# be 56 MB of bf16).
DENSE_CHUNK_ROWS = 4096
DENSE_DTYPES = (torch.float32, torch.bfloat16)   # what the C dequantization writes


class DenseScratch:
    """The dense weight buffer the quantized layers share, one per thread (an engine's passes run
    on one thread; a second engine in the process gets its own), grown to the largest matrix."""

    def __init__(self) -> None:
        self._local = threading.local()

    def matrix(self, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.dtype != dtype or buf.numel() < rows * k:
            buf = self._local.buf = torch.empty(rows * k, dtype=dtype)
        return buf[: rows * k].view(rows, k)


SCRATCH = DenseScratch()   # the process's one scratch, the default of every QuantLinear


class QuantLinear(nn.Module):
    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None, scratch: DenseScratch = SCRATCH):
        super().__init__()
        self.qweight = qweight
        self.act_int8 = False     # CPU, 4-bit weights: int8 activations per block (--quantized-activations)
        self.dense_rows: int | None = None   # CPU passes of this many rows on: dequantized GEMM (set by the plan)
        self.bf16_dot = False     # CPU bf16 passes of 32-127 rows on bf16 dot products (set with dense_rows)
        self._scratch = scratch
        self.in_features = qweight.k
        self.out_features = qweight.n
        # The packed tensors as (non-persistent) buffers, so the engine's memory plan counts them.
        self.register_buffer("quants", qweight.quants, persistent=False)
        self.register_buffer("scales", qweight.scales, persistent=False)
        self.register_buffer("mins", qweight.mins, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: QuantFormat | str) -> QuantLinear:
        """nn.Linear's weight quantized at load (`QuantizedWeight.quantize`'s schemes)."""
        return cls(QuantizedWeight.quantize(linear.weight, scheme), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qweight = self._moved_weight()
        if x.is_cuda:
            from kernels.quant_gemm import triton_quant_linear  # noqa: PLC0415 - Triton is optional: CUDA only
            return triton_quant_linear(x, qweight, self.bias)
        if (self.dense_rows is not None and not self.act_int8 and x.dtype in DENSE_DTYPES
                and x.numel() >= self._dense_min_rows(x.dtype) * self.in_features):
            return self._dense(x, qweight)
        return quant_linear(x, qweight, self.bias, act_int8=self.act_int8, bf16_dot=self.bf16_dot)

    def _dense_min_rows(self, dtype: torch.dtype) -> int:
        if self.bf16_dot and dtype == torch.bfloat16 and cpu_ops.has_bf16_dot():
            return max(self.dense_rows, DOT_DENSE_MIN_ROWS)
        return self.dense_rows

    def _dense(self, x: torch.Tensor, qweight: QuantizedWeight) -> torch.Tensor:
        """x @ w.T through torch's GEMM on the weight dequantized into the scratch (in x's dtype;
        the bias added in it too), a chunk of output features at a time."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        n, k = qweight.n, qweight.k
        chunk = DENSE_CHUNK_ROWS
        parts = []
        for n0 in range(0, n, chunk):
            rows = min(chunk, n - n0)
            w = cpu_quant.dequantize_into(qweight, self._scratch.matrix(rows, k, x.dtype), n0)
            parts.append(F.linear(x, w, None if bias is None else bias[n0:n0 + rows]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def _moved_weight(self) -> QuantizedWeight:
        """The weight over the buffers where they are now: `.to(device)` replaces the buffers, not
        the tensors the (frozen) QuantizedWeight holds. The kernels read scales in their packed
        dtypes, whatever a module-wide dtype cast made of the float buffers."""
        qw = self.qweight
        if qw.quants is not self.quants:
            mins = None if qw.mins is None else self.mins.to(qw.mins.dtype)
            qw = self.qweight = QuantizedWeight(qw.format, qw.n, qw.k, self.quants, self.scales.to(qw.scales.dtype),
                                                mins)
        return qw

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.qweight.format.value}"


def set_dense_rows(model: nn.Module, rows: int | None) -> int:
    """Every QuantLinear under `model` serves passes of `rows` rows on with the dequantized GEMM
    (None: the row-independent kernel for every pass); returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m.dense_rows = rows
        m.bf16_dot = rows is not None   # the same switch: both change a row's arithmetic with the row count
    return len(layers)
