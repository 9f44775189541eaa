"""The engine's request API: validation, abort, stops, seeded sampling, logprobs, streaming text."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.types import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir("llama"), dtype="float32", max_model_len=128,
                                  cache=CacheConfig(block_size=4, num_blocks=128),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=32)))


def _ids(n, seed=0):
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("prompt, sampling, match", [
    ("", None, "prompt is empty"),
    ([], None, "prompt is empty"),
    ([5, 384], None, r"token ids must be in \[0, 384\)"),
    ([-1], None, "token ids"),
    (list(range(3, 131)), None, "prompt has 128 tokens but the model's context is 128"),
])
def test_bad_prompts_raise_value_error(engine, prompt, sampling, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, sampling)
    assert not engine.has_unfinished()
    engine.pool.check_idle()


def test_bad_sampling_and_duplicate_ids(engine):
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([5, 6], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([5, 6], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request([5, 6], SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="sampling must be"):
        engine.add_request([5, 6], {"max_tokens": 3})
    engine.add_request([5, 6], request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], request_id="dup")
    engine.abort("dup")
    engine.step()
    engine.pool.check_idle()


def test_abort_mid_prefill_and_mid_decode_frees_every_block(engine):
    a = engine.add_request(_ids(100, 1), SamplingParams(max_tokens=50))   # 100 tokens, budget 32: chunked
    b = engine.add_request(_ids(9, 2), SamplingParams(max_tokens=50))
    deltas = engine.step()
    assert engine.pool.num_used > 0
    assert engine.requests.seqs[a].num_computed_tokens < 100                      # still in prefill
    assert engine.abort(a)
    for _ in range(3):
        deltas += engine.step()
    seq_b = engine.requests.seqs[b]
    assert seq_b.num_output_tokens > 0                                    # decoding
    assert engine.abort(b)
    deltas += engine.step()
    finished = [(d.request_id, d.finish_reason) for d in deltas if d.finished]
    assert finished == [(a, FinishReason.ABORT), (b, FinishReason.ABORT)]   # one final delta each
    assert not engine.has_unfinished()
    assert not engine.abort(b)                                            # unknown by now
    engine.pool.check_idle()


def test_stop_token_ids_and_max_tokens(engine):
    prompt = _ids(12, 3)
    full = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert full.finish_reason is FinishReason.LENGTH and len(full.token_ids) == 12
    stop_at = full.token_ids[5]
    first = full.token_ids.index(stop_at)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == full.token_ids[: first + 1]
    engine.pool.check_idle()


def test_stop_strings_truncate_and_are_never_streamed(engine):
    prompt = _ids(12, 3)
    full = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    pieces = []
    for delta in engine.stream(prompt, SamplingParams(max_tokens=12, stop=(stop,))):
        pieces.append(delta.text)
        last = delta
    text = "".join(pieces)
    assert last.finish_reason is FinishReason.STOP
    assert text == full.text[: full.text.find(stop)]
    assert stop not in text
    engine.pool.check_idle()


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    prompt = _ids(10, 4)
    alone = engine.generate([prompt], sp)[0].token_ids
    again = engine.generate([prompt], sp)[0].token_ids
    crowd = [_ids(n, 10 + n) for n in (3, 20, 7)]
    batched = engine.generate(crowd[:1] + [prompt] + crowd[1:],
                              [SamplingParams(max_tokens=16, temperature=0.8)] + [sp]
                              + [SamplingParams(max_tokens=16, temperature=1.0, seed=5)] * 2)[1].token_ids
    other_seed = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9,
                                                          top_k=50, seed=99))[0].token_ids
    assert alone == again == batched
    assert alone != other_seed
    engine.pool.check_idle()


def test_logprobs_are_the_models_log_softmax(engine, tiny_model_dir):
    import transformers
    prompt = _ids(8, 5)
    out = engine.generate([prompt], SamplingParams(max_tokens=4, logprobs=3))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + list(out.token_ids)])).logits[0]
    ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    assert len(out.logprobs) == 4
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref[i], 3).indices.tolist()


def test_streamed_text_never_splits_a_utf8_character(engine):
    from cluster.engine.detokenizer import IncrementalDetokenizer
    text = "x = 'Grüße, naïve café — ✓ 日本語 🙂'\n"
    ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
    pieces = [engine.tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the tokenizer should split some character across tokens"
    detok = IncrementalDetokenizer(engine.tokenizer, [0])
    deltas = [detok.add([i], final=(k == len(ids) - 1)) for k, i in enumerate(ids)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_string_split_across_tokens_is_held_back(engine):
    from cluster.engine.detokenizer import IncrementalDetokenizer
    text = "alpha beta gamma delta"
    ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(engine.tokenizer, [0], stop=("gamma",))
    out = ""
    for i in ids:
        out += detok.add([i])
        assert "gam" not in out
        if detok.stopped:
            break
    assert detok.stopped and out == "alpha beta "


def test_cli_generate_json_matches_transformers(tiny_model_dir):
    import transformers
    model_dir = tiny_model_dir("llama")
    prompt = "def add(a, b):"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.launch.cli", "generate", "--model", str(model_dir), "--max-tokens", "10",
         "--json", prompt], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(proc.stdout)          # stdout holds exactly one JSON object
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 0              # the tokenizer's post-processor adds BOS
    ref = hf.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:].tolist()
    assert result["token_ids"] == ref
    assert result["text"] == tok.decode(ref, skip_special_tokens=True)
    assert result["finish_reason"] in ("stop", "length")


def test_cli_reports_missing_model_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "generate", "--model", str(tmp_path / "nope"), "hi"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and proc.stdout == ""


def test_bfloat16_engine_tracks_transformers_bfloat16(tiny_model_dir):
    """bf16 (with oneDNN-packed linears) is not bit-exact, but its distribution must match."""
    import transformers
    model_dir = tiny_model_dir("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", cache=CacheConfig(num_blocks=32)))
    plan = engine.kernel_plan
    assert type(engine.model.lm_head).__name__ == {
        "packed": "PackedLinear", "plain": "SmallBatchLinear" if plan.linear_c_rows else "Linear",
        "fp32_upcast": "Fp32UpcastLinear"}[plan.linear.value]
    prompt = _ids(20, 6)
    out = engine.generate([prompt], SamplingParams(max_tokens=1, logprobs=5))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    for token, logprob in out.logprobs[0].top:
        assert logprob == pytest.approx(float(ref[token]), abs=0.1)
    engine.pool.check_idle()


def test_warm_up_leaves_nothing_behind():
    """The start-up warm-up (run on CUDA with Triton before the engine reports ready) leaves no
    request, no block and no prefix-cache entry."""
    from cluster.config import CacheConfig, EngineConfig
    from cluster.engine import offline
    from cluster.engine.engine import LLMEngine
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64)))
    before = engine.prompt_tokens_computed
    offline.warm_up(engine)
    # Prefill tunes on a prompt as long as the pool allows (half of 64 blocks of 16), not 35 tokens.
    assert offline.warm_up_prompt_len(engine) == 512
    assert engine.prompt_tokens_computed - before == 512
    assert not engine.has_unfinished()
    engine.pool.check_idle()
    assert engine.pool.num_free == engine.pool.num_blocks and not any(engine.pool.block_hash)
