"""The model's shape, read from a Hugging Face `config.json` (transformers 4.x and 5.x spellings)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"           # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_id: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    layer_windows: tuple[int | None, ...]  # sliding window per layer (None: full attention)
    dtype: torch.dtype

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + lm_head


def load_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory: config.json is missing")
    raw = json.loads(path.read_text())
    return parse_model_config(raw, model_id=Path(model_dir).resolve().name)


def parse_model_config(raw: dict, model_id: str) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only silu (SwiGLU) is supported")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in raw:
            raise ValueError(f"config.json lacks required field {key!r}")
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    n_layers = raw["num_hidden_layers"]
    is_qwen = arch == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype_name not in TORCH_DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {dtype_name!r}")
    return ModelConfig(
        architecture=arch,
        model_id=model_id,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen else attention_bias,
        o_bias=False if is_qwen else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope=_parse_rope(raw),
        layer_windows=_layer_windows(raw, arch, n_layers),
        dtype=TORCH_DTYPES[dtype_name],
    )


def _parse_rope(raw: dict) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; 4.x writes `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope type {kind!r}: supported are default, linear, llama3")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _layer_windows(raw: dict, arch: str, n_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if arch == "LlamaForCausalLM" or not window:
        return (None,) * n_layers
    layer_types = raw.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch == "Qwen2ForCausalLM":
        if not raw.get("use_sliding_window", False):
            return (None,) * n_layers
        first = raw.get("max_window_layers", n_layers)
        return tuple(window if i >= first else None for i in range(n_layers))
    return (int(window),) * n_layers
