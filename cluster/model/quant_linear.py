"""A linear layer on weight-only quantized weights (kernels/cpu_quant.py): GGUF Q8_0/Q4_0/Q4_1
blocks packed as loaded, or a float weight quantized at load (int8 per channel, Q8_0, Q4_1).
On CPU the C kernel: activations float32 or bfloat16, output in their dtype; any number of rows,
each row's result independent of the others (so it also serves the batch-invariant mode). On
CUDA the Triton kernel (kernels/quant_gemm.py) over the same packed tensors, moved with the
module; its tiles follow the row count, so rows there are not batch-invariant."""
from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_quant import QuantFormat, QuantizedWeight, quant_linear


class QuantLinear(nn.Module):
    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.qweight = qweight
        self.act_int8 = False     # CPU, 4-bit weights: int8 activations per block (--quantized-activations)
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
        return quant_linear(x, qweight, self.bias, act_int8=self.act_int8)

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
