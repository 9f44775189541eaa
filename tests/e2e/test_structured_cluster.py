"""Structured output and tool calls on a real cluster with the real `openai` client: the default
model (SmolLM2-135M-Instruct) on 1 prefill + 2 decode workers (KV over NIXL, n-gram speculation
on the decode side, the deterministic mode so that greedy output equals one engine's), one
cluster for the module. Replies parse and validate against their schemas (jsonschema), equal the
single engine token for token, tool calls validate (whole and streamed), a decode worker killed
mid-JSON costs nothing (the new attempt's matcher is rebuilt from the streamed tokens), bad
constraints get exact errors on both APIs, and every pool ends empty."""
from __future__ import annotations

import json
import os
import signal

import grpc
import jsonschema
import openai
import pytest

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig, SpeculativeConfig, default_model_file
from cluster.launch.app import ClusterConfig
from cluster.types import SamplingParams, StructuredKind, StructuredOutput
from cluster_harness import ClusterThread
from proto.splitserve.v1 import inference_pb2 as pb
from router.client import Client
from router.router import RouterConfig

pytestmark = pytest.mark.ray

CITIES = {"type": "object", "properties": {
    "cities": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20},
                                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "country", "population_millions"], "additionalProperties": False}}},
    "required": ["cities"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"], "additionalProperties": False}}}
QUESTION = "Name three large cities in Europe, with their country and population in millions, as JSON."
CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
MAX_TOKENS = 160
MODEL = "SmolLM2-135M-Instruct.Q4_1"     # the served model's id: its GGUF file's name


def _engine_config(speculative: bool) -> EngineConfig:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4) if speculative else SpeculativeConfig()
    return EngineConfig(model=default_model_file(), deterministic=True, num_threads=1,
                        cache=CacheConfig(num_blocks=256), speculative=spec)


@pytest.fixture(scope="module")
def served():
    c = ClusterThread(ClusterConfig(engine=_engine_config(True), data_plane=DataPlaneConfig(transport="nixl"),
                                    port=0, http_port=0, num_prefill=1, num_decode=2,
                                    router=RouterConfig(local_prefill_max_tokens=4), max_tokens_limit=512))
    c.http = f"127.0.0.1:{c.cluster.http_port}"
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(single_engine):
    engine = single_engine(_engine_config(False))

    def run(prompt: str, spec: StructuredOutput, max_tokens: int = MAX_TOKENS) -> list[int]:
        return list(engine.generate([prompt], SamplingParams(max_tokens=max_tokens, structured=spec))[0].token_ids)
    return run


@pytest.fixture
def cluster(served):
    yield served
    served.wait_idle(timeout=30)


def _client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{c.http}/v1", api_key="none", max_retries=0, timeout=120)


def test_json_schema_reply_validates_and_equals_one_engine(cluster, reference):
    client = _client(cluster)
    fmt = {"type": "json_schema", "json_schema": {"name": "cities", "schema": CITIES, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          response_format=fmt, max_tokens=MAX_TOKENS, temperature=0)
    reply = json.loads(chat.choices[0].message.content)
    jsonschema.validate(reply, CITIES)
    assert chat.choices[0].finish_reason == "stop"
    # The same prompt as text, on /v1/completions: the tokens of one engine without speculation.
    prompt = CHATML.format(q=QUESTION)
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"response_format": fmt, "return_token_ids": True})
    want = reference(prompt, StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(CITIES)))
    assert done.choices[0].token_ids == want
    assert json.loads(done.choices[0].text) == reply


def test_json_object_choice_regex_and_grammar_through_vllm_fields(cluster):
    client = _client(cluster)
    ask = [{"role": "user", "content": "Is Paris the capital of France? Then give a date."}]
    cases = [({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
             ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
             ({"guided_regex": r"\d{4}-\d{2}-\d{2}"}, lambda t: len(t) == 10 and t[4] == t[7] == "-"),
             ({"structured_outputs": {"grammar": 'root ::= "answer: " ("yes" | "no")'}},
              lambda t: t in ("answer: yes", "answer: no"))]
    for extra, ok in cases:
        out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, temperature=0, extra_body=extra)
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop" and ok(text), (extra, text)


def test_required_tool_call_validates_whole_and_streamed(cluster):
    client = _client(cluster)
    ask = [{"role": "user", "content": "What's the weather like in Lisbon right now?"}]
    out = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                         max_tokens=MAX_TOKENS, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # Streamed: the call arrives as a tool_calls delta; the same call as the whole reply.
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    assert reasons == ["tool_calls"]
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}


def test_named_tool_choice_and_a_multi_turn_agent_loop(cluster):
    client = _client(cluster)
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                         tool_choice={"type": "function", "function": {"name": "get_time"}},
                                         max_tokens=MAX_TOKENS, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    # The call and its result go back in; the model answers in text (tool_choice auto).
    messages += [out.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"time": "14:05"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=40,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def test_decode_worker_killed_mid_json_continues_the_same_valid_reply(cluster, reference):
    router = cluster.cluster.router
    before = router.recoveries
    prompt = CHATML.format(q=QUESTION)
    fmt = {"type": "json_schema", "json_schema": {"name": "cities", "schema": CITIES}}
    tokens, text, killed = [], "", None
    stream = _client(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, extra_body={"response_format": fmt,
                                                                          "return_token_ids": True})
    for chunk in stream:
        tokens += chunk.choices[0].token_ids or []
        text += chunk.choices[0].text
        if killed is None and len(tokens) >= 4:      # mid-JSON: past the opening, far from the end
            busy = [n for n, v in router.views.items() if v.role == "decode" and v.in_flight]
            killed = busy[0]
            pid = next(s.pid for s in cluster.stats() if s.name == killed)
            os.kill(pid, signal.SIGKILL)
    assert killed is not None and router.recoveries > before
    jsonschema.validate(json.loads(text), CITIES)
    assert tokens == reference(prompt, StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(CITIES)))


def test_bad_constraints_get_exact_errors_on_both_apis(cluster):
    client = _client(cluster)
    ask = [{"role": "user", "content": "hi"}]
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                 "type": "object", "properties": 5}}}}, "response_format"),
             ({"response_format": {"type": "xml"}}, "response_format.type"),
             ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
             ({"guided_choice": []}, "guided_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice.function.name"),
             ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
              "tool_choice"),
             ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, extra_body=extra)
        assert err.value.status_code == 400 and err.value.body["param"] == param, (extra, err.value.body)
    with pytest.raises(grpc.RpcError) as err:
        Client(cluster.target).generate("hi", max_tokens=8, timeout=30,
                                        structured=pb.StructuredOutput(regex="(unclosed"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured.regex" in err.value.details()
    # gRPC's own constraint: a choice, validated.
    out = Client(cluster.target).generate("Pick a color:", max_tokens=8, timeout=30,
                                          structured=pb.StructuredOutput(choice=pb.ChoiceList(choices=["red", "blue"])))
    assert out.text in ("red", "blue")
