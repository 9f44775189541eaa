"""Test-time compute (`test_time`) on a served cluster, through the real `openai` client and gRPC:
a tiny chat model on 1 prefill + 1 decode worker (KV over TCP, n-gram speculation on the decode
side), one cluster for the module. A majority's chosen answer is the most frequent extracted answer
among the candidates, usage counts every sample's tokens, early stop spends fewer tokens when the
samples agree, past the bounds is a 400 (INVALID_ARGUMENT on gRPC) naming the field, and every
pool ends empty (the samples cut short freed their blocks)."""
from __future__ import annotations

from collections import Counter

import grpc
import openai
import pytest
from cluster_harness import ClusterThread
from tiny_models import make_chat_model

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig, SpeculativeConfig
from cluster.launch.app import ClusterConfig
from proto.splitserve.v1 import inference_pb2 as pb
from router.client import Client, build_request
from router.router import RouterConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_chat_model(tmp_path_factory.mktemp("chat"), "llama")
    engine = EngineConfig(model=model, dtype="float32", num_threads=1, kernels="torch",
                          cache=CacheConfig(block_size=4, num_blocks=96),
                          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    c = ClusterThread(ClusterConfig(engine=engine, data_plane=DataPlaneConfig(transport="tcp"), port=0, http_port=0,
                                    router=RouterConfig(local_prefill_max_tokens=2), max_tokens_limit=64))
    c.client = openai.OpenAI(base_url=f"http://127.0.0.1:{c.cluster.http_port}/v1", api_key="none", max_retries=0)
    c.model = c.client.models.list().data[0].id
    yield c
    c.stop()


def _answers(body: dict) -> list[str | None]:
    return [c["answer"] for c in body["test_time"]["candidates"]]


def test_majority_chooses_the_most_frequent_answer_and_usage_counts_every_sample(served):
    tt = {"strategy": "majority", "samples": 6, "answer_pattern": r"(\S)\S*$"}
    r = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=3, temperature=1.5, seed=11,
                                         extra_body={"test_time": tt}).model_dump()
    body = r["test_time"]
    assert body["samples_run"] == 6 and not body["stopped_early"] and len(body["candidates"]) == 6
    votes = Counter(a for a in _answers(r) if a is not None)
    chosen = body["candidates"][body["chosen"]]
    assert votes[chosen["answer"]] == max(votes.values()), (votes, chosen)
    assert r["choices"][0]["text"] == chosen["text"] and len(r["choices"]) == 1
    assert r["usage"]["completion_tokens"] == sum(c["tokens"] for c in body["candidates"]) == 18
    assert r["usage"]["prompt_tokens"] > 0
    # best_of over the chat endpoint: the chosen sample has the highest mean logprob.
    chat = served.client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0, seed=3,
        extra_body={"test_time": {"strategy": "best_of", "samples": 3}}).model_dump()
    scores = [c["score"] for c in chat["test_time"]["candidates"]]
    assert chat["test_time"]["chosen"] == scores.index(max(scores))
    assert chat["choices"][0]["message"]["content"] == chat["test_time"]["candidates"][scores.index(max(scores))]["text"]
    assert chat["choices"][0]["logprobs"] is None          # asked for the scorer, not returned
    served.wait_idle(timeout=30)


def test_early_stop_spends_fewer_tokens_when_the_samples_agree(served):
    def run(early_stop: bool) -> dict:
        tt = {"strategy": "majority", "samples": 8, "early_stop": early_stop}
        return served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                                extra_body={"test_time": tt, "ignore_eos": True}).model_dump()
    full, early = run(False), run(True)
    assert full["usage"]["completion_tokens"] == 8 * 6 and full["test_time"]["samples_run"] == 8
    assert early["test_time"]["stopped_early"] and early["test_time"]["samples_run"] == 3
    assert early["usage"]["completion_tokens"] == 3 * 6 < full["usage"]["completion_tokens"]
    assert early["choices"][0]["text"] == full["choices"][0]["text"]      # greedy samples agree
    assert len(set(_answers(full))) == 1
    served.wait_idle(timeout=30)


def test_bounds_and_refusals_name_the_field(served):
    cases = {"test_time.samples": {"test_time": {"strategy": "majority", "samples": 17}},
             "test_time.strategy": {"test_time": {"strategy": "vote", "samples": 2}},
             "test_time.answer_pattern": {"test_time": {"strategy": "majority", "samples": 2, "answer_pattern": "("}},
             "test_time.scorer": {"test_time": {"strategy": "best_of", "samples": 2, "scorer": "other"}},
             "n": {"test_time": {"strategy": "majority", "samples": 2}, "n": 2},
             "stream": {"test_time": {"strategy": "majority", "samples": 2}, "stream": True}}
    for param, extra in cases.items():
        with pytest.raises(openai.BadRequestError) as err:
            served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert err.value.status_code == 400 and err.value.body["param"] == param, (param, err.value.body)
        assert param != "test_time.samples" or "--max-test-time-samples" in err.value.body["message"]


def test_grpc_answers_one_message_with_the_candidates(served):
    rpc = Client(served.target)
    req = build_request(PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
    req.test_time.CopyFrom(pb.TestTime(strategy=pb.TEST_TIME_STRATEGY_MAJORITY, samples=4, early_stop=True))
    msgs = list(rpc.stub.Generate(req, timeout=120))
    assert len(msgs) == 1
    m = msgs[0]
    assert m.test_time.samples_run == 3 and m.test_time.stopped_early and len(m.test_time.candidates) == 3
    assert m.usage.completion_tokens == 12 and len(m.token_ids) == 4 and m.finish_reason == pb.FINISH_REASON_LENGTH
    assert m.text == m.test_time.candidates[m.test_time.chosen].text
    req.test_time.samples = 17
    with pytest.raises(grpc.RpcError) as err:
        list(rpc.stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "test_time.samples" in err.value.details()
    rpc.close()
    served.wait_idle(timeout=30)
