"""The engine on CUDA against transformers on the same checkpoint (the GPU check runs these; they
skip without CUDA): greedy tokens equal in float32 for GQA, MQA and sliding-window models through
the Triton kernels and decode graphs; bf16 first-token logprobs within the tolerance the CPU tests
use (tests/integration/test_kernel_plans.py)."""
import pytest
import torch

from cluster.config import CacheConfig, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from integration.test_engine_exactness import KINDS, MAX_TOKENS, _prompts, hf_greedy  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("kind", KINDS)
def test_float32_greedy_equals_transformers_on_cuda(kind, tiny_model_dir, hf_greedy):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(kind), dtype="float32", device="cuda",
                                    cache=CacheConfig(num_blocks=256)))
    assert engine.backend.name == "triton" and engine.runner.graphs is not None
    prompts = _prompts()
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(kind, prompt), f"{kind}: prompt of {len(prompt)} tokens"
    engine.pool.check_idle()


def test_bfloat16_tracks_transformers_on_cuda(tiny_model_dir):
    import transformers
    model_dir = tiny_model_dir("llama")
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", device="cuda", cache=CacheConfig(num_blocks=64)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    for prompt in _prompts():
        out = engine.generate([prompt], SamplingParams(max_tokens=1, logprobs=5))[0]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float(), dim=-1)
        for token, logprob in out.logprobs[0].top:
            assert logprob == pytest.approx(float(ref[token]), abs=0.1)
    engine.pool.check_idle()
