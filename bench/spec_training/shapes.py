"""Model shapes for the target and the draft (both plain HF Llama)."""
from __future__ import annotations

from transformers import LlamaConfig

from .tokenizer import EOT_ID, VOCAB_SIZE

COMMON = dict(
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=EOT_ID,
    eos_token_id=EOT_ID,
    pad_token_id=EOT_ID,
    initializer_range=0.02,
)

# ~12.6M params: GQA (6 query heads, 2 KV heads, head_dim 64).
TARGET = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
              num_key_value_heads=2, intermediate_size=1024)

# ~1.4M params (about a ninth of the target), mostly the tied embedding.
DRAFT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, intermediate_size=384)

SHAPES = {"target": TARGET, "draft": DRAFT}


def make_config(shape: str) -> LlamaConfig:
    return LlamaConfig(**COMMON, **SHAPES[shape])
