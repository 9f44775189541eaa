"""A hostile client against a served cluster (1 prefill + 1 decode over TCP, two tenants, short
connection timeouts; one cluster for the module): every malformed input is a 4xx with no
traceback in the log, every bound is refused by name, idle and trickling connections are closed,
admission queues then refuses, request ids are per tenant, and the server is healthy and its
pools empty afterwards. A property-based fuzz of the OpenAI bodies and the v1 messages (the
tokenizer's too) runs at a bounded size here; `bench/hostile.py` runs the attacks against a victim
and times them."""
from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.launch.app import ClusterConfig
from cluster.config import DataPlaneConfig
from router.router import RouterConfig
from cluster.config import CacheConfig, EngineConfig
from cluster_harness import ClusterThread
from proto.splitserve.v1 import inference_pb2 as pb
from router.admission import AdmissionConfig
from router.client import Client, _metadata
from router.connections import ConnectionLimits
from tiny_models import make_chat_model

pytestmark = pytest.mark.ray

# The suite's bounded size; bench/fuzz_api.py runs the same fuzz with more examples.
FUZZ_EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "120"))
KEYS = {"alpha": "sk-alpha-0123456789", "beta": "sk-beta-0123456789"}
TIMEOUT_S = 1.0


class _Tracebacks(logging.Handler):
    """Every log record of this process at ERROR or with a traceback (uvicorn's, grpc's, ours)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_chat_model(tmp_path_factory.mktemp("chat"), "llama")
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    keys.chmod(0o600)
    from cluster.secrets import read_api_key_file
    c = ClusterThread(ClusterConfig(
        engine=EngineConfig(model=model, dtype="float32", num_threads=1, kernels="torch",
                            cache=CacheConfig(block_size=4, num_blocks=64)),
        data_plane=DataPlaneConfig(transport="tcp"), port=0, http_port=0,
        router=RouterConfig(local_prefill_max_tokens=2), max_tokens_limit=256,
        api_keys=read_api_key_file(str(keys)), admission=AdmissionConfig(max_in_flight=8, queue_timeout_s=TIMEOUT_S),
        connections=ConnectionLimits(http_header_timeout_s=TIMEOUT_S, http_body_timeout_s=TIMEOUT_S,
                                     http_idle_timeout_s=TIMEOUT_S, grpc_handshake_timeout_s=TIMEOUT_S)))
    c.http = ("127.0.0.1", c.cluster.http_port)
    # After the start: uvicorn's logging config replaces the handlers of its loggers.
    tracebacks = _Tracebacks()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "grpc", "router", "cluster")]
    for lg in loggers:
        lg.addHandler(tracebacks)
    c.tracebacks = tracebacks
    yield c
    c.stop()
    for lg in loggers:
        lg.removeHandler(tracebacks)


def _post(served, path: str, body: bytes | str, key: str = KEYS["alpha"]) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*served.http, timeout=60)
    conn.request("POST", path, body=body.encode() if isinstance(body, str) else body,
                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    try:
        return r.status, json.loads(data) if data else {}
    except ValueError:
        return r.status, {"not_json": data[:200]}


def _healthy_and_idle(served) -> None:
    conn = http.client.HTTPConnection(*served.http, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    served.wait_idle()
    admission = served.cluster.frontend.service.admission
    limit = time.monotonic() + 10          # slots come back once the workers' aborts have returned
    while admission.in_use and time.monotonic() < limit:
        time.sleep(0.05)
    assert admission.in_use == 0
    assert not served.tracebacks.records, [r.getMessage() for r in served.tracebacks.records[:3]]


BIG = "1" + "0" * 400      # an integer no float can hold


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"prompt": "x", "temperature": %s}' % BIG, "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_k": %d}' % 2**40, "top_k"),
    ("/v1/completions", '{"prompt": [%d]}' % 2**31, "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop_token_ids": [%d]}' % 2**40, "stop_token_ids"),
    ("/v1/completions", '{"prompt": "x", "num_speculative_tokens": %d}' % 2**40, "num_speculative_tokens"),
    ("/v1/completions", '{"prompt": "a\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\udc00"]}', "stop[0]"),
    ("/v1/completions", '{"prompt": "x", "cache_salt": "\\ud800"}', "cache_salt"),
    ("/v1/completions", '{"prompt": "x", "model": "\\ud800"}', "model"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/completions", "[" * 10_000 + "]" * 10_000, None),
    ("/v1/completions", '{"prompt": ' + "[" * 40 + "1" + "]" * 40 + "}", "prompt" + "[0]" * 31),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
                             '"chat_template_kwargs": {"messages": [], "tools": 1}}', "chat_template_kwargs"),
    ("/v1/completions", '{"prompt": "x", "max_completion_tokens": 0}', "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "stop": %s}' % json.dumps(["s"] * 33), "stop"),
    ("/v1/completions", '{"prompt": "x", "stop": %s}' % json.dumps(["s" * 257]), "stop"),
    ("/v1/completions", '{"prompt": ["a", "b", "c"], "n": 30}', "prompt"),
    ("/tokenize", '{"prompt": "a\\ud800"}', "prompt"),
    ("/tokenize", '{"prompt": "x", "add_special_tokens": %s}' % BIG, "add_special_tokens"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": 1}}',
     "chat_template_kwargs"),
    ("/detokenize", '{"tokens": [%d]}' % 2**70, "tokens"),
    ("/detokenize", '{"tokens": [1e400]}', "tokens"),
    ("/detokenize", '{"tokens": %s}' % ("[" * 40 + "]" * 40), "tokens" + "[0]" * 31),
])
def test_malformed_input_is_a_400_naming_the_field(served, path, raw, param):
    status, body = _post(served, path, raw)
    assert status == 400, body
    if param is not None:
        assert body["error"]["param"] == param, body
    assert len(body["error"]["message"]) < 1100


def test_a_huge_echoed_value_is_cut_and_grpc_decode_errors_are_invalid_argument(served):
    status, body = _post(served, "/v1/completions", json.dumps({"prompt": "x", "model": "m" * 1_000_000}))
    assert status == 404 and len(body["error"]["message"]) < 200
    client = Client(f"127.0.0.1:{served.cluster.port}", api_key=KEYS["alpha"])
    with pytest.raises(grpc.RpcError) as e:          # 1 MB in the error would overflow the trailers
        list(client.stub.Generate(pb.GenerateRequest(text="x", model="m" * 1_000_000),
                                  metadata=_metadata(client.api_key)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 1100
    raw = client.channel.unary_stream("/splitserve.v1.Inference/Generate")
    for junk in (b"\xff\xff\xff", b"\x0a\x02\xc3\x28", pb.GenerateRequest(text="x").SerializeToString()[:-1]):
        with pytest.raises(grpc.RpcError) as e:
            list(raw(junk, metadata=_metadata(client.api_key)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, junk
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["s"] * 33)),
                                  metadata=_metadata(client.api_key)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-stop-strings" in e.value.details()
    _healthy_and_idle(served)


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bytes:
    """What the server sends before it closes the connection, sending `trickle` a byte at a time
    meanwhile; fails if it is still open after `seconds`."""
    sock.settimeout(0.2)
    got, limit = b"", time.monotonic() + seconds
    for i in range(10_000):
        assert time.monotonic() < limit, "the server kept the connection open"
        if trickle:
            try:
                sock.send(trickle[i % len(trickle):i % len(trickle) + 1])
            except OSError:
                return got
        try:
            data = sock.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            return got
        if not data:
            return got
        got += data
    raise AssertionError("unreachable")


def test_idle_trickling_and_short_bodies_are_closed(served):
    silent = socket.create_connection(served.http)
    assert _closed_within(silent, 10 * TIMEOUT_S) == b""
    slowloris = socket.create_connection(served.http)
    slowloris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert _closed_within(slowloris, 10 * TIMEOUT_S, trickle=b"X-Padding: aaaaaaaaaaaaaaaa\r\n").startswith(
        b"HTTP/1.1 408")
    short = socket.create_connection(served.http)
    short.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nAuthorization: Bearer "
                  + KEYS["alpha"].encode() + b"\r\n\r\n{\"prompt\":")
    assert b" 408 " in _closed_within(short, 10 * TIMEOUT_S).split(b"\r\n")[0]
    grpc_silent = socket.create_connection(("127.0.0.1", served.cluster.port))
    _closed_within(grpc_silent, 10 * TIMEOUT_S)          # gRPC says GOAWAY (handshake timeout) and closes
    _healthy_and_idle(served)


def test_admission_queues_then_refuses_and_metrics_need_a_key(served):
    service = served.cluster.frontend.service
    tickets = served.run(service.admission.acquire("beta", 8))     # another tenant holds every slot
    try:
        status, body = _post(served, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}))
        assert status == 429 and body["error"]["code"] == "overloaded", body
    finally:
        served.loop.call_soon_threadsafe(service.admission.release, tickets)
    status, body = _post(served, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 1}))
    assert status == 200
    conn = http.client.HTTPConnection(*served.http, timeout=10)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    r.read()
    assert r.status == 401
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEYS['beta']}"})
    r = conn.getresponse()
    text = r.read().decode()
    refused = (f'splitserve_requests_refused_total{{model_name="{service.limits.model_id}",reason="queue_timeout",'
               f'tenant="alpha"}} 1.0')
    assert r.status == 200 and refused in text
    _healthy_and_idle(served)


def test_request_ids_are_scoped_per_tenant(served):
    alpha = Client(f"127.0.0.1:{served.cluster.port}", api_key=KEYS["alpha"])
    beta = Client(f"127.0.0.1:{served.cluster.port}", api_key=KEYS["beta"])
    # 250 tokens: still running while beta's 2-token request and alpha's second call come and go
    # (a 16-token one finished first on a loaded machine, and its id was free again).
    long = alpha.stream("x y z", max_tokens=250, ignore_eos=True, request_id="shared-id")
    first = next(iter(long))
    assert first.request_id == "shared-id"
    found = beta.stub.Abort(pb.AbortRequest(request_id="shared-id"), metadata=_metadata(beta.api_key)).found
    assert not found                                        # beta cannot see or stop alpha's request
    got = list(beta.stream("x y z", max_tokens=2, ignore_eos=True, request_id="shared-id"))
    assert got[-1].request_id == "shared-id" and got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    with pytest.raises(grpc.RpcError) as e:                 # alpha's own id, while it runs
        list(alpha.stream("x", max_tokens=1, request_id="shared-id"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    found = alpha.stub.Abort(pb.AbortRequest(request_id="shared-id"), metadata=_metadata(alpha.api_key)).found
    rest = list(long)
    assert found and rest[-1].finish_reason == pb.FINISH_REASON_ABORT    # its owner can stop it
    _healthy_and_idle(served)


# --- property-based fuzzing ------------------------------------------------------------------------
_FIELDS = ["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "n", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs", "echo", "stream",
           "stream_options", "ignore_eos", "repetition_penalty", "cache_salt", "speculative",
           "num_speculative_tokens", "chat_template_kwargs", "tools", "tool_choice", "response_format",
           "add_generation_prompt", "return_token_ids", "best_of", "presence_penalty"]
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 40),
                     st.floats(allow_nan=True), st.text(max_size=12),
                     st.sampled_from(["\ud800", "auto", "user", "ngram", "x" * 300]))
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=12)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                  "content": st.one_of(st.text(max_size=20), _json)})
_body = st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=6).flatmap(
    lambda d: st.fixed_dictionaries({**{k: st.just(v) for k, v in d.items()},
                                     "max_tokens": st.integers(-1, 4), "prompt": st.one_of(st.text(max_size=20), _json),
                                     "messages": st.lists(_message, max_size=3)}))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=FUZZ_EXAMPLES <= 120)
@given(body=_body, chat=st.booleans())
def test_fuzzed_openai_bodies_never_get_a_5xx(served, body, chat):
    status, answer = _post(served, "/v1/chat/completions" if chat else "/v1/completions",
                           json.dumps(body, allow_nan=True))
    assert status < 500, (status, answer, body)


_WELL_FORMED = {"messages": st.lists(_message, max_size=3), "prompt": st.text(max_size=20)}
_tokenizer_body = st.dictionaries(st.sampled_from(["prompt", "messages", "model", "add_special_tokens",
                                                   "return_token_strs", "add_generation_prompt",
                                                   "continue_final_message", "chat_template_kwargs", "tools"]),
                                  _json, max_size=5).flatmap(
    lambda d: st.fixed_dictionaries({**{k: st.just(v) for k, v in d.items()},
                                     "tokens": st.one_of(st.lists(st.integers(-2**40, 2**40), max_size=5), _json)},
                                    optional={k: v for k, v in _WELL_FORMED.items() if k not in d}))


@settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=FUZZ_EXAMPLES <= 120)
@given(body=_tokenizer_body, path=st.sampled_from(["/tokenize", "/detokenize"]))
def test_fuzzed_tokenizer_bodies_never_get_a_5xx(served, body, path):
    status, answer = _post(served, path, json.dumps(body, allow_nan=True))
    assert status < 500, (status, answer, body)


_sampling = st.builds(pb.SamplingParams, max_tokens=st.integers(-2**31, 2**31 - 1), temperature=st.floats(width=32),
                      top_p=st.floats(width=32), top_k=st.integers(-2**31, 2**31 - 1),
                      stop=st.lists(st.text(max_size=5), max_size=40), stop_token_ids=st.lists(
                          st.integers(-2**31, 2**31 - 1), max_size=3), logprobs=st.integers(-2**31, 2**31 - 1),
                      num_speculative_tokens=st.integers(0, 2**32 - 1), seed=st.integers(0, 2**64 - 1),
                      speculative=st.sampled_from(["", "ngram", "eagle", "x"]), cache_salt=st.text(max_size=5))
_request = st.builds(pb.GenerateRequest, request_id=st.text(max_size=10), model=st.text(max_size=5),
                     text=st.text(max_size=20), sampling=_sampling)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=FUZZ_EXAMPLES <= 120)
@given(request=_request, junk=st.binary(max_size=64), cut=st.integers(0, 200), short=st.booleans())
def test_fuzzed_grpc_messages_get_a_status_of_their_own(served, request, junk, cut, short):
    client = _fuzz_client(served)
    raw = client.channel.unary_stream("/splitserve.v1.Inference/Generate")
    data = request.SerializeToString()
    for payload in (junk, data[:cut] + junk[:3] if short else data):
        try:
            list(raw(payload, metadata=_metadata(client.api_key), timeout=60))
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                grpc.StatusCode.ALREADY_EXISTS), (e.code(), e.details(), payload)


_tokenize_request = st.builds(pb.TokenizeRequest, text=st.text(max_size=20), model=st.text(max_size=3),
                              add_special_tokens=st.booleans(), return_token_strs=st.booleans())
_detokenize_request = st.builds(pb.DetokenizeRequest, token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=5),
                                model=st.text(max_size=3))


@settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=FUZZ_EXAMPLES <= 120)
@given(request=st.one_of(_tokenize_request, _detokenize_request), junk=st.binary(max_size=64))
def test_fuzzed_tokenizer_messages_get_a_status_of_their_own(served, request, junk):
    client = _fuzz_client(served)
    raw = client.channel.unary_unary(f"/splitserve.v1.Inference/{type(request).__name__.removesuffix('Request')}")
    for payload in (junk, request.SerializeToString()):
        try:
            raw(payload, metadata=_metadata(client.api_key), timeout=60)
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), \
                (e.code(), e.details(), payload)


_CLIENTS: dict = {}


def _fuzz_client(served) -> Client:
    if served.cluster.port not in _CLIENTS:
        _CLIENTS[served.cluster.port] = Client(f"127.0.0.1:{served.cluster.port}", api_key=KEYS["beta"])
    return _CLIENTS[served.cluster.port]


def test_after_the_fuzz_the_server_is_healthy_with_every_block_free(served):
    _healthy_and_idle(served)
