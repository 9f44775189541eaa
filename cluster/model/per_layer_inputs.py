"""Gemma 4's per-layer input embeddings (PLE, `hidden_size_per_layer_input`): beside the residual
stream, each token gets a small input of its own for every layer, and each layer adds a gated
projection of it to the stream after its MLP.

The model-level part (`PerLayerInputs`) computes every layer's input of a pass at once, as
transformers' `get_per_layer_inputs` + `project_per_layer_inputs`: a second, packed embedding of
the tokens [T, L * P] (times sqrt(P) rounded to the dtype) plus a projection of the scaled token
embeddings (times H ** -0.5) normed per layer, their sum times 2 ** -0.5. The layer-level part
(`LayerInputGate`): x += norm(proj(gelu_tanh(gate(x)) * input_i)). The pass carries the inputs
(`ForwardPass.layer_inputs`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Norm(nn.Module):
    """An RMSNorm's weight; the pass's kernel plan computes it (`ForwardPass.norm`)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class PerLayerInputs(nn.Module):
    def __init__(self, num_layers: int, size: int, vocab_size: int, hidden_size: int, eps: float):
        super().__init__()
        self.num_layers, self.size = num_layers, size
        width = num_layers * size
        # An empty weight, assigned from the checkpoint (as CausalLM's embeddings: no random init on meta).
        self.embed_tokens_per_layer = nn.Embedding(vocab_size, width, _weight=torch.empty(vocab_size, width))
        self.per_layer_model_projection = nn.Linear(hidden_size, width, bias=False)
        self.per_layer_projection_norm = _Norm(size, eps)
        self.projection_scale = hidden_size ** -0.5
        self._embed_scales: dict[torch.dtype, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor, fp) -> torch.Tensor:
        """Every layer's input of the pass [T, L, P]; `embeds`: the scaled token embeddings [T, H]."""
        t = input_ids.shape[0]
        tokens = self.embed_tokens_per_layer(input_ids) * self._embed_scale(embeds.dtype)
        projected = self.per_layer_model_projection.forward(embeds) * self.projection_scale
        n = self.per_layer_projection_norm
        projected = fp.norm(projected.view(t * self.num_layers, self.size), n.weight, n.eps)
        return (projected.view(t, self.num_layers, self.size) + tokens.view(t, self.num_layers, self.size)) \
            * 2.0 ** -0.5

    def _embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        scale = self._embed_scales.get(dtype)
        if scale is None:   # transformers keeps sqrt(P) as an fp32 buffer, cast to the weights' dtype
            scale = self._embed_scales[dtype] = torch.tensor(self.size ** 0.5).to(dtype)
        return scale


class LayerInputGate(nn.Module):
    """One layer's part: its input gates a projection added to the residual stream."""

    def __init__(self, index: int, hidden_size: int, size: int, eps: float):
        super().__init__()
        self.index = index
        self.per_layer_input_gate = nn.Linear(hidden_size, size, bias=False)
        self.per_layer_projection = nn.Linear(size, hidden_size, bias=False)
        self.post_per_layer_input_norm = _Norm(hidden_size, eps)

    def forward(self, x: torch.Tensor, fp) -> None:
        """x += norm(proj(gelu_tanh(gate(x)) * this layer's input)), in place."""
        h = F.gelu(self.per_layer_input_gate.forward(x), approximate="tanh") * fp.layer_inputs[:, self.index]
        n = self.post_per_layer_input_norm
        x.add_(fp.norm(self.per_layer_projection.forward(h), n.weight, n.eps))
