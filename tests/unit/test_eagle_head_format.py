"""The shipped EAGLE head (cluster/model/weights/stdlib-coder-eagle) has the
agreed checkpoint format, the training-time unrolled forward equals the dense
serving contract, and the head's drafts agree with the target's greedy tokens
on held-out text. CPU only, well under a minute."""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bench.spec_training.corpus import iter_stdlib_files, split_files  # noqa: E402
from decode.spec.heads.eagle import (  # noqa: E402
    TENSOR_NAMES, FeatureHook, draft_greedy, load_eagle_head, load_target_parts)
from decode.spec.online.objective import forward_unrolled  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WEIGHTS = os.path.join(REPO, "cluster", "model", "weights")
HEAD = os.path.join(WEIGHTS, "stdlib-coder-eagle")
TARGET = os.path.join(WEIGHTS, "stdlib-coder")


@pytest.fixture(scope="module")
def target():
    m = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return m


@pytest.fixture(scope="module")
def snippet():
    """The first 400 tokens of the largest held-out stdlib file (never trained on)."""
    _, held = split_files(iter_stdlib_files())
    text = max(held, key=lambda f: len(f.text)).text
    tok = Tokenizer.from_file(os.path.join(TARGET, "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=True).ids[:400]
    assert len(ids) == 400
    return ids


def test_config_fields():
    cfg = json.load(open(os.path.join(HEAD, "config.json")))
    t = json.load(open(os.path.join(TARGET, "config.json")))
    assert cfg["architectures"] == ["SplitserveEagleHead"]
    assert cfg["model_type"] == "splitserve_eagle"
    assert cfg["target_model"] == "stdlib-coder"
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["hidden_size"] == t["hidden_size"] == 384
    assert cfg["num_attention_heads"] == t["num_attention_heads"] == 6
    assert cfg["num_key_value_heads"] == t["num_key_value_heads"] == 2
    assert cfg["head_dim"] == t["head_dim"] == 64
    assert cfg["vocab_size"] == t["vocab_size"] == 8192
    assert cfg["rms_norm_eps"] == t["rms_norm_eps"]
    assert cfg["rope_theta"] == t["rope_theta"]
    assert cfg["max_position_embeddings"] == t["max_position_embeddings"]
    assert isinstance(cfg["intermediate_size"], int) and cfg["intermediate_size"] > 0
    assert os.path.isfile(os.path.join(HEAD, "README.md"))


def test_tensor_names_shapes_dtype():
    cfg = json.load(open(os.path.join(HEAD, "config.json")))
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    L = "model.layers.0."
    want = {"fc.weight": [H, 2 * H],
            L + "self_attn.q_proj.weight": [q, H], L + "self_attn.k_proj.weight": [kv, H],
            L + "self_attn.v_proj.weight": [kv, H], L + "self_attn.o_proj.weight": [H, q],
            L + "mlp.gate_proj.weight": [I, H], L + "mlp.up_proj.weight": [I, H],
            L + "mlp.down_proj.weight": [H, I],
            L + "input_layernorm.weight": [H], L + "post_attention_layernorm.weight": [H]}
    assert set(want) == set(TENSOR_NAMES)
    with safe_open(os.path.join(HEAD, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(want)
        for name, shape in want.items():
            t = f.get_tensor(name)
            assert list(t.shape) == shape, name
            assert t.dtype == torch.bfloat16, name
            assert torch.isfinite(t.float()).all(), name


def test_unrolled_training_forward_equals_dense_contract(snippet):
    """forward_unrolled pass s at position j == the dense head run on the true
    prefix up to j - s followed by s drafted (token, own feature) pairs."""
    head = load_eagle_head(HEAD)
    tp = load_target_parts(TARGET)
    gen = torch.Generator().manual_seed(0)
    T, passes = 24, 3
    toks = torch.tensor([snippet[:T]])
    f = torch.randn(1, T, 384, generator=gen) * 40
    with torch.no_grad():
        outs = forward_unrolled(head, toks, f, tp, passes)
        for s in range(passes):
            for j in (s, s + 5, T - 1):
                n = j - s
                feats = [torch.zeros(384)] + list(f[0, :n])
                seq = snippet[: n + 1]
                for t in range(1, s + 1):
                    g = head(torch.tensor([seq]), torch.stack(feats)[None], tp)
                    feats.append(g[0, -1])
                    seq = seq + [snippet[n + t]]
                g = head(torch.tensor([seq]), torch.stack(feats)[None], tp)
                torch.testing.assert_close(g[0, -1], outs[s][0, j], rtol=1e-4, atol=2e-3)


def test_head_drafts_agree_with_target_greedy(target, snippet):
    """k=1: at every position, the head's draft from true features vs the
    target's greedy next token (one dense pass gives all positions). k=2: the
    autoregressive chain (draft_greedy) at a few positions."""
    head = load_eagle_head(HEAD)
    tp = load_target_parts(TARGET)
    hook = FeatureHook(target)
    ids = torch.tensor([snippet])
    with torch.no_grad():
        greedy = target(input_ids=ids).logits[0].argmax(-1)  # greedy[n] follows x_0..x_n
        f = hook.f[0]
        hook.remove()
        feats = torch.cat([torch.zeros(1, 384), f[:-1]])[None]
        d1 = tp.logits(head(ids, feats, tp))[0].argmax(-1)
    acc1 = (d1[16:] == greedy[16:]).float().mean().item()
    print(f"k=1 agreement with target greedy over {len(snippet) - 16} positions: {acc1:.3f}")
    assert 0.3 < acc1 <= 1.0
    # k=2 chain at 40 positions: the first draft must equal the one-pass result.
    both = 0
    positions = range(40, 360, 8)
    for n in positions:
        d = draft_greedy(head, tp, snippet[: n + 1], f[:n], 2)
        assert d[0] == int(d1[n])
        with torch.no_grad():
            nxt = target(input_ids=torch.tensor([snippet[: n + 1] + [d[0]]])).logits[0, -1].argmax()
        both += int(d[0] == int(greedy[n]) and d[1] == int(nxt))
    print(f"k=2 both drafts accepted at {both}/{len(positions)} positions")
    assert both > 0
