"""Two tiny models served together in one cluster (1 prefill + 1 decode worker each, KV over TCP):
each answers greedily exactly as its engine alone, through the OpenAI API and gRPC; both are
listed; an unknown model is a 404 / NOT_FOUND naming the served ones; `model: "auto"` follows the
skill routes (a chat request only to the model with a chat template); a model's requests reach
only its own workers, and the two models' KV layouts differ (a handle of one is refused by the other)."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import grpc
import pytest
from cluster_harness import ClusterThread, session_ray
from tiny_models import make_chat_model, make_model

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig
from cluster.launch.cluster_config import ClusterConfig, ModelSpec
from cluster.launch.models import start_models
from cluster.types import SamplingParams
from proto.splitserve.v1 import inference_pb2 as pb
from router.client import Client
from router.router import RouterConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CODE_PROMPT = "def add(a, b):\n"
CHAT_PROMPT = "What is the capital of France?"
ROUTES = """routes:
  - model: coder
    skills: [completing Python code]
    examples: ["def f(x):\\n    return x\\n", "import os\\nprint(os.getcwd())\\n", "class A:\\n    pass\\n"]
  - model: chatter
    skills: [answering questions, conversation]
    examples: ["What is the tallest mountain?", "Hello, how are you today?", "Tell me a story about a cat."]
"""


def _engine(model_dir) -> EngineConfig:
    return EngineConfig(model=model_dir, dtype="float32", num_threads=1, kernels="torch",
                        cache=CacheConfig(block_size=4, num_blocks=48))


class _Started(ClusterThread):
    """ClusterThread over `start_models` (several models)."""

    def __init__(self, cfg):
        session_ray()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cluster = self.run(start_models(cfg), timeout=300)
        self.target = f"127.0.0.1:{self.cluster.port}"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    routes = root / "routes.yaml"
    routes.write_text(ROUTES)
    return make_chat_model(root / "chat", "llama"), make_model(root / "code", "llama", seed=1), routes


@pytest.fixture(scope="module")
def served(dirs):
    chat, code, routes = dirs
    c = _Started(ClusterConfig(engine=_engine(chat), served_model_name="chatter",
                               models=(ModelSpec(str(code), "coder"),), skill_routes=str(routes),
                               data_plane=DataPlaneConfig(transport="tcp"), port=0, http_port=0,
                               router=RouterConfig(local_prefill_max_tokens=2)))
    c.http = f"127.0.0.1:{c.cluster.http_port}"
    yield c
    c.stop()


def _post(served, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(served.http, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = json.loads(r.read() or b"{}")
    conn.close()
    return r.status, data


def _greedy(single_engine, model_dir, prompt: str) -> list[int]:
    engine = single_engine(_engine(model_dir))
    return list(engine.generate([engine.tokenize(prompt)], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids)


def _computed(cluster) -> int:
    async def go():
        return sum([(await c.stats()).prompt_tokens_computed for c in cluster.workers.values()])
    return go()


def test_each_model_answers_as_alone(served, dirs, single_engine):
    chat, code, _ = dirs
    grpc_client = Client(served.target)
    for name, model_dir in (("chatter", chat), ("coder", code)):
        expected = _greedy(single_engine, model_dir, CODE_PROMPT)
        status, r = _post(served, "/v1/completions", {"model": name, "prompt": CODE_PROMPT, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert status == 200 and r["model"] == name
        assert r["choices"][0]["token_ids"] == expected, name
        assert list(grpc_client.generate(CODE_PROMPT, max_tokens=8, ignore_eos=True, model=name).token_ids) == expected
    assert _greedy(single_engine, chat, CODE_PROMPT) != _greedy(single_engine, code, CODE_PROMPT)


def test_models_listed_and_unknown_refused(served):
    conn = http.client.HTTPConnection(served.http, timeout=30)
    conn.request("GET", "/v1/models")
    assert {m["id"] for m in json.loads(conn.getresponse().read())["data"]} == {"chatter", "coder"}
    conn.close()
    conn = http.client.HTTPConnection(served.http, timeout=30)
    conn.request("GET", "/metrics")         # one scrape: both models' series, each family once
    text = conn.getresponse().read().decode()
    conn.close()
    assert 'model_name="chatter"' in text and 'model_name="coder"' in text
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    status, r = _post(served, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1})
    assert status == 404 and "'chatter'" in r["error"]["message"] and "'coder'" in r["error"]["message"]
    client = Client(served.target)
    assert {m.id for m in client.list_models()} == {"chatter", "coder"}
    with pytest.raises(grpc.RpcError) as err:
        client.generate("x", max_tokens=1, model="nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "coder" in err.value.details()


def test_auto_routes_by_skill(served):
    for prompt, expected in ((CODE_PROMPT, "coder"), (CHAT_PROMPT, "chatter")):
        status, r = _post(served, "/v1/completions", {"model": "auto", "prompt": prompt, "max_tokens": 2})
        assert status == 200 and r["model"] == expected, (prompt, r)
    # A chat request goes only to a model with a chat template, whatever it asks.
    status, r = _post(served, "/v1/chat/completions", {"model": "auto", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": CODE_PROMPT}]})
    assert status == 200 and r["model"] == "chatter"
    first = next(iter(Client(served.target).stream(CODE_PROMPT, max_tokens=2, model="auto")))
    assert first.model == "coder"


def test_models_never_share_workers_or_layouts(served, dirs, single_engine):
    main, (other,) = served.cluster, served.cluster.models
    assert main.frontend.workers is not other.frontend.workers      # own pools and rosters
    assert not {c.handle for c in main.workers.values()} & {c.handle for c in other.workers.values()}
    before = served.run(_computed(main)), served.run(_computed(other))
    status, _ = _post(served, "/v1/completions", {"model": "coder", "prompt": "class Point:\n    def",
                                                  "max_tokens": 2})
    assert status == 200
    after = served.run(_computed(main)), served.run(_computed(other))
    assert after[0] == before[0] and after[1] > before[1]
    chat, code, _ = dirs
    layouts = [single_engine(_engine(d)).layout for d in (chat, code)]
    assert layouts[0].layout_hash() != layouts[1].layout_hash()   # a handle of one model is refused by the other


def test_abort_and_tokenize_reach_the_named_model(served, dirs, single_engine):
    client = Client(served.target)
    stream = client.stream(CODE_PROMPT, request_id="long-coder", max_tokens=240, ignore_eos=True, model="coder")
    next(iter(stream))          # running on the coder's workers, not the first model's
    assert client.stub.Abort(pb.AbortRequest(request_id="long-coder")).found
    stream.cancel()
    _, code, _ = dirs
    ids = single_engine(_engine(code)).tokenize(CHAT_PROMPT)
    assert list(client.stub.Tokenize(pb.TokenizeRequest(text=CHAT_PROMPT, model="coder")).token_ids) == list(ids)
    served.wait_idle(30)
    (other,) = served.cluster.models

    async def other_busy():
        return [s for s in [await c.stats() for c in other.workers.values()] if s.blocks_used or s.leases or s.running]
    deadline = time.monotonic() + 30
    while served.run(other_busy()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not served.run(other_busy())      # the aborted request's blocks are back on the coder's workers
