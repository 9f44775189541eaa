"""The OpenAI-compatible HTTP API with the real `openai` client, on a served cluster: 1 prefill +
1 decode worker (KV over TCP), and one colocated worker; one cluster per topology for the module.

Outputs are compared with the single engine (greedy), with the gRPC API for the same prompt, with
transformers (prompt logprobs, the chat template) and with themselves (seeds); n > 1 is checked to
compute the prompt once through the workers' prompt-token counters; every error status is exact;
a client that leaves mid-stream or mid-request leaves no block in use. vLLM's /tokenize answers
the ids the server runs (given back as a prompt they make the same text and usage), /detokenize
and gRPC's Tokenize/Detokenize agree with it, /version and ServerInfo say the installed version.
"""
from __future__ import annotations

import http.client
import json
import socket
import time

import grpc
import openai
import pytest
import torch

from cluster.launch.app import ClusterConfig
from cluster.config import DataPlaneConfig
from router.router import RouterConfig
from cluster.config import CacheConfig, EngineConfig
from cluster.types import SamplingParams
from cluster.version import splitserve_version
from cluster_harness import ClusterThread
from router.client import Client
from tiny_models import make_chat_model

pytestmark = pytest.mark.ray

KEY = "sk-test-0123456789"
PROMPTS = ["def add(a, b):\n", "class Point:\n    def", "for i in range(10):\n    print(i * i)"]


def _engine_config(model_dir):
    return EngineConfig(model=model_dir, dtype="float32", num_threads=1, kernels="torch",
                        cache=CacheConfig(block_size=4, num_blocks=48))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat"), "llama")


@pytest.fixture(scope="module", params=["1p1d", "colocated"])
def served(request, chat_model):
    c = ClusterThread(ClusterConfig(engine=_engine_config(chat_model), data_plane=DataPlaneConfig(transport="tcp"),
                                    port=0, http_port=0,
                                    colocated=request.param == "colocated",
                                    router=RouterConfig(local_prefill_max_tokens=2),
                                    api_keys=(KEY,), max_tokens_limit=256))
    c.http = f"127.0.0.1:{c.cluster.http_port}"
    c.topology = request.param
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(chat_model, single_engine):
    engine = single_engine(_engine_config(chat_model))

    def greedy(prompt, max_tokens: int = 16) -> list[int]:
        return list(engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].token_ids)
    greedy.engine = engine
    return greedy


def _client(served, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{served.http}/v1", api_key=key, max_retries=0)


def _model(served) -> str:
    return _client(served).models.list().data[0].id


def _prompt_tokens_computed(served) -> int:
    return sum(s.prompt_tokens_computed for s in served.stats())


def _post(served, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(served.http, timeout=60)
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {KEY}",
                                                   "Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data) if data else {}


def test_completions_equal_the_engine_and_the_grpc_api(served, reference):
    api = _client(served)
    model = _model(served)
    grpc = Client(served.target, api_key=KEY)
    r = api.completions.create(model=model, prompt=PROMPTS, max_tokens=16, temperature=0, extra_body={
        "return_token_ids": True, "ignore_eos": True})
    tokenize = reference.engine.tokenize
    for choice, prompt in zip(sorted(r.choices, key=lambda c: c.index), PROMPTS):
        ours = grpc.generate(prompt, max_tokens=16, ignore_eos=True)
        assert choice.token_ids == list(ours.token_ids) == reference(tokenize(prompt))
        assert choice.text == ours.text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(len(tokenize(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == 16 * len(PROMPTS)
    ids = tokenize(PROMPTS[0])          # a prompt as token ids, and the per-request speculation extension
    r2 = api.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0,
                                extra_body={"speculative": "ngram", "num_speculative_tokens": 3, "ignore_eos": True})
    assert r2.choices[0].text == r.choices[0].text
    grpc.close()
    assert all(s.blocks_used == 0 for s in served.wait_idle())


def test_streaming_sends_the_same_text_then_usage_and_done(served):
    api = _client(served)
    model = _model(served)
    whole = api.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    chunks = list(api.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # Several prompts in one streamed request: each choice whole, under its own index.
    texts: dict[int, str] = {}
    for c in api.completions.create(model=model, prompt=PROMPTS[:2], n=2, max_tokens=8, temperature=0, stream=True):
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    alone = [api.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in PROMPTS[:2]]
    assert [texts[i] for i in range(4)] == [alone[0], alone[0], alone[1], alone[1]]
    # On the wire: server-sent events, ending with `data: [DONE]`.
    conn = http.client.HTTPConnection(served.http, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": model, "prompt": PROMPTS[1], "max_tokens": 4,
                                                             "stream": True}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    conn.close()


def test_n_samples_share_one_prefill_and_are_reproducible(served, reference):
    api = _client(served)
    model = _model(served)
    prompt = "import os\nprint(os.path.join('a', 'b'))\n" + served.topology   # unique: nothing cached
    n_prompt = len(reference.engine.tokenize(prompt))
    before = _prompt_tokens_computed(served)
    r = api.completions.create(model=model, prompt=prompt, n=4, max_tokens=12, temperature=1.0, seed=7,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert _prompt_tokens_computed(served) - before == n_prompt      # computed once for 4 samples
    samples = [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)]
    assert len({tuple(s) for s in samples}) == 4                   # they differ from each other
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 48
    again = api.completions.create(model=model, prompt=prompt, n=4, max_tokens=12, temperature=1.0, seed=7,
                                   stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    streamed: dict[int, list[int]] = {}
    for chunk in again:
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.token_ids)
    assert [streamed[i] for i in range(4)] == samples               # the whole response is reproducible
    one = api.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=1.0, seed=9,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    assert one.choices[0].token_ids == samples[2]                   # sample j is seed + j alone
    greedy = api.completions.create(model=model, prompt=prompt, n=2, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert [c.token_ids for c in greedy.choices] == [reference(reference.engine.tokenize(prompt), 12)] * 2
    assert all(s.blocks_used == 0 for s in served.wait_idle())


def test_logprobs_echo_and_stop_strings(served, reference):
    import transformers
    api = _client(served)
    model = _model(served)
    prompt = PROMPTS[2]
    ids = reference.engine.tokenize(prompt)
    r = api.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True,
                               extra_body={"return_token_ids": True})
    lp = r.choices[0].logprobs
    out = r.choices[0].token_ids
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + len(out) and lp.token_logprobs[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference.engine.config.model, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + out])).logits[0], -1)
    seq = ids + out
    for i in range(1, len(seq)):       # prompt tokens (echo) and generated ones alike
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, seq[i]])) < 1e-4, i
        assert len(lp.top_logprobs[i]) == 2
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    grpc = Client(served.target, api_key=KEY)        # the same prompt logprobs over gRPC (v1 field 16)
    msgs = list(grpc.stream(prompt, max_tokens=6, prompt_logprobs=2))
    assert [m.logprob for m in msgs[0].prompt_logprobs] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-6)
    assert all(not m.prompt_logprobs for m in msgs[1:])
    grpc.close()
    # A stop string cut from the greedy text: the output ends before it, with finish_reason stop.
    text = api.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = api.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00"],
                                 extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop"


def test_chat_uses_the_models_template(served, reference, chat_model):
    import transformers
    api = _client(served)
    model = _model(served)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "1 + 2 ="}]
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(chat_model)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    r = api.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                    top_logprobs=1, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.token_ids == reference(ids, 10) and r.usage.prompt_tokens == len(ids)
    assert c.message.role == "assistant" and len(c.logprobs.content) == len(c.token_ids)
    parts = list(api.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                             stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == c.message.content
    assert parts[-1].choices[0].finish_reason == c.finish_reason


def test_errors_have_openai_shapes_and_statuses(served):
    api = _client(served)
    model = _model(served)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model, prompt="x", top_p=1.5)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model, prompt="x", max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens" and "limit of 256" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model, prompt="x", frequency_penalty=0.5)
    assert e.value.body["param"] == "frequency_penalty"
    with pytest.raises(openai.BadRequestError) as e:   # a prompt no decode worker can hold (48 blocks of 4)
        api.completions.create(model=model, prompt=[5] * 250, max_tokens=1)
    assert e.value.status_code == 400
    assert _post(served, "/v1/completions", b"{not json")[0] == 400
    with pytest.raises(openai.AuthenticationError) as e:
        _client(served, key="wrong").completions.create(model=model, prompt="x")
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    status, body = _post(served, "/v1/completions", b" " * (5 << 20))
    assert status == 413 and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:    # 5 prompts x n=64: over one request's share
        api.completions.create(model=model, prompt=["a"] * 5, n=64, max_tokens=1)
    assert e.value.body["param"] == "prompt" and "--max-samples-per-request" in e.value.body["message"]
    assert all(s.blocks_used == 0 for s in served.wait_idle())


def _send(served, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(tuple(served.http.split(":")), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _wait_running(served, timeout=30.0) -> None:
    limit = time.monotonic() + timeout
    while not any(s.running for s in served.stats()):
        assert time.monotonic() < limit, "the request never started"
        time.sleep(0.05)


def test_a_client_that_disconnects_stops_its_request_everywhere(served):
    model = _model(served)
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 250, "temperature": 0, "ignore_eos": True, "n": 2}
    for stream in (True, False):
        steps = sum(s.steps for s in served.stats())
        sock = _send(served, {**body, "stream": stream})
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")   # streaming has begun
        _wait_running(served)
        sock.close()
        stats = served.wait_idle(timeout=20)            # every block released, nothing left running
        assert all(s.blocks_used == 0 and s.running == 0 for s in stats)
        admission = served.cluster.frontend.service.admission   # and every in-flight slot given back: the
        limit = time.monotonic() + 10                           # frontend does so once the worker's abort returns
        while admission.in_use and time.monotonic() < limit:
            time.sleep(0.05)
        assert admission.in_use == 0 and not admission.waiting
        # Stopped, not run to the end: 250 tokens would take at least 250 engine steps.
        taken = sum(s.steps for s in stats) - steps
        assert taken < 150, taken


def _get(served, path: str, key: str = KEY) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(served.http, timeout=60)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data) if data else {}


def _post_json(served, path: str, body: dict, key: str = KEY) -> tuple[int, dict]:
    return _post(served, path, json.dumps(body).encode(), headers={"Authorization": f"Bearer {key}"})


def _model_config(chat_model) -> dict:
    return json.loads((chat_model / "config.json").read_text())


def test_version_and_the_models_context_length(served, chat_model):
    status, body = _get(served, "/version")
    assert status == 200 and body == {"version": splitserve_version()}
    rpc = Client(served.target, api_key=KEY)
    assert rpc.server_info().version == splitserve_version()
    rpc.close()
    assert _get(served, "/version", key="wrong") == (200, body)          # open, as /health and vLLM's
    card = _client(served).models.list().data[0]          # vLLM's extension, as the openai client sees it
    assert card.model_extra["max_model_len"] == _model_config(chat_model)["max_position_embeddings"]


def test_tokenize_gives_the_prompt_the_server_runs(served, reference, chat_model):
    import transformers
    api = _client(served)
    model = _model(served)
    status, tok = _post_json(served, "/tokenize", {"model": model, "prompt": PROMPTS[1]})
    assert status == 200 and tok["tokens"] == reference.engine.tokenize(PROMPTS[1])
    assert tok["count"] == len(tok["tokens"]) and tok["token_strs"] is None
    assert tok["max_model_len"] == _model_config(chat_model)["max_position_embeddings"]
    by_text = api.completions.create(model=model, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    by_ids = api.completions.create(model=model, prompt=tok["tokens"], max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == tok["count"]
    status, bare = _post_json(served, "/tokenize", {"prompt": PROMPTS[1], "add_special_tokens": False})
    assert status == 200 and bare["tokens"] == tok["tokens"][1:]          # the llama tokenizer's BOS
    # A chat: rendered by the model's template as transformers renders it, tokenized without specials.
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2 + 2 ="}]
    status, chat = _post_json(served, "/tokenize", {"model": model, "messages": messages, "return_token_strs": True})
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(chat_model)
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert status == 200 and chat["tokens"] == hf(text, add_special_tokens=False).input_ids
    assert chat["token_strs"] == hf.convert_ids_to_tokens(chat["tokens"])
    r = api.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                    extra_body={"return_token_ids": True})
    same = api.completions.create(model=model, prompt=chat["tokens"], max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert same.choices[0].token_ids == r.choices[0].token_ids and r.usage.prompt_tokens == chat["count"]
    assert all(s.blocks_used == 0 for s in served.wait_idle())


def test_detokenize_round_trips_and_refuses_what_is_no_token(served, chat_model):
    model = _model(served)
    status, tok = _post_json(served, "/tokenize", {"prompt": PROMPTS[2]})
    status, back = _post_json(served, "/detokenize", {"model": model, "tokens": tok["tokens"]})
    assert status == 200 and back == {"prompt": "<s>" + PROMPTS[2]}           # special tokens kept, as vLLM
    vocab = _model_config(chat_model)["vocab_size"]
    for tokens in ([1, vocab], [-1], "12"):
        status, err = _post_json(served, "/detokenize", {"tokens": tokens})
        assert status == 400 and err["error"]["param"] == "tokens", err
        assert err["error"]["type"] == "invalid_request_error"
    status, err = _post_json(served, "/tokenize", {"prompt": "x", "model": "gpt-4"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    status, err = _post_json(served, "/tokenize", {"prompt": "x", "add_special_tokens": "no"})
    assert status == 400 and err["error"]["param"] == "add_special_tokens"
    status, err = _post_json(served, "/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                                   "continue_final_message": True})
    assert status == 400 and err["error"]["param"] == "continue_final_message"
    for path in ("/tokenize", "/detokenize"):
        status, err = _post_json(served, path, {"prompt": "x", "tokens": [1]}, key="wrong")
        assert status == 401 and err["error"]["code"] == "invalid_api_key"


def test_grpc_tokenize_and_detokenize_match_http(served, chat_model):
    rpc = Client(served.target, api_key=KEY)
    _, tok = _post_json(served, "/tokenize", {"prompt": PROMPTS[0], "return_token_strs": True})
    ours = rpc.tokenize(PROMPTS[0], return_token_strs=True)
    assert list(ours.token_ids) == tok["tokens"] and list(ours.token_strs) == tok["token_strs"]
    assert ours.max_model_len == tok["max_model_len"]
    assert rpc.tokenize(PROMPTS[0], add_special_tokens=False).token_ids == ours.token_ids[1:]
    assert rpc.tokenize(PROMPTS[0]).token_strs is None
    assert rpc.detokenize(ours.token_ids) == "<s>" + PROMPTS[0]
    assert rpc.generate(list(ours.token_ids), max_tokens=8).text == rpc.generate(PROMPTS[0], max_tokens=8).text
    vocab = _model_config(chat_model)["vocab_size"]
    with pytest.raises(grpc.RpcError) as e:
        rpc.detokenize([3, vocab + 1])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(vocab + 1) in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        Client(served.target).tokenize("x")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    raw = rpc.channel.unary_unary("/splitserve.v1.Inference/Tokenize")
    with pytest.raises(grpc.RpcError) as e:                  # a malformed message is the client's fault
        raw(b"\xff\xff\xff", metadata=(("authorization", f"Bearer {KEY}"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rpc.close()


def test_models_health_and_not_serving_while_shutting_down(served):
    models = _client(served).models.list()
    assert [m.id for m in models.data] == [_model(served)]
    conn = http.client.HTTPConnection(served.http, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200
    conn.request("GET", "/metrics")                      # tenant names and counts: behind the key
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 401
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})   # the cluster's series
    resp = conn.getresponse()
    assert resp.status == 200 and b"splitserve_prompt_tokens_computed" in resp.read()
    served.run(served.cluster.router.shutdown())        # what stopping the server does first
    conn.request("GET", "/health")
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 503
    with pytest.raises(openai.InternalServerError) as e:
        _client(served).completions.create(model=_model(served), prompt="x")
    assert e.value.status_code == 503
