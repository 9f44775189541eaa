"""Qwen3, Gemma 3 (text) and Phi-3 through the engine in float32: greedy tokens equal transformers'
on tiny random checkpoints (tests/tiny_models.py), on torch ops and on the fused C kernels, and the
chosen tokens' log-probabilities follow transformers' (Gemma's soft-capped logits: greedy alone
cannot see the cap). Prompts run past Gemma's sliding window (8) and Phi-3's (12); a checkpoint
needing a feature we lack is refused with an error that names it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.model.kernel_plan import ActPath, AttentionPath, BatchBuckets, KernelPlan, LinearPath, NormPath, RopePath
from cluster.model.model_config import load_model_config, parse_model_config
from cluster.types import SamplingParams
from kernels import cpu_ops

FAMILIES = ["qwen3", "gemma3", "phi3"]
MAX_TOKENS = 16


def family_prompts(shared_prefix: int = 0, lengths=(3, 13, 30, 47)) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 384, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def check_family(engine: LLMEngine, kind: str, prompts, hf_reference, max_tokens: int = MAX_TOKENS) -> list:
    """Greedy tokens equal transformers', log-probabilities within 1e-4; the pool ends idle."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, logprobs=0))
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_reference(kind, prompt, max_tokens)
        assert list(out.token_ids) == tokens, f"{kind}: prompt of {len(prompt)} tokens"
        ours = [lp.logprob for lp in out.logprobs]
        assert ours == pytest.approx(logprobs, abs=1e-4), f"{kind}: log-probabilities, prompt of {len(prompt)}"
    engine.pool.check_idle()
    return outs


def _fused_plan() -> KernelPlan:
    n = len(BatchBuckets().sizes)
    return KernelPlan(LinearPath.PLAIN, (NormPath.FUSED_C,) * n, (RopePath.FUSED_C,) * n, (ActPath.FUSED_C,) * n,
                      AttentionPath.FUSED_C)


@pytest.mark.parametrize("kind", FAMILIES)
def test_torch_ops_whole_prompts(kind, tiny_model_dir, hf_reference):
    """Each prompt prefilled in one pass (masked SDPA past the window), then batched decodes."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(kind), dtype="float32", kernels="torch"))
    check_family(engine, kind, family_prompts(), hf_reference)


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler: fused CPU ops not built")
@pytest.mark.parametrize("kind", FAMILIES)
def test_fused_kernels_chunked_with_prefix_hits(kind, tiny_model_dir, hf_reference):
    """The C kernels (norms, RoPE in place, one decode block per layer), 4-token blocks, prefill
    chunks of at most 9 tokens beside decodes, and prompts that start from cached blocks."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(kind), dtype="float32", kernel_plan=_fused_plan(),
                                    cache=CacheConfig(block_size=4, num_blocks=256),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=9)))
    prompts = family_prompts(shared_prefix=12)
    check_family(engine, kind, prompts[:1], hf_reference)
    outs = check_family(engine, kind, prompts[1:], hf_reference)
    assert all(o.num_cached_tokens >= 12 for o in outs), [o.num_cached_tokens for o in outs]


def test_family_features_are_read(tiny_model_dir):
    qwen3 = load_model_config(tiny_model_dir("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128 and not qwen3.sandwich_norm
    gemma = load_model_config(tiny_model_dir("gemma3"))
    assert gemma.layer_windows == (8, None, 8) and gemma.local_layers == (True, False, True)
    assert (gemma.rope.theta, gemma.rope.kind, gemma.rope.factor) == (50000.0, "linear", 2.0)
    assert (gemma.local_rope.theta, gemma.local_rope.kind) == (1000.0, "default")
    assert gemma.attention_scale == 24 ** -0.5 and gemma.final_logit_softcap == 3.0 and gemma.embed_scale == 8.0
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.norm_offset == 1.0 and gemma.tie_word_embeddings
    phi3 = load_model_config(tiny_model_dir("phi3"))
    assert phi3.layer_windows == (12, 12) and not phi3.qk_norm and phi3.attention_scale == 16 ** -0.5


def test_gemma3_config_in_transformers_4_spelling(tiny_model_dir):
    """rope_theta + rope_scaling (global), rope_local_base_freq, sliding_window_pattern: the same model."""
    raw = _raw(tiny_model_dir, "gemma3", rope_theta=50000.0, rope_local_base_freq=1000.0, sliding_window_pattern=2,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    for key in ("rope_parameters", "layer_types"):
        del raw[key]
    assert parse_model_config(raw, model_id="g") == parse_model_config(_raw(tiny_model_dir, "gemma3"), model_id="g")


def _raw(tiny_model_dir, kind: str, **changes) -> dict:
    raw = json.loads((tiny_model_dir(kind) / "config.json").read_text())
    raw.update(changes)
    return raw


@pytest.mark.parametrize("kind, changes, named", [
    ("gemma3", {"attn_logit_softcapping": 50.0}, r"attention logit soft-capping \(attn_logit_softcapping\)"),
    ("gemma3", {"use_bidirectional_attention": True}, r"bidirectional attention \(use_bidirectional_attention\)"),
    ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}, r"Gemma 3 multimodal"),
    ("gemma3", {"hidden_activation": "gelu_new"}, r"hidden activation 'gelu_new'"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                  "long_factor": [2.0] * 8, "partial_rotary_factor": 1.0}}, r"RoPE scaling 'longrope'"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     r"partial rotary embeddings \(partial_rotary_factor=0.75\)"),
    ("phi3", {"rope_parameters": None, "rope_scaling": {"type": "su", "short_factor": [1.0] * 8}},
     r"RoPE scaling 'su'"),
    ("qwen3", {"hidden_act": "relu"}, r"hidden activation 'relu'"),
])
def test_unsupported_features_are_refused_by_name(kind, changes, named, tiny_model_dir):
    with pytest.raises(ValueError, match=named):
        parse_model_config(_raw(tiny_model_dir, kind, **changes), model_id=kind)


def test_engine_refuses_a_checkpoint_with_attention_softcapping(tiny_model_dir, tmp_path):
    """The refusal reaches whoever loads the directory, before any weight is read."""
    model = tmp_path / "gemma"
    shutil.copytree(tiny_model_dir("gemma3"), model)
    (model / "config.json").write_text(json.dumps(_raw(tiny_model_dir, "gemma3", attn_logit_softcapping=50.0)))
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        LLMEngine(EngineConfig(model=model, dtype="float32", kernels="torch"))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_loading_a_model_imports_no_compiler(tiny_model_dir, kind):
    """Every worker loads its model at start: building it on the meta device must not run torch's
    Python references (they import torch._dynamo, 1.5-2 s of each worker's start)."""
    code = ("import sys; from cluster.model.loader import load_model; "
            f"load_model({str(tiny_model_dir(kind))!r}); "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
