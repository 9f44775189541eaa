"""DeepSeek-V2 / V3 checkpoints' shape: multi-head latent attention (MLA), its RoPE (yarn where the
config sets it), the mixture-of-experts routing fields and the multi-token-prediction layers.

`model_config.parse_model_config` hands DeepSeek configs here; what comes back are ModelConfig
fields, `mla` among them. Below model_config (imports nothing of it): one direction only."""
from __future__ import annotations

import math
from dataclasses import dataclass

MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
MLA_ROPE_KINDS = ("default", "yarn")
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class YarnRope:
    """transformers' `_compute_yarn_parameters` inputs (DeepSeek's long-context RoPE)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def cos_sin_factor(self) -> float:
        """What transformers multiplies cos and sin by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MoERouting:
    """The routed experts' fields (layers from `first_k_dense_replace` on are MoE)."""
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    scoring: str                 # "sigmoid" (V3: + e_score_correction_bias) | "softmax" (V2)
    topk_method: str             # V3: "noaux_tc"; V2: greedy | group_limited_greedy
    n_group: int | None
    topk_group: int | None
    norm_topk_prob: bool


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None       # None: one q_proj (V2-Lite, small V3s)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_interleave: bool         # RoPE over (even, odd) pairs (V3's default, V2 always)
    yarn: YarnRope | None
    first_k_dense_replace: int
    moe: MoERouting | None
    num_mtp_layers: int           # num_nextn_predict_layers: named by the config, maybe absent from the weights
    attention_bias: bool = False
    version: int = 3

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One token's cached vector per layer: the compressed KV and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.yarn is not None and self.yarn.mscale_all_dim:
            m = _yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim)
            scale *= m * m
        return scale

    def layer_is_moe(self, i: int) -> bool:
        return self.moe is not None and i >= self.first_k_dense_replace


def _rope_params(raw: dict) -> dict:
    return {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}


def _yarn(params: dict, max_positions: int) -> YarnRope | None:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in MLA_ROPE_KINDS:
        raise ValueError(f"RoPE scaling {kind!r} on a DeepSeek checkpoint is not supported: supported are "
                         f"{', '.join(MLA_ROPE_KINDS)}")
    if kind == "default":
        return None
    original = int(params.get("original_max_position_embeddings", max_positions))
    factor = params.get("factor")
    return YarnRope(factor=float(factor if factor is not None else max_positions / original),
                    original_max_position_embeddings=original,
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                    attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))


def _moe(raw: dict, v3: bool) -> MoERouting | None:
    experts = raw.get("n_routed_experts")
    if not experts or raw.get("first_k_dense_replace", 0) >= raw["num_hidden_layers"]:
        return None
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if v3 and method != "noaux_tc":
        raise ValueError(f"DeepSeek-V3 expert routing topk_method={method!r} is not supported (noaux_tc is)")
    if not v3 and method not in V2_TOPK_METHODS:
        raise ValueError(f"DeepSeek-V2 expert routing topk_method={method!r} is not supported: "
                         f"supported are {', '.join(V2_TOPK_METHODS)}")
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"expert scoring_func={scoring!r} is not supported for {'V3' if v3 else 'V2'}")
    return MoERouting(num_experts=int(experts), top_k=int(raw["num_experts_per_tok"]),
                      moe_intermediate_size=int(raw["moe_intermediate_size"]),
                      num_shared_experts=int(raw.get("n_shared_experts") or 0),
                      routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                      scoring=scoring, topk_method=method, n_group=raw.get("n_group"),
                      topk_group=raw.get("topk_group"), norm_topk_prob=bool(raw.get("norm_topk_prob", v3)))


def mla_fields(raw: dict, arch: str) -> dict:
    """ModelConfig's fields for a DeepSeek config, but for `rope` and the dtype (model_config's).
    The ModelConfig head fields keep their meaning for what reads them generally (q_size: the
    queries' width); the KV cache is the latent one (`KVLayout.latent_dim`)."""
    v3 = arch == "DeepseekV3ForCausalLM"
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden activation {raw.get('hidden_act')!r} (hidden_act) on DeepSeek: silu is")
    if raw.get("mlp_bias"):
        raise ValueError("MLP biases (mlp_bias) on DeepSeek are not supported")
    heads = int(raw["num_attention_heads"])
    max_pos = int(raw.get("max_position_embeddings", 2048))
    params = _rope_params(raw)
    partial = params.get("partial_rotary_factor", 1.0)
    if float(partial) != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]), rope_theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True, yarn=_yarn(params, max_pos),
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)), moe=_moe(raw, v3),
        num_mtp_layers=int(raw.get("num_nextn_predict_layers", 0) or 0) if v3 else 0,
        attention_bias=bool(raw.get("attention_bias", False)), version=3 if v3 else 2)
    n_layers = int(raw["num_hidden_layers"])
    return {"architecture": arch, "vocab_size": int(raw["vocab_size"]), "hidden_size": int(raw["hidden_size"]),
            "intermediate_size": int(raw["intermediate_size"]), "num_layers": n_layers, "num_heads": heads,
            "num_kv_heads": heads, "head_dim": mla.qk_head_dim, "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
            "max_position_embeddings": max_pos, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
            "qkv_bias": False, "o_bias": mla.attention_bias, "mlp_bias": False, "layer_windows": (None,) * n_layers,
            "mla": mla}
