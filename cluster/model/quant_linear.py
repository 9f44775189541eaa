"""A linear layer on weight-only quantized weights (kernels/cpu_quant.py): GGUF Q8_0/Q4_0/Q4_1
blocks packed as loaded, or a float weight quantized at load (int8 per channel, Q8_0, Q4_1).
CPU only; activations float32 or bfloat16, output in their dtype; any number of rows, each row's
result independent of the others (so it also serves the batch-invariant mode)."""
from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_quant import QuantFormat, QuantizedWeight, quant_linear


class QuantLinear(nn.Module):
    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.qweight = qweight
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
        return quant_linear(x, self.qweight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.qweight.format.value}"
