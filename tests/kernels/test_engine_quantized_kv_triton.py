"""End to end: an engine on the Triton backend (interpreted) serves a quantized KV cache
(`--kv-cache-dtype int8|fp8_e4m3`) and generates the same greedy tokens as the engine on the torch
backend over prompts sharing a cached prefix; the block pool ends idle.

The Triton kernels read every key through the cache, a fresh prompt's own keys included, so they
attend quantized K/V everywhere; the torch backend attends a fresh prompt's own unquantized K/V
(only cached prefixes are gathered). The reference here gathers for every prefill, so the two
engines compute the same attention and their tokens may be compared exactly."""
import pytest

from cluster.config import CacheConfig, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.model import attention
from cluster.types import SamplingParams
from integration.test_engine_exactness import _prompts


def _gather_every_prefill(self, span, block_size):
    slots = self._slots(span.block_table, span.context_len, block_size).to(self.device)
    return attention._TorchPrefillMeta(span=span, gather=slots, masks={})


@pytest.mark.parametrize("kv", ["int8"])   # fp8 differs only inside the kernels: test_kv_quant_triton.py
def test_triton_engine_serves_a_quantized_kv_cache(kv, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(attention.TorchAttentionBackend, "_prepare_prefill", _gather_every_prefill)
    prompts = _prompts(shared_prefix=8)[:3]
    tokens = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), dtype="float32", attention_backend=backend,
                                        cache=CacheConfig(block_size=4, num_blocks=128, kv_cache_dtype=kv)))
        assert engine.backend.name == backend
        outs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        engine.pool.check_idle()
        tokens[backend] = [list(o.token_ids) for o in outs]
    assert tokens["triton"] == tokens["torch"]
