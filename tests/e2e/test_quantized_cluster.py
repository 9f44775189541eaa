"""The default model served by a 1P1D cluster with `--quantization gguf --kv-cache-dtype int8` (real
Ray actors, gRPC, KV over TCP): the prefill worker computes the prompt's KV on the file's 4-bit
weights into int8 blocks, the handoff moves those blocks with their scales as they are, the decode
worker continues on the same weights, and greedy tokens of concurrent requests equal a single
engine's with the same quantization; every block is released."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig, default_model_file, resolve_model
from cluster.engine.engine import LLMEngine
from cluster.launch.app import ClusterConfig
from cluster.types import SamplingParams
from cluster_harness import ClusterThread
from router.client import Client
from router.router import RouterConfig

MAX_TOKENS = 12
# Prompts of several KV blocks (16 tokens each) that share no first block, so that each crosses
# the handoff (a prompt mostly cached on the decode worker is prefilled there).
CONTEXT = (" Answer briefly and plainly, in English, without lists, and say so when you do not know the "
           "answer to a question. You are a helpful assistant.")
QUESTIONS = [q + CONTEXT for q in ("What is the capital of France?", "Name three colours of the rainbow.",
                                   "Write one sentence about the sea and the wind.")]


@pytest.fixture(scope="module")
def engine_config():
    try:
        model = resolve_model(default_model_file())
    except FileNotFoundError as exc:      # CI installs it (.ci/run)
        pytest.fail(str(exc))
    return EngineConfig(model=model, dtype="float32", quantization="gguf", num_threads=1,
                        cache=CacheConfig(num_blocks=256, kv_cache_dtype="int8"))


def test_greedy_through_quantized_prefill_and_decode_workers(engine_config):
    single = LLMEngine(engine_config)
    prompts = [single.tokenizer.encode(q).ids for q in QUESTIONS]
    want = [list(o.token_ids) for o in single.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
    del single
    served = ClusterThread(ClusterConfig(http_port=None, engine=engine_config, data_plane=DataPlaneConfig(transport="tcp"),
                                         port=0, router=RouterConfig(local_prefill_max_tokens=4), max_tokens_limit=64))
    try:
        client = Client(served.target)
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS), prompts))
        assert [list(o.token_ids) for o in outs] == want
        stats = served.wait_idle()
        decode = next(s for s in stats if s.role == "decode")
        assert decode.handoff.done >= len(prompts) and decode.handoff.failed == 0, decode
    finally:
        served.stop()
