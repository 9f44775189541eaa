"""End to end: an engine on the Triton backend (interpreted) serves a quantized KV cache
(`--kv-cache-dtype int8`) and generates the same greedy tokens as the engine on the torch backend
over prompts sharing a cached prefix; the block pool ends idle. Both backends attend every key as
stored, a fresh prompt's own keys included, so they compute the same attention up to fp32
summation order. fp8 rows differ only inside the kernels: tests/kernels/test_kv_quant_triton.py."""
from cluster.config import CacheConfig, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from integration.test_engine_exactness import _prompts


def test_triton_engine_serves_a_quantized_kv_cache(tiny_model_dir):
    prompts = _prompts(shared_prefix=8)[:3]
    tokens = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), dtype="float32", attention_backend=backend,
                                        cache=CacheConfig(block_size=4, num_blocks=128, kv_cache_dtype="int8")))
        assert engine.backend.name == backend
        outs = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        engine.pool.check_idle()
        tokens[backend] = [list(o.token_ids) for o in outs]
    assert tokens["triton"] == tokens["torch"]
