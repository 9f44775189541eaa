"""Gemma 4 text checkpoints (Gemma4ForCausalLM): what they add to Gemma 3, and cross-layer KV sharing.

Beyond Gemma 3 (sandwich norms, GeGLU, scaled embeddings, sliding and full layers with their own
RoPE) a Gemma 4 text layer has: plain-weight norms (no 1 + w), a scale-free RMSNorm over each value
head, a softmax scale of 1, a learned scalar on each layer's output, proportional RoPE on the full
layers, per-layer input embeddings (`hidden_size_per_layer_input`: per_layer_inputs.py), and **KV sharing**: the last `num_kv_shared_layers` layers compute no K/V and attend the
K/V of the last earlier layer of their type (transformers' `kv_sharing_modes`), with MLPs twice as
wide there where `use_double_wide_mlp` says so.

Refused by name, at load: a full-attention head size or KV head count other than the sliding layers'
(`global_head_dim`, `num_global_key_value_heads`, `per_layer_config`: one KV row width per arena),
keys reused as values (`attention_k_eq_v`), the mixture-of-experts block (`enable_moe_block`), and
every layer shared. Below model_config (imports nothing of it): one direction only."""
from __future__ import annotations

GEMMA4 = "Gemma4ForCausalLM"
_FULL_HEAD_DIM_DEFAULT = 512   # transformers' global_head_dim default, where the config names none


def gemma4_fields(raw: dict, layer_types: tuple[str, ...]) -> dict:
    """The ModelConfig fields of a Gemma 4 text checkpoint beyond what it shares with Gemma 3;
    a ValueError naming the first feature the model code lacks."""
    _refuse_unsupported(raw, layer_types)
    sources = kv_source_layers(layer_types, int(raw.get("num_kv_shared_layers") or 0))
    per_layer = int(raw.get("hidden_size_per_layer_input") or 0)
    return {"norm_offset": 0.0, "sandwich_norm": True, "embed_scale": raw["hidden_size"] ** 0.5,
            "query_pre_attn_scalar": 1.0, "v_norm": True, "layer_scalar": True, "kv_source_layer": sources,
            "double_wide_shared_mlp": bool(raw.get("use_double_wide_mlp")) and bool(sources),
            "per_layer_input_size": per_layer,
            "per_layer_vocab_size": int(raw.get("vocab_size_per_layer_input", 262_144)) if per_layer else 0}


def kv_source_layers(layer_types: tuple[str, ...], num_shared: int) -> tuple[int, ...]:
    """Per layer, the layer whose K/V it attends: itself, or for the last `num_shared` layers the
    last earlier non-shared layer of the same type. () where nothing is shared."""
    n = len(layer_types)
    if num_shared <= 0:
        return ()
    if num_shared >= n:
        raise ValueError(f"num_kv_shared_layers ({num_shared}) leaves no layer computing K/V "
                         f"(num_hidden_layers {n})")
    first = n - num_shared
    sources = list(range(first))
    for i in range(first, n):
        owners = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not owners:
            raise ValueError(f"num_kv_shared_layers: layer {i} ({layer_types[i]}) has no earlier "
                             f"{layer_types[i]} layer to share K/V with")
        sources.append(owners[-1])
    return tuple(sources)


def _refuse_unsupported(raw: dict, layer_types: tuple[str, ...]) -> None:
    if raw.get("attention_k_eq_v"):
        raise ValueError("keys reused as values (attention_k_eq_v) are not supported")
    if raw.get("enable_moe_block"):
        raise ValueError("the Gemma 4 mixture-of-experts block (enable_moe_block) is not supported")
    head_dim, kv_heads = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"], \
        raw.get("num_key_value_heads") or raw["num_attention_heads"]
    for i, (dim, heads) in _per_layer_heads(raw, layer_types).items():
        if (dim or head_dim) != head_dim or (heads or kv_heads) != kv_heads:
            raise ValueError(f"per-layer attention sizes (layer {i}: head_dim {dim or head_dim}, "
                             f"{heads or kv_heads} KV heads, where the others have {head_dim} and {kv_heads}: "
                             "global_head_dim / num_global_key_value_heads / per_layer_config) are not supported")


def _per_layer_heads(raw: dict, layer_types: tuple[str, ...]) -> dict[int, tuple[int | None, int | None]]:
    """{layer: (head_dim, KV heads)} overridden per layer, as transformers reads them: the
    config's `per_layer_config`, or where it has none, `global_head_dim` (default 512) on the
    full-attention layers."""
    per_layer = raw.get("per_layer_config")
    if per_layer is not None:
        return {int(i): (o.get("head_dim"), o.get("num_key_value_heads")) for i, o in per_layer.items()}
    dim = raw.get("global_head_dim", _FULL_HEAD_DIM_DEFAULT)
    heads = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v", True) else None
    return {i: (dim, heads) for i, t in enumerate(layer_types) if t == "full_attention"}
