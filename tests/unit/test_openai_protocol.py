"""OpenAI bodies → validated requests (router/openai/protocol.py): the gRPC validation with
OpenAI's field names, the prompt forms, n samples with seed + j, the refusals."""
from __future__ import annotations

import pytest

from router.openai.protocol import ApiError, Endpoint, parse_chat, parse_completion
from router.validation import Limits

LIMITS = Limits(model_id="m", vocab_size=100, max_model_len=64, max_tokens_limit=32, default_max_tokens=24)


def _tokenize(text: str) -> list[int]:
    return [1 + ord(c) % 90 for c in text]


def _detokenize(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def _parse(**body):
    return parse_completion({"model": "m", **body}, LIMITS, _tokenize, _detokenize)


def _error(**body) -> ApiError:
    with pytest.raises(ApiError) as e:
        _parse(**body)
    return e.value


def test_prompt_forms_and_defaults():
    job = _parse(prompt="ab")
    (group,) = job.groups
    (req,) = group.requests
    assert req.prompt_token_ids == tuple(_tokenize("ab"))
    assert req.sampling.max_tokens == 16 and req.sampling.temperature == 1.0     # OpenAI's defaults
    assert job.endpoint is Endpoint.COMPLETIONS and not job.stream
    assert len(_parse(prompt=["a", "b", "c"]).groups) == 3
    assert _parse(prompt=[5, 6]).groups[0].requests[0].prompt_token_ids == (5, 6)
    assert [g.requests[0].prompt_token_ids for g in _parse(prompt=[[5], [6, 7]]).groups] == [(5,), (6, 7)]
    assert parse_completion({"prompt": "x"}, LIMITS, _tokenize, _detokenize).model == "m"   # model may be omitted


def test_n_samples_are_one_group_with_seed_plus_j():
    job = _parse(prompt=["a", "b"], n=3, seed=10, temperature=0.7)
    assert job.num_requests == 6
    assert [g.first_index for g in job.groups] == [0, 3]
    assert [r.sampling.seed for r in job.groups[1].requests] == [10, 11, 12]
    assert len({r.request_id for g in job.groups for r in g.requests}) == 6
    assert _parse(prompt="a", n=2).groups[0].requests[0].sampling.seed is None


def test_echo_with_logprobs_asks_the_lead_for_prompt_logprobs():
    job = _parse(prompt="abc", n=2, echo=True, logprobs=3)
    lead, fork = job.groups[0].requests
    assert lead.sampling.prompt_logprobs == 3 and fork.sampling.prompt_logprobs is None
    assert lead.sampling.logprobs == fork.sampling.logprobs == 3
    assert job.groups[0].echo_text == "abc"
    assert _parse(prompt=[72, 73], echo=True).groups[0].echo_text == "HI"


def test_extensions_reach_the_sampling_params():
    sp = _parse(prompt="a", top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, stop_token_ids=[3],
                stop="zz", speculative="ngram", num_speculative_tokens="auto").groups[0].requests[0].sampling
    assert (sp.top_k, sp.min_p, sp.ignore_eos, sp.stop_token_ids, sp.stop, sp.speculative,
            sp.num_speculative_tokens) == (5, pytest.approx(0.1), True, (3,), ("zz",), "ngram", "auto")
    assert sp.repetition_penalty == pytest.approx(1.2) and sp.penalize_prompt is True
    assert _parse(prompt="a", repetition_penalty=1.2, penalize_prompt=False).groups[0].requests[0].sampling \
        .penalize_prompt is False
    sp = _parse(prompt="a", kv_window=64, kv_sink_tokens=0).groups[0].requests[0].sampling   # docs/kv_compress.md
    assert (sp.kv_window, sp.kv_sink_tokens) == (64, 0)
    sp = _parse(prompt="a").groups[0].requests[0].sampling
    assert (sp.kv_window, sp.kv_sink_tokens) == (None, None)     # unset: the server's default
    sp = _parse(prompt="a", kv_compaction={"ratio": 4, "method": "select", "recent": 8}).groups[0].requests[0].sampling
    assert (sp.kv_compaction.ratio, sp.kv_compaction.method, sp.kv_compaction.recent, sp.kv_compaction.observe) \
        == (4.0, "select", 8, 32)                                  # unset numbers: the defaults
    assert _parse(prompt="a", kv_compaction={"method": "off"}).groups[0].requests[0].sampling.kv_compaction.method \
        == "off"                                                   # a server's default off for this request
    assert sp.kv_window is None and _parse(prompt="a").groups[0].requests[0].sampling.kv_compaction is None


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "a", "max_tokens": 33}, 400, "max_tokens"),          # the gRPC limit check, OpenAI's name
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "a", "n": 0}, 400, "n"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "a", "seed": -1}, 400, "seed"),
    ({"prompt": "a", "stop": [1]}, 400, "stop"),
    ({"prompt": "a", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"prompt": "a", "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ({"prompt": "a", "best_of": 3}, 400, "best_of"),
    ({"prompt": "a", "speculative": "medusa"}, 400, "speculative"),
    ({"prompt": "a", "kv_window": -1}, 400, "kv_window"),
    ({"prompt": "a", "kv_compaction": {"ratio": 0.5}}, 400, "kv_compaction"),
    ({"prompt": "a", "kv_compaction": {"ratio": 4, "method": "pyramid"}}, 400, "kv_compaction"),
    ({"prompt": "a", "kv_compaction": {"ratio": 4, "budget": 3}}, 400, "kv_compaction"),
    ({"prompt": "a", "kv_compaction": {"ratio": 4, "recent": 0}}, 400, "kv_compaction"),
    ({"prompt": "a", "kv_compaction": 4}, 400, "kv_compaction"),
    ({"prompt": [500]}, 400, "prompt"),                                # outside the vocabulary
    ({"prompt": "x" * 64}, 400, "prompt"),                             # longer than the context
    ({"prompt": []}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "a", "model": "other"}, 404, "model"),
])
def test_bad_fields_are_named(body, status, param):
    e = _error(**body)
    assert (e.status, e.param) == (status, param), e.message
    assert e.body()["error"]["param"] == param and e.message
    if param == "kv_compaction" and isinstance(body[param], dict):   # the object's own field named
        assert any(f in e.message for f in ("ratio", "method", "budget", "recent")), e.message


def test_chat_needs_a_template_and_valid_messages():
    from router.chat_template import ChatTemplate
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}]}, LIMITS, None, _tokenize)
    assert e.value.status == 400 and e.value.code == "no_chat_template"
    template = ChatTemplate(source="{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}",
                            bos_token="", eos_token="", origin="test")
    job = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
                     LIMITS, template, _tokenize)
    assert job.groups[0].requests[0].prompt_token_ids == tuple(_tokenize("user:hi;"))
    assert job.logprobs == 2 and job.groups[0].requests[0].sampling.logprobs == 2
    assert job.groups[0].requests[0].sampling.max_tokens == 24     # chat: the server's default
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": []}, LIMITS, template, _tokenize)
    assert e.value.param == "messages"
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, LIMITS, template, _tokenize)
    assert e.value.param == "top_logprobs"


def test_chat_continues_the_final_message_only_without_a_generation_prompt():
    from router.chat_template import ChatTemplate
    template = ChatTemplate(source="{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}",
                            bos_token="", eos_token="", origin="test")
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}],
            "continue_final_message": True}
    with pytest.raises(ApiError) as e:               # add_generation_prompt is true unless set
        parse_chat(body, LIMITS, template, _tokenize)
    assert (e.value.status, e.value.param) == (400, "continue_final_message")
    job = parse_chat({**body, "add_generation_prompt": False}, LIMITS, template, _tokenize)
    assert job.groups[0].requests[0].prompt_token_ids == tuple(_tokenize("user:hi;assistant:Sure, "))


def test_unsupported_fields_at_neutral_values_are_accepted():
    job = _parse(prompt="a", presence_penalty=0, frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"},
                 tool_choice="auto", suffix="", best_of=1)
    assert job.num_requests == 1
    for body in ({"suffix": "x"}, {"logit_bias": {"1": 2}}):
        assert _error(prompt="a", **body).param == next(iter(body))
    # Structured output is supported (router/structured.py): it reaches the sampling parameters.
    job = _parse(prompt="a", response_format={"type": "json_object"})
    assert job.groups[0].requests[0].sampling.structured.kind.value == "json_object"


def test_the_default_max_tokens_respects_a_lower_server_limit():
    limits = Limits(model_id="m", vocab_size=100, max_model_len=64, max_tokens_limit=8, default_max_tokens=8)
    job = parse_completion({"prompt": "a"}, limits, _tokenize, _detokenize)
    assert job.groups[0].requests[0].sampling.max_tokens == 8
