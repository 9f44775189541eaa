"""More models than memory (`--max-loaded-models 1`, docs/models.md): two tiny models in one
colocated cluster, one worker each, at most one model's weights loaded at once. Requests that
alternate between the models each answer greedily exactly as that model's engine alone; the
workers released and loaded their weights (counted in their stats and in
`splitserve_model_loads_total`); concurrent requests of both models end with one model loaded and
every KV block free; an unknown model is still a 404; what is not built is refused by name."""
from __future__ import annotations

import http.client
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from test_models_cluster import _engine, _greedy, _post, _Started
from tiny_models import make_chat_model, make_model

from cluster.launch.cluster_config import ClusterConfig, ModelSpec
from cluster.launch.model_swap import check_model_swap

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("swap")
    return make_chat_model(root / "chat", "llama"), make_model(root / "code", "llama", seed=1)


@pytest.fixture(scope="module")
def served(dirs):
    chat, code = dirs
    c = _Started(ClusterConfig(engine=_engine(chat), served_model_name="chatter", colocated=True, num_decode=1,
                               models=(ModelSpec(str(code), "coder"),), max_loaded_models=1,
                               model_switch_max_wait_ms=200, port=None, http_port=0))
    c.http = f"127.0.0.1:{c.cluster.http_port}"
    yield c
    c.stop()


def _complete(served, name: str) -> list[int]:
    status, r = _post(served, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 8,
                                                  "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert status == 200 and r["model"] == name, r
    return r["choices"][0]["token_ids"]


def _stats(served):
    async def go():
        return {c.model_name: [await w.stats() for w in c.workers.values()]
                for c in (served.cluster, *served.cluster.models)}
    return served.run(go())


def test_models_swap_and_answer_as_alone(served, dirs, single_engine):
    chat, code = dirs
    expected = {"chatter": _greedy(single_engine, chat, PROMPT), "coder": _greedy(single_engine, code, PROMPT)}
    assert expected["chatter"] != expected["coder"]
    before = _stats(served)
    assert [s.weights_loaded for s in before["chatter"] + before["coder"]] == [True, False]   # the first is kept
    for name in ("coder", "chatter", "coder"):
        assert _complete(served, name) == expected[name], name
    after = _stats(served)
    assert [s.model_loads for s in after["chatter"] + after["coder"]] == [1, 2]
    assert sum(s.weights_loaded for s in after["chatter"] + after["coder"]) == 1
    conn = http.client.HTTPConnection(served.http, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    assert 'splitserve_model_loads_total{model_name="coder",worker="colocated-0"} 2.0' in text

    # Concurrent requests of both models: each answers as alone; the gate ends idle, one model
    # loaded, and every worker's pool is back to no block held.
    names = ["chatter", "coder"] * 4
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(lambda n: _complete(served, n), names))
    assert answers == [expected[n] for n in names]
    end = _stats(served)
    assert sum(s.weights_loaded for ss in end.values() for s in ss) == 1
    assert all(s.blocks_used == 0 and not s.has_work for ss in end.values() for s in ss)
    loads = sum(s.model_loads for ss in end.values() for s in ss) - 3
    assert 1 <= loads <= len(names)


def test_unknown_model_is_404(served):
    status, r = _post(served, "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1})
    assert status == 404 and "'coder'" in r["error"]["message"]


def test_refused_where_not_built(dirs):
    chat, code = dirs
    base = {"engine": _engine(chat), "models": (ModelSpec(str(code), "coder"),), "max_loaded_models": 1}
    with pytest.raises(ValueError, match="--colocated"):
        check_model_swap(ClusterConfig(**base))
    with pytest.raises(ValueError, match="several models"):
        check_model_swap(ClusterConfig(engine=_engine(chat), colocated=True, max_loaded_models=1))
    with pytest.raises(ValueError, match="--cuda-graphs off"):    # graphs would replay released weights
        check_model_swap(ClusterConfig(**{**base, "engine": replace(_engine(chat), device="cuda")}, colocated=True))
    check_model_swap(ClusterConfig(**base, colocated=True))
