"""Tiny random-weight Hugging Face checkpoints, made locally for tests (nothing is downloaded)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_moe_models import MOE_KINDS, moe_family_config

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)  # squares\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "Grüße, naïve café — ünïcödé text ✓ 日本語\n",
]

VOCAB = 384


def make_tokenizer(out_dir: Path, bos: bool) -> None:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "add_bos_token": bos}))


KINDS = ("llama", "qwen2", "mistral", "qwen3", "gemma3", "phi3", *MOE_KINDS)


# DeepSeek's latent attention: 4 heads of 16 + 8 (RoPE) query/key dims and 16 value dims over a 40-wide
# latent (32 compressed + 8 RoPE): a quarter of the same model's per-head K/V (4 x (24 + 16)).
# Dense layers only (first_k_dense_replace = layers) unless the kind says moe.
_MLA = {"num_attention_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 2}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
MLA_KINDS = ("deepseek_v3", "deepseek_v3_noq", "deepseek_v2", "deepseek_v3_mtp", "deepseek_v3_moe", "deepseek_v2_moe")


def _deepseek_config(kind: str, common: dict):
    import transformers
    if kind in ("deepseek_v3", "deepseek_v3_mtp"):   # low-rank queries, yarn RoPE (mscale on cos/sin and on the softmax scale)
        return transformers.DeepseekV3Config(q_lora_rank=24, n_group=2, topk_group=1, rope_parameters=_YARN,
                                             **_MLA, **common), transformers.DeepseekV3ForCausalLM
    if kind == "deepseek_v3_noq":   # one q_proj, plain RoPE over halves (rope_interleave off)
        return transformers.DeepseekV3Config(q_lora_rank=None, n_group=2, topk_group=1, rope_interleave=False,
                                             **_MLA, **common), transformers.DeepseekV3ForCausalLM
    if kind == "deepseek_v2":   # complex-number RoPE (interleaved pairs), low-rank queries
        return transformers.DeepseekV2Config(q_lora_rank=24, n_shared_experts=1, **_MLA,
                                             **common), transformers.DeepseekV2ForCausalLM
    # Layer 1 of 2 sparse: 8 experts in 4 groups, 2 kept, top 2, one shared expert.
    moe = {**_MLA, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "n_shared_experts": 1}
    if kind == "deepseek_v3_moe":   # sigmoid scores, correction bias (made non-zero below), grouped top-k
        return transformers.DeepseekV3Config(q_lora_rank=24, routed_scaling_factor=2.5, rope_parameters=_YARN,
                                             **moe, **common), transformers.DeepseekV3ForCausalLM
    if kind == "deepseek_v2_moe":   # softmax scores, group-limited greedy
        return transformers.DeepseekV2Config(q_lora_rank=None, topk_method="group_limited_greedy",
                                             routed_scaling_factor=1.5, **moe, **common), transformers.DeepseekV2ForCausalLM
    raise ValueError(kind)


def _family_config(kind: str, common: dict):
    """The later families: (config, model class)."""
    import transformers
    if kind in MLA_KINDS:
        return _deepseek_config(kind, common)
    if kind == "qwen3":   # per-head q/k norms; head_dim 32 with 4 heads: q is wider than hidden
        return transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        tie_word_embeddings=True, **common), transformers.Qwen3ForCausalLM
    if kind == "gemma3":
        # Sliding (window 8, base 1000) and global (base 50000, linear x2) layers; a softmax scale
        # of 24 ** -0.5 against head_dim 16; logits capped at 3.
        gemma = dict(common, num_hidden_layers=3, pad_token_id=2)
        return transformers.Gemma3TextConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24, final_logit_softcapping=3.0, rope_theta=50000.0,
            rope_local_base_freq=1000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
            tie_word_embeddings=True, **gemma), transformers.Gemma3ForCausalLM
    if kind in GEMMA4_KINDS:
        return _gemma4_config(kind, common)
    if kind == "phi3":   # fused qkv_proj and gate_up_proj in the checkpoint; sliding window 12 on every layer
        return transformers.Phi3Config(num_attention_heads=4, num_key_value_heads=2, sliding_window=12,
                                       pad_token_id=2, tie_word_embeddings=False,
                                       **common), transformers.Phi3ForCausalLM
    raise ValueError(kind)


# Gemma 4 text: 6 layers, sliding (window 8, base 1000) and full (proportional RoPE, half the dims
# rotated, base 50000); "gemma4": the last 3 layers share K/V (layers 3 and 5 read layer 1's,
# layer 4 reads layer 2's) with double-wide MLPs, and per-layer inputs of 8 per layer;
# "gemma4_unshared": the same shape, no sharing, no per-layer inputs. Full layers' head_dim as the
# sliding layers' (global_head_dim 16: one KV row width; other sizes are refused).
GEMMA4_KINDS = ("gemma4", "gemma4_unshared")


def _gemma4_config(kind: str, common: dict):
    import transformers
    shared = kind == "gemma4"
    cfg = transformers.Gemma4TextConfig(
        **dict(common, num_hidden_layers=6, pad_token_id=2), num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 3,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                            "rope_theta": 50000.0}},
        hidden_size_per_layer_input=8 if shared else 0, vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=3 if shared else 0, use_double_wide_mlp=shared,
        final_logit_softcapping=3.0, tie_word_embeddings=True)
    return cfg, transformers.Gemma4ForCausalLM


def make_model(out_dir: Path, kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """kind: llama (GQA 4/2, untied), qwen2 (q/k/v bias, tied, MQA), mistral (sliding window 8, GQA),
    qwen3 (q/k norms, head_dim 32, tied), gemma3 (see _family_config), phi3 (fused projections, window 12),
    gemma4 and gemma4_unshared (Gemma 4 text with and without cross-layer KV sharing: GEMMA4_KINDS)
    and the mixtures of experts of tiny_moe_models.py."""
    import transformers
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                  initializer_range=0.2)
    if kind in MOE_KINDS:
        cfg, cls = moe_family_config(kind, common)
    elif kind in ("qwen3", "gemma3", "phi3", *MLA_KINDS, *GEMMA4_KINDS):
        cfg, cls = _family_config(kind, common)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                       rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                       **common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                       **common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                         tie_word_embeddings=False, head_dim=16, **common)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    with torch.no_grad():   # make norms and biases non-trivial so every parameter matters (Gemma's
        # norms scale by 1 + w, their w starts at 0)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():   # V3's routing correction: a buffer, zero at init
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
        for name, b in model.named_buffers():   # Gemma 4's layer scalars: ones at init
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + torch.randn_like(b) * 0.2)
        if kind in GEMMA4_KINDS:   # as Gemma 3's below: the scaled embeddings would drown the layers out
            model.model.embed_tokens.weight.mul_(0.125)
        if kind == "gemma3":   # the embeddings, scaled by sqrt(64) = 8, would drown the layers out (the
            # tied head would repeat the last token whatever the layers compute): smaller embeddings, and
            # a final norm of about 8 for logits large enough that the soft-cap bends them
            model.model.embed_tokens.weight.mul_(0.125)
            model.model.norm.weight.add_(7.0)
    model.generation_config.eos_token_id = 1
    model.generation_config.bos_token_id = 0
    model.save_pretrained(out_dir)
    if kind == "deepseek_v3_mtp":
        add_mtp_layer(out_dir, cfg, seed)
    make_tokenizer(out_dir, bos=kind not in ("qwen2", "qwen3"))
    return out_dir


def add_mtp_layer(out_dir: Path, cfg, seed: int) -> None:
    """DeepSeek-V3's MTP layer after the last decoder layer, as the original checkpoints store it
    (transformers saves none): a decoder layer of its own, enorm, hnorm, eh_proj, shared_head.
    Built to propose the pending token again (eh_proj passes the token's embedding, the layer's
    outputs are scaled small, the head is the embedding matrix): drafts that verification accepts
    in the tiny model's repetitive stretches and refuses elsewhere."""
    import dataclasses

    import transformers
    from safetensors.torch import load_file, save_file
    path = Path(out_dir) / "model.safetensors"
    tensors = load_file(path)
    torch.manual_seed(seed + 1)
    one = transformers.DeepseekV3ForCausalLM(dataclasses.replace(cfg, num_hidden_layers=1))
    at = f"model.layers.{cfg.num_hidden_layers}."
    for name, t in one.state_dict().items():
        if name.startswith("model.layers.0."):
            small = name.endswith(("o_proj.weight", "down_proj.weight"))
            tensors[at + name.removeprefix("model.layers.0.")] = (t * 0.01 if small else t).contiguous()
    h = cfg.hidden_size
    tensors[at + "enorm.weight"] = torch.ones(h)
    tensors[at + "hnorm.weight"] = 1 + 0.1 * torch.randn(h)
    tensors[at + "eh_proj.weight"] = torch.cat((torch.eye(h), 0.01 * torch.randn(h, h)), dim=1)
    tensors[at + "shared_head.norm.weight"] = torch.ones(h)
    tensors[at + "shared_head.head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})


# ChatML, as Qwen writes it: `<|im_start|>role\ncontent<|im_end|>\n` per turn. Content given as a list of
# text parts is joined with "\n" (as router.chat_template does before rendering), so both renderers agree.
# Tools, when given, go in a leading system turn through `tojson`, to exercise that filter too.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- elif message.content is defined %}{{- message.content | map(attribute='text') | join('\\n') }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_chat_model(out_dir: Path, kind: str = "llama") -> Path:
    """make_model's checkpoint with a ChatML chat template in tokenizer_config.json (the tokenizer is
    byte-level BPE, so the template's markers encode as ordinary text)."""
    out_dir = make_model(out_dir, kind)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHATML_TEMPLATE
    config_path.write_text(json.dumps(config))
    return out_dir


def long_context_copy(model_dir: Path, out_dir: Path, max_positions: int = 4096) -> Path:
    """A copy of a tiny checkpoint with a longer context (the llama kind's RoPE does not depend on
    it: same weights, same tokens). For tests where a request must still run while the test acts on
    it: the tiny model decodes hundreds of tokens in the time a few calls take."""
    import shutil
    out_dir = Path(out_dir)
    shutil.copytree(model_dir, out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": max_positions}))
    return out_dir
