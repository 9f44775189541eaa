"""Load a local Hugging Face model directory: config, safetensors weights, tokenizer, eos ids."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from cluster.model.deepseek import DeepseekForCausalLM
from cluster.model.deepseek_weights import deepseek_layer_state_dict
from cluster.model.llama import CausalLM
from cluster.model.model_config import ModelConfig, load_model_config
from cluster.model.moe_loader import moe_layer_state_dict
from cluster.model.tokenizer import load_tokenizer  # noqa: F401 (re-exported: the engine's callers find it here)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def load_generation_defaults(model_dir: Path) -> GenerationDefaults:
    """eos ids from generation_config.json, as transformers' generate uses them; config.json's
    eos_token_id is the fallback (transformers derives its generation config from it too)."""
    model_dir = Path(model_dir)
    gen_path = model_dir / "generation_config.json"
    raw_cfg = json.loads((model_dir / "config.json").read_text())
    raw = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    if not gen_path.is_file():
        log.warning("%s has no generation_config.json; using eos_token_id from config.json", model_dir)
    eos = raw.get("eos_token_id", raw_cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return GenerationDefaults(eos_token_ids=eos_ids, bos_token_id=raw.get("bos_token_id", raw_cfg.get("bos_token_id")))


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards named in the index are missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{model_dir} has no model.safetensors nor model.safetensors.index.json")


class LazyCheckpoint:
    """A checkpoint's tensors by name, each read from its shard straight onto `device` when it is
    taken: a checkpoint is never whole in host memory on its way to a GPU (safetensors reads into
    the device tensor), and on CPU the host holds one copy, not a checkpoint plus its conversion."""

    def __init__(self, model_dir: Path, device: str | torch.device = "cpu"):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._handles = [safe_open(str(f), framework="pt", device=str(device)) for f in _weight_files(Path(model_dir))]
        self._where = {name: h for h in self._handles for name in h.keys()}
        self.reads = 0

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads += 1
        return self._where[name].get_tensor(name)


class TensorTaker:
    """Fetches checkpoint tensors by name, recording the missing ones so that one error names them all."""

    def __init__(self, hf: LazyCheckpoint | dict[str, torch.Tensor]):
        self.hf = hf
        self.missing: list[str] = []

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.hf:
            self.missing.append(name)
            return torch.empty(0)
        return self.hf[name]


# Checkpoints whose attention and MLP input projections are stored fused already, in our layout
# (q, k, v rows; gate, up rows).
_FUSED_CHECKPOINTS = ("Phi3ForCausalLM",)


def _fused(take, prefix: str, fused: str, parts: tuple[str, ...], stored_fused: bool,
           kind: str = "weight") -> torch.Tensor:
    if stored_fused:
        return take(f"{prefix}{fused}.{kind}")
    return torch.cat([take(f"{prefix}{p}.{kind}") for p in parts])


def layer_state_dict(cfg: ModelConfig, take, hf_prefix: str, our_prefix: str,
                     layer: int | None = None) -> dict[str, torch.Tensor]:
    """One decoder layer: transformers' names under `hf_prefix` onto ours under `our_prefix`,
    q, k and v fused into one projection, gate and up into another (taken as they are where the
    checkpoint stores them fused: Phi-3). `take(name)` fetches a tensor (and records a miss).
    `layer`: its index, where the model's sparse layers (MoE) differ from its dense ones."""
    a, m = hf_prefix + "self_attn.", hf_prefix + "mlp."
    stored_fused = cfg.architecture in _FUSED_CHECKPOINTS
    shares_kv = layer is not None and cfg.shares_kv(layer)   # no k/v projections: queries only
    qkv, gate_up = ("q_proj",) if shares_kv else ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    out = {our_prefix + "self_attn.qkv_proj.weight": _fused(take, a, "qkv_proj", qkv, stored_fused)}
    if cfg.qkv_bias:
        out[our_prefix + "self_attn.qkv_proj.bias"] = _fused(take, a, "qkv_proj", qkv, stored_fused, "bias")
    out[our_prefix + "self_attn.o_proj.weight"] = take(a + "o_proj.weight")
    if cfg.o_bias:
        out[our_prefix + "self_attn.o_proj.bias"] = take(a + "o_proj.bias")
    if cfg.moe is not None and layer is not None and cfg.moe.is_sparse(layer):
        out.update(moe_layer_state_dict(cfg, take, hf_prefix, our_prefix))
    else:
        out[f"{our_prefix}mlp.gate_up_proj.weight"] = _fused(take, m, "gate_up_proj", gate_up, stored_fused)
        out[f"{our_prefix}mlp.down_proj.weight"] = take(m + "down_proj.weight")
    if cfg.mlp_bias:
        out[f"{our_prefix}mlp.gate_up_proj.bias"] = _fused(take, m, "gate_up_proj", gate_up, stored_fused, "bias")
        out[f"{our_prefix}mlp.down_proj.bias"] = take(m + "down_proj.bias")
    for name in _layer_norms(cfg, shares_kv):
        out[our_prefix + name] = take(hf_prefix + name)
    if cfg.layer_scalar:
        out[our_prefix + "layer_scalar"] = take(hf_prefix + "layer_scalar")
    if cfg.per_layer_input_size:
        for name in ("per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight"):
            out[f"{our_prefix}per_layer_input.{name}"] = take(hf_prefix + name)
    return out


def _layer_norms(cfg: ModelConfig, shares_kv: bool = False) -> list[str]:
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if cfg.sandwich_norm:
        names += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if cfg.qk_norm:
        names += ["self_attn.q_norm.weight"] + ([] if shares_kv else ["self_attn.k_norm.weight"])
    return names


def _our_state_dict(cfg: ModelConfig, hf: LazyCheckpoint | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map transformers' parameter names onto ours, fusing q, k and v into one projection."""
    take = TensorTaker(hf)
    missing = take.missing
    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    if cfg.per_layer_input_size:
        for name in ("embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
                     "per_layer_projection_norm.weight"):
            out[f"per_layer_inputs.{name}"] = take(f"model.{name}")
    for i in range(cfg.num_layers):
        if cfg.mla is not None:
            out.update(deepseek_layer_state_dict(cfg, take, f"model.layers.{i}.", f"layers.{i}.", i))
        else:
            out.update(layer_state_dict(cfg, take, f"model.layers.{i}.", f"layers.{i}.", i))
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensors: {shown}")
    if cfg.norm_offset:   # Gemma's norms scale by (1 + w): folded in once, in fp32 as transformers adds it
        for name in [n for n in out if n.endswith("norm.weight")]:
            out[name] = out[name].float() + cfg.norm_offset
    return out


def load_model(model_dir: Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               max_positions: int | None = None) -> tuple[ModelConfig, CausalLM]:
    """Build the model and load its weights. `dtype` None keeps the checkpoint's own dtype."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist (--model takes a Hugging Face "
                                "directory, a .gguf file, or a built-in name: stdlib-coder)")
    cfg = load_model_config(model_dir)
    dtype = dtype or cfg.dtype
    state = _our_state_dict(cfg, LazyCheckpoint(model_dir, device))   # read onto the device, fused there
    # Built on the meta device (no random init, no memory): the checkpoint's tensors are assigned
    # as the parameters, so the weights exist once, never beside an empty copy of themselves.
    # The rotary table is computed, not loaded.
    with torch.device("meta"):
        model = (CausalLM if cfg.mla is None else DeepseekForCausalLM)(cfg, max_positions or cfg.max_position_embeddings)
    model.build_rotary(max_positions or cfg.max_position_embeddings, device)
    # One tensor at a time: each source is dropped as soon as its converted copy exists.
    converted = {k: state.pop(k).to(device=device, dtype=dtype) for k in list(state)}
    result = model.load_state_dict(converted, strict=False, assign=True)
    unexpected = [k for k in result.missing_keys
                  if not k.startswith(("rotary.", "local_rotary.")) and k != "lm_head.weight"]
    if unexpected:
        raise ValueError(f"weights not loaded: {unexpected}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(f"weights not loaded: {still_meta}")
    model.eval()
    return cfg, model
