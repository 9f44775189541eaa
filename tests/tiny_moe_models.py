"""The tiny mixture-of-experts checkpoints of tests/tiny_models.py: Qwen3-MoE (top-k 2 of 8,
norm_topk_prob, layer 1 dense through mlp_only_layers), Qwen2-MoE (sparse every 2nd layer via
decoder_sparse_step, the gated shared expert, q/k/v bias) and Mixtral (2 of 4)."""
from __future__ import annotations

MOE_KINDS = ("qwen3moe", "qwen2moe", "mixtral")


def moe_family_config(kind: str, common: dict):
    """(config, model class) of a tiny MoE checkpoint; `common` holds the fields all kinds share."""
    import transformers
    moe = dict(common, num_hidden_layers=3)
    if kind == "qwen3moe":
        return transformers.Qwen3MoeConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
            tie_word_embeddings=False, **moe), transformers.Qwen3MoeForCausalLM
    if kind == "qwen2moe":
        return transformers.Qwen2MoeConfig(
            num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
            decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=True, **moe), transformers.Qwen2MoeForCausalLM
    if kind == "mixtral":
        return transformers.MixtralConfig(
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            tie_word_embeddings=False, **moe), transformers.MixtralForCausalLM
    raise ValueError(kind)
