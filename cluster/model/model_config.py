"""The model's shape, read from a Hugging Face `config.json` (transformers 4.x and 5.x spellings).

Families: Llama, Qwen2, Mistral, Qwen3 (per-head q/k RMSNorm), Gemma 3 text (norms with (1 + w),
GeGLU, scaled embeddings, sandwich norms, sliding and global layers with their own RoPE, logit
soft-capping, `query_pre_attn_scalar`), Gemma 4 text (gemma4_config.py: cross-layer KV sharing,
value norms, layer scalars, proportional RoPE, per-layer inputs), Phi-3 (fused qkv and gate/up in
the checkpoint) and the mixtures of experts Qwen2-MoE, Qwen3-MoE and Mixtral (their experts: moe_config.py). What a
checkpoint needs beyond that is refused here, with an error that names the feature."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.model.gemma4_config import GEMMA4, gemma4_fields
from cluster.model.mla_config import MLA_ARCHITECTURES, MLAConfig, mla_fields
from cluster.model.moe_config import (
    MOE_ARCHITECTURES,
    REFUSED_MOE_ARCHITECTURES,
    MoEConfig,
    parse_moe_config,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                           "Qwen3ForCausalLM", "Gemma3ForCausalLM", GEMMA4, "Phi3ForCausalLM", *MOE_ARCHITECTURES,
                           *MLA_ARCHITECTURES)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")   # the gated MLP's: SwiGLU, GeGLU (tanh approximation)
ROPE_KINDS = ("default", "linear", "llama3", "proportional")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_GEMMA3 = "Gemma3ForCausalLM"
_GEMMAS = (_GEMMA3, GEMMA4)
# Architectures named in a checkpoint that we know and refuse, with the reason.
_REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration, "
                                      "vision tower) are not supported; the text model Gemma3ForCausalLM is",
    "Gemma4ForConditionalGeneration": "Gemma 4 multimodal checkpoints (Gemma4ForConditionalGeneration, vision "
                                      "and audio towers) are not supported; the text model Gemma4ForCausalLM is",
    **{arch: f"Gemma 3n ({arch}: AltUp, LAuReL, activation sparsity and per-layer inputs) is not supported; "
             "its cross-layer KV sharing is, on Gemma4ForCausalLM"
       for arch in ("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration")},
    **REFUSED_MOE_ARCHITECTURES,
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"           # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial: float = 1.0            # proportional: the fraction of each head's dims rotated (the rest kept)


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
    # Family features; the defaults are Llama's.
    hidden_act: str = "silu"                   # the gated MLP's activation (ACTIVATIONS)
    qk_norm: bool = False                      # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0                   # norms scale by (offset + checkpoint weight) (Gemma: 1)
    sandwich_norm: bool = False                # norms on the attention and MLP outputs, and before the MLP (Gemma 3)
    embed_scale: float | None = None           # embeddings times this, rounded to the dtype (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # the softmax scale is its -1/2 power (None: head_dim's)
    final_logit_softcap: float | None = None   # logits = cap * tanh(logits / cap)
    local_rope: RopeConfig | None = None       # RoPE of the layers in `local_layers` (Gemma 3's sliding layers)
    local_layers: tuple[bool, ...] = ()        # per layer: True where local_rope applies (empty: none)
    v_norm: bool = False                       # a scale-free RMSNorm over each value head (Gemma 4)
    layer_scalar: bool = False                 # each layer's output times a scalar of the checkpoint (Gemma 4)
    # Cross-layer KV sharing (Gemma 4's num_kv_shared_layers): per layer, the layer whose K/V it
    # attends, itself where it computes its own; a layer reading another's computes and stores
    # none (the arena holds `num_kv_layers`). Empty: every layer its own.
    kv_source_layer: tuple[int, ...] = ()
    double_wide_shared_mlp: bool = False       # the KV-shared layers' MLPs twice as wide (use_double_wide_mlp)
    per_layer_input_size: int = 0              # Gemma 4's per-layer inputs (hidden_size_per_layer_input; 0: none)
    per_layer_vocab_size: int = 0              # their embedding's rows (vocab_size_per_layer_input)
    moe: MoEConfig | None = None               # the experts of a mixture-of-experts model (moe_config.py)
    mla: MLAConfig | None = None               # DeepSeek's latent attention, experts and MTP (mla_config.py)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale: head_dim ** -0.5, or query_pre_attn_scalar ** -0.5 where set (Gemma)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_is_local(self, i: int) -> bool:
        return bool(self.local_layers) and self.local_layers[i]

    def shares_kv(self, i: int) -> bool:
        """Layer i attends another layer's K/V and computes none."""
        return bool(self.kv_source_layer) and self.kv_source_layer[i] != i

    @property
    def num_kv_layers(self) -> int:
        """The layers that own K/V: the KV arena's layer count."""
        return sum(not self.shares_kv(i) for i in range(self.num_layers))

    def kv_arena_layers(self) -> tuple[int, ...]:
        """Per layer, the arena layer holding the K/V it attends (its source's place among the owners)."""
        owners = [i for i in range(self.num_layers) if not self.shares_kv(i)]
        return tuple(owners.index(self.kv_source_layer[i] if self.kv_source_layer else i)
                     for i in range(self.num_layers))

    def layer_intermediate_size(self, i: int) -> int:
        return self.intermediate_size * (2 if self.double_wide_shared_mlp and self.shares_kv(i) else 1)

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        norms = 2 * h + (2 * h if self.sandwich_norm else 0) + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + norms
        shared = self.num_layers - self.num_kv_layers   # no k, v projections nor k norm
        shared_kv = shared * (h * 2 * self.kv_size + (self.head_dim if self.qk_norm else 0))
        mlps = sum(3 * h * self.layer_intermediate_size(n) for n in range(self.num_layers)) if self.moe is None \
            else self.moe.mlp_parameters(h, i)
        lm_head = 0 if self.tie_word_embeddings else v * h
        p = self.per_layer_input_size   # per-layer inputs: their embedding, projection and norm; each layer's gate
        ple = p and self.num_layers * p * (self.per_layer_vocab_size + h) + p + self.num_layers * (2 * h * p + h)
        scalars = self.num_layers if self.layer_scalar else 0
        return v * h + self.num_layers * per_layer - shared_kv + mlps + h + lm_head + ple + scalars


def load_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory: config.json is missing")
    raw = json.loads(path.read_text())
    return parse_model_config(raw, model_id=Path(model_dir).resolve().name)


def parse_model_config(raw: dict, model_id: str) -> ModelConfig:
    arch = _architecture(raw)
    if arch in MLA_ARCHITECTURES:
        return ModelConfig(model_id=model_id, rope=RopeConfig(), dtype=_dtype(raw), **mla_fields(raw, arch))
    _refuse_unsupported(raw, arch)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in raw:
            raise ValueError(f"config.json lacks required field {key!r}")
    heads = raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    n_layers = raw["num_hidden_layers"]
    is_qwen2 = arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and raw.get("qkv_bias", True))
    attention_bias = bool(raw.get("attention_bias", False))
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
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch in _GEMMAS)),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        layer_windows=_layer_windows(raw, arch, n_layers),
        dtype=_dtype(raw),
        moe=parse_moe_config(raw, arch, n_layers),
        **_family_fields(raw, arch, n_layers),
    )


def _dtype(raw: dict) -> torch.dtype:
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype_name not in TORCH_DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {dtype_name!r}")
    return TORCH_DTYPES[dtype_name]


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        refused = next((_REFUSED_ARCHITECTURES[a] for a in archs if a in _REFUSED_ARCHITECTURES), None)
        if refused:
            raise ValueError(refused)
        raise ValueError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _refuse_unsupported(raw: dict, arch: str) -> None:
    """A ValueError naming the first feature of the checkpoint that this model code lacks."""
    act = _activation(raw, arch)
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden activation {act!r} (hidden_act): supported are silu (SwiGLU) "
                         "and gelu_pytorch_tanh (GeGLU)")
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    full = _rope_sources(raw)[0]
    partial = full.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0 and full.get("rope_type") != "proportional":
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")


def _activation(raw: dict, arch: str) -> str:
    if arch in _GEMMAS:   # Gemma writes hidden_activation
        return raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    return raw.get("hidden_act", "silu")


def _family_fields(raw: dict, arch: str, n_layers: int) -> dict:
    """The ModelConfig fields beyond Llama's: per-head norms, Gemma's norms, scales and RoPE."""
    rope, local_rope = _parse_ropes(raw, arch)
    fields = dict(rope=rope, hidden_act=_activation(raw, arch),
                  qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *_GEMMAS))
    cap = raw.get("final_logit_softcapping")
    if cap is not None:
        fields["final_logit_softcap"] = float(cap)
    if arch == GEMMA4:
        fields.update(gemma4_fields(raw, _layer_types(raw, arch, n_layers)))
    if arch == _GEMMA3:
        fields.update(norm_offset=1.0, sandwich_norm=True, embed_scale=raw["hidden_size"] ** 0.5,
                      query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)))
    if arch in _GEMMAS and local_rope != rope:
        fields.update(local_rope=local_rope,
                      local_layers=tuple(t == "sliding_attention" for t in _layer_types(raw, arch, n_layers)))
    return fields


def _rope_sources(raw: dict) -> tuple[dict, dict | None]:
    """(the global RoPE's parameters, the sliding layers' or None). transformers 5 writes
    `rope_parameters` (per layer type for Gemma 3); 4.x writes `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        return dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    return {**(raw.get("rope_scaling") or {}), **params}, None


def _parse_ropes(raw: dict, arch: str) -> tuple[RopeConfig, RopeConfig | None]:
    full, local = _rope_sources(raw)
    gemma = arch in _GEMMAS
    rope = _rope(full, float(raw.get("rope_theta", 1_000_000.0 if gemma else 10000.0)))
    if not gemma:
        return rope, None
    if local is None:   # transformers 4.x: the sliding layers' base is rope_local_base_freq, unscaled
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    return rope, _rope(local, 10000.0)


def _rope(params: dict, default_theta: float) -> RopeConfig:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_KINDS:
        raise ValueError(f"RoPE scaling {kind!r} (rope_type in rope_scaling / rope_parameters) is not supported: "
                         f"supported are {', '.join(ROPE_KINDS)}")
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        partial=float(params.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0,
    )


def _layer_types(raw: dict, arch: str, n_layers: int) -> tuple[str, ...] | None:
    layer_types = raw.get("layer_types")
    if layer_types:
        if len(layer_types) != n_layers:
            raise ValueError(f"layer_types names {len(layer_types)} layers, num_hidden_layers is {n_layers}")
        return tuple(layer_types)
    if arch in _GEMMAS:   # older configs: every `sliding_window_pattern`-th layer is global
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers))
    return None


def _layer_windows(raw: dict, arch: str, n_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    # Qwen's configs keep a window that only `use_sliding_window` turns on (transformers drops it otherwise).
    if arch == "LlamaForCausalLM" or not window or (qwen and not raw.get("use_sliding_window", False)):
        return (None,) * n_layers
    layer_types = _layer_types(raw, arch, n_layers)
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if qwen:
        first = raw.get("max_window_layers", n_layers)
        return tuple(window if i >= first else None for i in range(n_layers))
    return (int(window),) * n_layers
