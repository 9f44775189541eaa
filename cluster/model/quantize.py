"""Weight-only quantization of a loaded model (`--quantization`): its linear layers replaced by
`QuantLinear`s whose weights stay quantized in memory; activations, norms, attention and the KV
cache keep the model's dtype, and the kernels accumulate in float32 (kernels/cpu_quant.py).

  auto   the default, resolved by EngineConfig (cluster/config.py auto_quantization): gguf for a GGUF
         model whose tensors are all Q4_0/Q4_1/Q8_0 (on CPU), none for anything else
  none   the weights as loaded (a GGUF file's tensors dequantized once, as every other loader does)
  int8   each linear quantized at load, int8 per output channel (symmetric, one scale per row)
  int4   each linear quantized at load, 4 bits in groups of 32 with a scale and a minimum (Q4_1)
  gguf   a GGUF model's Q4_0 / Q4_1 / Q8_0 tensors served as they are in the file, never dequantized
         into a second copy (the model's directory names its file: gguf_source.json)

The embedding table stays in the model's dtype (a lookup reads one row per token); an untied LM
head is quantized like the other linears, a tied one (SmolLM2's) reads the file's quantized
embedding tensor under `gguf` and is quantized from the table under int8/int4.
"""
from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from torch import nn

from cluster.model.gguf_import import unpermute
from cluster.model.model_config import ModelConfig
from cluster.model.quant_linear import QuantLinear
from kernels.cpu_quant import QuantFormat, QuantizedWeight

log = logging.getLogger(__name__)


class Quantization(str, enum.Enum):
    AUTO = "auto"   # resolved by EngineConfig (cluster/config.py auto_quantization) before anything loads
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    GGUF = "gguf"


@dataclass(frozen=True)
class QuantReport:
    """What quantizing a model did, for the start-up log and the bench."""
    scheme: Quantization
    layers: int                # linear layers replaced
    formats: tuple[str, ...]   # the weight formats they hold (Q4_1, Q8_0, INT8, ...)
    weight_bytes: int          # bytes of the quantized linear weights (scales included)

    def describe(self) -> str:
        return (f"weights: {self.scheme.value}, {self.layers} linear layers as {'/'.join(self.formats)}, "
                f"{self.weight_bytes / 2**20:.1f} MiB")


def check_quantization(scheme: Quantization, device_type: str, model_dir: Path) -> None:
    """Refuse, before anything loads, a scheme this engine cannot serve, saying what would."""
    if scheme is Quantization.AUTO:
        raise ValueError("--quantization auto is resolved by the engine's config (EngineConfig) before loading")
    if scheme is Quantization.NONE:
        return
    if device_type != "cpu":
        raise ValueError(f"--quantization {scheme.value}: quantized weights run on CPU here; on {device_type} "
                         "serve the model with --quantization none")
    if scheme is Quantization.GGUF and gguf_source(model_dir) is None:
        raise ValueError(f"--quantization gguf serves a GGUF file's tensors, and {model_dir} is not a GGUF model; "
                         "give --model a .gguf file, or quantize at load with --quantization int8 or int4")


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted model directory came from (cluster/model/gguf_import.py)."""
    meta = Path(model_dir) / "gguf_source.json"
    if not meta.is_file():
        return None
    return Path(json.loads(meta.read_text())["gguf"])


def quantize_model(model: nn.Module, cfg: ModelConfig, scheme: Quantization, model_dir: Path,
                   act_int8: bool = False) -> QuantReport | None:
    """Replace `model`'s linear layers by quantized ones; None for `none`. `act_int8`: the 4-bit
    layers multiply int8-quantized activations (`--quantized-activations int8`)."""
    if scheme is Quantization.NONE:
        return None
    check_quantization(scheme, next(model.parameters()).device.type, model_dir)
    if cfg.moe is not None:   # the experts are stacked tensors (cluster/model/moe.py), not linear layers
        raise ValueError(f"--quantization {scheme.value}: quantized experts of a mixture-of-experts model "
                         f"({cfg.architecture}) are not supported; serve it with --quantization none")
    if scheme is Quantization.GGUF:
        weights = _gguf_weights(cfg, gguf_source(model_dir))
    else:
        at_load = QuantFormat.INT8 if scheme is Quantization.INT8 else QuantFormat.Q4_1
        weights = {name: QuantizedWeight.quantize(mod.weight, at_load) for name, mod in _linears(model)}
    report = _install(model, scheme, weights)
    if act_int8:
        _int8_activations(model)
    return report


def _int8_activations(model: nn.Module) -> None:
    four_bit = [m for m in model.modules() if isinstance(m, QuantLinear)
                and m.qweight.format in (QuantFormat.Q4_0, QuantFormat.Q4_1)]
    for m in four_bit:
        m.act_int8 = True
    log.info("activations: int8 per block of 32 into %d 4-bit linear layers", len(four_bit))


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]


def _install(model: nn.Module, scheme: Quantization, weights: dict) -> QuantReport:
    """Swap each named nn.Linear for a QuantLinear over its quantized weight (and its bias)."""
    formats, total = set(), 0
    for name, linear in _linears(model):
        if name not in weights:
            raise ValueError(f"no quantized weight for linear layer {name!r}")
        qw = weights[name]
        if (qw.n, qw.k) != (linear.out_features, linear.in_features):
            raise ValueError(f"{name}: quantized weight is {qw.n}x{qw.k}, the layer "
                             f"{linear.out_features}x{linear.in_features}")
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, QuantLinear(qw, linear.bias))
        formats.add(qw.format.value)
        total += qw.nbytes
    report = QuantReport(scheme, len(weights), tuple(sorted(formats)), total)
    log.info("%s", report.describe())
    return report


# GGUF tensor names of a Llama-family layer, by our fused module (rows concatenated in this order).
_GGUF_PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
               "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


def _gguf_weights(cfg: ModelConfig, path: Path) -> dict:
    """Our linear layers' weights from the file's quantized tensors: Q and K rows put back in
    Hugging Face's rotary order and fused parts concatenated, all on the raw blocks (a row of
    blocks is a row of the matrix), never dequantized."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    out = {}
    for i in range(cfg.num_layers):
        for ours, parts in _GGUF_PARTS.items():
            out[f"layers.{i}.{ours}"] = _fused_raw(tensors, [f"blk.{i}.{p}.weight" for p in parts], cfg)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    out["lm_head"] = _fused_raw(tensors, [head], cfg)
    return out


def _fused_raw(tensors: dict, names: list[str], cfg: ModelConfig):
    kinds = {tensors[n].tensor_type.name for n in names}
    if len(kinds) != 1:
        raise ValueError(f"--quantization gguf: {', '.join(names)} are stored as {', '.join(sorted(kinds))}; "
                         "a fused projection needs one type (serve with --quantization none)")
    rows = []
    for name in names:
        raw = np.asarray(tensors[name].data)
        if ".attn_q." in name:
            raw = unpermute(raw, cfg.num_heads)
        elif ".attn_k." in name:
            raw = unpermute(raw, cfg.num_kv_heads)
        rows.append(raw)
    raw = np.ascontiguousarray(np.concatenate(rows) if len(rows) > 1 else rows[0])
    k = int(tensors[names[0]].shape[0])          # GGUF lists dims fastest first: [K, N]
    return QuantizedWeight.from_gguf(raw, tensors[names[0]].tensor_type, (raw.shape[0], k))
