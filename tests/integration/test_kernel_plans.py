"""Kernel plans: measured once per machine and cached, and every path a plan can choose computes
the model correctly (greedy tokens equal transformers in float32; bf16 log-probabilities track
transformers' bf16 for each linear layout)."""
from dataclasses import replace

import pytest
import torch

from cluster.config import CacheConfig, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.model.kernel_choice import resolve_kernel_plan
from cluster.model.kernel_plan import C_ROWS_ALL, ActPath, AttentionPath, BatchBuckets, KernelPlan, LinearPath, NormPath, RopePath
from cluster.model.linear import packing_available
from cluster.model.model_config import load_model_config
from cluster.types import SamplingParams
from kernels import cpu_ops

needs_c = pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler: fused CPU ops not built")
N = len(BatchBuckets().sizes)


def fused_plan(linear: LinearPath) -> KernelPlan:
    """Every op on the C kernels (prefill attention too, where it is built: AVX-512)."""
    prefill = AttentionPath.FUSED_C if cpu_ops.load() is not None and cpu_ops.has_prefill_attention() else AttentionPath.SDPA
    return KernelPlan(linear, (NormPath.FUSED_C,) * N, (RopePath.FUSED_C,) * N, (ActPath.FUSED_C,) * N,
                      AttentionPath.FUSED_C, prefill_attention=prefill)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 16, 33, 47)]


def test_buckets_and_plan_round_trip():
    b = BatchBuckets((1, 4, 16))
    assert [b.index(n) for n in (1, 2, 4, 5, 16, 99)] == [0, 1, 1, 2, 2, 2]
    assert [b.bucket(n) for n in (1, 3, 16, 99)] == [1, 4, 16, 99]
    with pytest.raises(ValueError):
        BatchBuckets((4, 2))
    plan = replace(fused_plan(LinearPath.PACKED), norm=(NormPath.FUSED_C,) * 3 + (NormPath.TORCH_OPS,) * (N - 3))
    assert KernelPlan.from_json(plan.to_json()) == plan
    assert "norm fused_c<=4, torch_ops" in plan.describe()
    with pytest.raises(ValueError):
        KernelPlan(LinearPath.PLAIN, (NormPath.FUSED_C,), (RopePath.TORCH,) * N, (ActPath.TORCH,) * N,
                   AttentionPath.SDPA)


def test_plan_is_measured_once_then_read_from_the_cache(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    threads_before = torch.get_num_threads()
    mc = load_model_config(tiny_model_dir("llama"))
    first = resolve_kernel_plan(mc, torch.float32, torch.device("cpu"), "auto", threads=1)
    assert first.origin == "measured" and len(list((tmp_path / "kernel_plans").glob("*.json"))) == 1
    again = resolve_kernel_plan(mc, torch.float32, torch.device("cpu"), "auto", threads=1)
    assert again.origin == "cached" and replace(again, origin="measured") == first
    # Another thread count is another machine setting: measured separately.
    resolve_kernel_plan(mc, torch.float32, torch.device("cpu"), "auto", threads=2)
    assert len(list((tmp_path / "kernel_plans").glob("*.json"))) == 2
    assert torch.get_num_threads() == threads_before    # measured with its own threads, then restored
    assert resolve_kernel_plan(mc, torch.float32, torch.device("cpu"), "torch").origin == "reference"


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir):
    import transformers
    cache = {}

    def ref(kind):
        if kind not in cache:
            model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(kind), dtype=torch.float32)
            cache[kind] = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                           for p in _prompts()]
        return cache[kind]
    return ref


@needs_c
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("plan", ["fused", "fused+packed", "reference"])
def test_float32_greedy_equals_transformers_on_every_path(kind, plan, tiny_model_dir, hf_greedy):
    """qwen2 has q/k/v biases (the C linear adds them), mistral a sliding window (the C attention
    honours it); 'fused' runs every linear of a decode step through the C kernel."""
    chosen = {"fused": replace(fused_plan(LinearPath.PLAIN), linear_c_rows=cpu_ops.LINEAR_MAX_ROWS),
              "fused+packed": fused_plan(LinearPath.PACKED),
              "reference": KernelPlan.reference(torch.float32)}[plan]
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(kind), dtype="float32", kernel_plan=chosen,
                                    cache=CacheConfig(block_size=4, num_blocks=128)))
    assert engine.kernel_plan == chosen
    out = engine.generate(_prompts(), SamplingParams(max_tokens=12))
    assert [list(c.token_ids) for c in out] == hf_greedy(kind)
    engine.pool.check_idle()


@needs_c
@pytest.mark.parametrize("linear", [LinearPath.PACKED, LinearPath.PLAIN, LinearPath.FP32_UPCAST, "plain+c", "fp32_upcast+c",
                                    "plain+c_all"])
def test_bfloat16_tracks_transformers_on_every_linear_path(linear, tiny_model_dir):
    import transformers
    model_dir = tiny_model_dir("llama")
    with_c = {"plain+c": (LinearPath.PLAIN, cpu_ops.LINEAR_MAX_ROWS),
              "fp32_upcast+c": (LinearPath.FP32_UPCAST, cpu_ops.LINEAR_MAX_ROWS),
              "plain+c_all": (LinearPath.PLAIN, C_ROWS_ALL)}    # the prompt's pass through the C kernel too
    plan = (replace(fused_plan(with_c[linear][0]), linear_c_rows=with_c[linear][1]) if linear in with_c
            else fused_plan(linear))
    config = EngineConfig(model=model_dir, dtype="bfloat16", kernel_plan=plan, cache=CacheConfig(num_blocks=32))
    if linear is LinearPath.PACKED and not packing_available(torch.bfloat16, torch.device("cpu")):
        # oneDNN packs bf16 only with AVX-512 (bw/vl/dq) or AVX-NE-CONVERT: a plan asking for it
        # elsewhere is refused by name, not left to crash inside oneDNN.
        with pytest.raises(ValueError, match="packed linear path needs oneDNN's bf16 packing"):
            LLMEngine(config)
        return
    engine = LLMEngine(config)
    weights = sum(b.numel() * b.element_size() for b in engine.model.buffers() if b.dim() == 2)
    if plan.linear is LinearPath.FP32_UPCAST:   # float32 copies of every projection: twice the bytes, counted
        assert weights >= 2 * sum(m.in_features * m.out_features * 2 for m in engine.model.modules()
                                  if hasattr(m, "in_features"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    for prompt in _prompts():
        out = engine.generate([prompt], SamplingParams(max_tokens=1, logprobs=5))[0]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        for token, logprob in out.logprobs[0].top:
            assert logprob == pytest.approx(float(ref[token]), abs=0.1)
    engine.pool.check_idle()


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_follows_the_cpus_bf16(native, tiny_model_dir, monkeypatch):
    """`--dtype auto` on CPU: bfloat16 where the CPU computes it natively, float32 elsewhere,
    whatever the (float32) checkpoint stores; an explicit dtype is kept as given."""
    from cluster.model.kernel_choice import plan_dtype, resolved_engine_config
    monkeypatch.setattr(cpu_ops, "native_bf16", lambda: native)
    want = torch.bfloat16 if native else torch.float32
    config = EngineConfig(model=tiny_model_dir("llama"), num_threads=1, cache=CacheConfig(num_blocks=16))
    assert load_model_config(config.model).dtype == torch.float32 and plan_dtype(config) == want
    assert resolved_engine_config(config, 1).dtype == str(want).removeprefix("torch.")
    assert LLMEngine(config).dtype == want
    assert plan_dtype(replace(config, dtype="float32")) == torch.float32


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu_ops, "cpu_signature", lambda: "AMD EPYC|fpu avx512f avx512_bf16 sse")
    assert cpu_ops.native_bf16()
    monkeypatch.setattr(cpu_ops, "cpu_signature", lambda: "Intel Xeon|fpu amx_bf16 amx_tile")
    assert cpu_ops.native_bf16()
    monkeypatch.setattr(cpu_ops, "cpu_signature", lambda: "AMD EPYC 7B13|fpu avx2 fma")
    assert not cpu_ops.native_bf16()
