import pytest

from proto.splitserve.v1 import inference_pb2 as pb
from router.validation import Limits, ValidationError, validate

LIMITS = Limits(model_id="m", vocab_size=100, max_model_len=32, max_tokens_limit=64, default_max_tokens=16)


def _tok(text):
    return [ord(c) % 100 for c in text]


def _req(**kw):
    sampling = kw.pop("sampling", {})
    return pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **kw)


def test_valid_text_and_ids():
    r = validate(_req(text="hello"), LIMITS, _tok)
    assert r.prompt_token_ids == tuple(_tok("hello")) and r.sampling.max_tokens == 16 and r.request_id
    r = validate(_req(request_id="abc", token_ids=pb.TokenIds(ids=[1, 2]),
                      sampling={"top_p": 0.5, "seed": 4, "max_tokens": 64}), LIMITS, _tok)
    assert r.request_id == "abc" and r.sampling.top_p == 0.5 and r.sampling.seed == 4
    assert r.sampling.penalize_prompt is True      # unset: the penalty counts the prompt (transformers' rule)
    r = validate(_req(text="hi", sampling={"repetition_penalty": 1.1, "penalize_prompt": False}), LIMITS, _tok)
    assert r.sampling.penalize_prompt is False
    r = validate(_req(text="hi", sampling={"kv_compaction": pb.KVCompaction(ratio=4, recent=8)}), LIMITS, _tok)
    assert (r.sampling.kv_compaction.ratio, r.sampling.kv_compaction.recent, r.sampling.kv_compaction.observe) == (4, 8, 32)


@pytest.mark.parametrize("kwargs, field, text", [
    ({}, "prompt", "set either text or token_ids"),
    ({"text": ""}, "prompt.text", "is empty"),
    ({"token_ids": pb.TokenIds(ids=[])}, "prompt.token_ids", "is empty"),
    ({"token_ids": pb.TokenIds(ids=[1, 100])}, "prompt.token_ids", "[0, 100)"),
    ({"text": "x" * 40}, "prompt", "has 40 tokens but the model's context is 32"),
    ({"text": "x", "model": "other"}, "model", "serves 'm'"),
    ({"text": "x", "request_id": "a" * 200}, "request_id", "at most 128"),
    ({"text": "x", "sampling": {"max_tokens": 65}}, "sampling.max_tokens", "limit of 64"),
    ({"text": "x", "sampling": {"max_tokens": 0}}, "sampling.max_tokens", "positive"),
    ({"text": "x", "sampling": {"temperature": -1}}, "sampling.temperature", ">= 0"),
    ({"text": "x", "sampling": {"top_p": 0.0}}, "sampling.top_p", "(0, 1]"),
    ({"text": "x", "sampling": {"top_k": -5}}, "sampling.top_k", ">= 0"),
    ({"text": "x", "sampling": {"min_p": 2}}, "sampling.min_p", "[0, 1]"),
    ({"text": "x", "sampling": {"repetition_penalty": 0}}, "sampling.repetition_penalty", "> 0"),
    ({"text": "x", "sampling": {"stop": [""]}}, "sampling.stop", "non-empty"),
    ({"text": "x", "sampling": {"logprobs": 99}}, "sampling.logprobs", "in [0, 20] (--max-logprobs)"),
    ({"text": "x", "sampling": {"stop": ["s"] * 33}}, "sampling.stop", "--max-stop-strings"),
    ({"text": "x", "sampling": {"stop": ["s" * 257]}}, "sampling.stop", "--max-stop-string-chars"),
    ({"text": "x", "sampling": {"stop_token_ids": [1] * 65}}, "sampling.stop_token_ids", "at most 64"),
    ({"text": "x", "sampling": {"stop_token_ids": [10**6]}}, "sampling.stop_token_ids", "ids must be in"),
    ({"text": "x", "model": "m" * 10_000}, "model", "(10002 characters)"),
    ({"text": "x", "sampling": {"kv_compaction": pb.KVCompaction(ratio=0.5)}}, "sampling.kv_compaction",
     "kv_compaction.ratio must be >= 1"),
    ({"text": "x", "sampling": {"kv_compaction": pb.KVCompaction(ratio=4, method="fit2")}},
     "sampling.kv_compaction", "kv_compaction.method must be one of"),
])
def test_every_bad_field_is_named(kwargs, field, text):
    with pytest.raises(ValidationError) as info:
        validate(_req(**kwargs), LIMITS, _tok)
    assert info.value.field == field
    assert text in str(info.value)


def test_request_ids_are_scoped_per_tenant_and_long_texts_refused_untokenized():
    from dataclasses import replace
    from router.validation import client_id, scoped_id
    a = validate(_req(text="x", request_id="same"), LIMITS, _tok, tenant="a")
    assert client_id("a", a.request_id) == "same"
    anonymous = validate(_req(text="x"), LIMITS, _tok, tenant="a")      # the server picks the id
    assert len(client_id("a", anonymous.request_id)) == 32
    b = validate(_req(text="x", request_id="same"), LIMITS, _tok, tenant="a/b")
    assert a.request_id == scoped_id("a", "same") != b.request_id == scoped_id("a/b", "same")
    assert validate(_req(text="x", request_id="same"), LIMITS, _tok).request_id == "same"   # no keys: as given
    calls = []
    bounded = replace(LIMITS, max_token_bytes=4)            # 32 tokens x 4 bytes: 128 characters at most
    with pytest.raises(ValidationError, match="more than the model's context"):
        validate(_req(text="y" * 129), bounded, lambda t: calls.append(t) or _tok(t))
    assert calls == []                                       # refused before the tokenizer saw it
