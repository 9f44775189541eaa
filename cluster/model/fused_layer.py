"""Whole decoder layers in one C call (kernels/cpu/parallel.cpp's ss_decode_layer) for pure-decode
passes on quantized weights.

At batch 1 a 4-bit decode step was ~11 ms, and about half of it was the interpreter and the
thread team waking between calls: ~8 Python calls into the C ops per layer (norm, qkv, decode
block, o, add-norm, gate_up, SiLU-times-up, down, the residual add), each with its checks and its
output allocation (bench/fused_layers.py: 85 -> 157 tok/s on the default model's GGUF). The C function calls
the same entry points in the same order on scratch rows allocated once per pass, so the result
is the same bits (tests/integration/test_quantized_engine.py holds it to the layer-by-layer path).

It runs where every step of the layer would have taken the C ops anyway: the pass is a pure
decode on the fused C decode block (ForwardPass.fused_block) with the plan's fused C norm and
activation, and the layer is a plain pre-norm Llama-family layer (no sandwich norms, no QK norm,
SiLU) whose four projections are `QuantLinear`s. Anything else runs layer by layer, as before.
"""
from __future__ import annotations

import torch

from cluster.model.kernel_plan import ActPath, NormPath
from cluster.model.quant_linear import QuantLinear
from kernels import cpu_ops
from kernels.cpu_quant import ACT_INT8, BF16_DOT

ENABLED = True   # tests compare against the layer-by-layer path by turning it off


def _qweight(linear: torch.nn.Module) -> cpu_ops.SsQWeight:
    qw = linear._moved_weight()
    quants, scales, mins, fmt = qw._kernel_args
    bias = linear.bias
    return cpu_ops.SsQWeight(quants, scales, mins, None if bias is None else bias.data_ptr(), qw.n,
                             fmt | (ACT_INT8 if linear.act_int8 else BF16_DOT if linear.bf16_dot else 0))


def layer_args(layer, rotary, local_rotary) -> cpu_ops.SsLayer | None:
    """The layer's weights as ss_decode_layer reads them; None where the layer does not qualify."""
    attn, mlp = layer.self_attn, layer.mlp
    if not hasattr(mlp, "gate_up_proj"):   # a mixture of experts (moe.py) runs layer by layer
        return None
    if attn.kv_source is not None or attn.feeds_shared:   # cross-layer KV sharing runs layer by layer
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if layer.sandwich or attn.cfg.qk_norm or mlp.geglu or not all(isinstance(m, QuantLinear) for m in linears):
        return None
    if any(m.quants.device.type != "cpu" or (m.bias is not None and m.bias.dtype != torch.float32) for m in linears):
        return None
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    table = local_rotary if layer.local else rotary
    return cpu_ops.SsLayer(n1.weight.data_ptr(), n2.weight.data_ptr(), n1.eps, layer.window or 0,
                           table.cos.data_ptr(), table.sin.data_ptr(), *(_qweight(m) for m in linears))


class FusedLayers:
    """One pass's calls: the pass's struct and scratch rows, and each layer's cached weights."""

    def __init__(self, model, layers: list, x: torch.Tensor, fp, kv_cache: torch.Tensor):
        cfg, backend, meta = model.cfg, fp.backend, fp.meta
        b = x.shape[0]
        dm = meta.decode
        tables = dm.block_table.view(b, -1)
        qkv_n = cfg.q_size + 2 * cfg.kv_size
        empty = lambda width: torch.empty((b, width), dtype=x.dtype)   # noqa: E731
        # Kept alive for the pass: the struct holds their addresses.
        self._keep = [tables, dm.lens, fp.positions, meta.slot_mapping,
                      *(empty(w) for w in (cfg.hidden_size, qkv_n, cfg.q_size, cfg.hidden_size,
                                          2 * cfg.intermediate_size, cfg.intermediate_size))]
        h, qkv, attn, y, gate_up, act = self._keep[4:]
        self.step = cpu_ops.SsDecodePass(
            b, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
            kv_cache.shape[3], tables.shape[1], cpu_ops.kv_code(kv_cache, getattr(backend, "int4_view", False)),
            1 if x.dtype == torch.bfloat16 else 0, backend.scale, fp.positions.data_ptr(),
            meta.slot_mapping.data_ptr(), tables.data_ptr(), dm.lens.data_ptr(), h.data_ptr(), qkv.data_ptr(),
            attn.data_ptr(), y.data_ptr(), gate_up.data_ptr(), act.data_ptr())
        self.layers = layers
        self.kv_layers = model.kv_layers   # each layer's place in the arena (cross-layer KV sharing)
        base, itemsize = kv_cache.data_ptr(), kv_cache.element_size()
        self._k0, self._layer_bytes, self._kv_bytes = base, kv_cache.stride(0) * itemsize, kv_cache.stride(1) * itemsize
        self.x = x.data_ptr()

    def run(self, i: int) -> bool:
        """Layer i in one call; False where it does not qualify (the caller runs it layer by layer)."""
        args = self.layers[i]
        if args is None:
            return False
        k = self._k0 + self.kv_layers[i] * self._layer_bytes
        cpu_ops.decode_layer(args, self.step, self.x, k, k + self._kv_bytes)
        return True


def prepare(model, x: torch.Tensor, fp, kv_cache: torch.Tensor) -> FusedLayers | None:
    """The pass's fused layers, or None where the pass does not qualify."""
    if not (ENABLED and fp.fused_block and fp.norm_path is NormPath.FUSED_C and fp.act_path is ActPath.FUSED_C
            and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous() and kv_cache.is_contiguous()
            and cpu_ops.has_decode_layer()):
        return None
    layers = model.fused_layer_args()
    if not any(a is not None for a in layers):
        return None
    return FusedLayers(model, layers, x, fp, kv_cache)
