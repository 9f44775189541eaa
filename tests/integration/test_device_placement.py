"""What a request draws its randomness from lives on the engine's device: a CPU generator cannot
draw on CUDA tensors (the sampler's noise, speculative acceptance), and a draw made on a CPU
tensor does not advance a CUDA generator (the skipped draws of a handed-off or failed-over
request). The CUDA cases run in the GPU check; on CPU the placement itself is checked."""
import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from decode.handoff import add_prefilled
from decode.spec.speculator import _one_hot, make_speculator

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _engine(model, device, spec="ngram") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", device=device, cache=CacheConfig(num_blocks=64),
                                  speculative=SpeculativeConfig(method=spec, num_speculative_tokens=3)),
                     speculator_factory=make_speculator)


@pytest.mark.parametrize("device", DEVICES)
def test_generators_and_proposals_live_on_the_engine_device(device, tiny_model_dir):
    engine = _engine(tiny_model_dir("llama"), device)
    want = torch.device(device).type
    seeded = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.8, seed=3))
    unseeded = engine.add_request([5, 6, 8], SamplingParams(max_tokens=4, temperature=0.8))
    add_prefilled(engine, "handed-off", [5, 6, 9], 11, SamplingParams(max_tokens=4, temperature=0.8, seed=3),
                  engine.pool.allocate(1))
    for rid in (seeded, unseeded, "handed-off"):
        assert engine.requests.seqs[rid].generator.device.type == want   # noqa: SLF001
    assert _one_hot((1, 2), 8, engine.device).device.type == want
    while engine.has_unfinished():
        engine.step()
    engine.pool.check_idle()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_with_speculation_runs_and_repeats(device, tiny_model_dir):
    """Sampled requests, plain and with n-gram speculation, on the device: they run, and the same
    seed gives the same tokens again."""
    engine = _engine(tiny_model_dir("llama"), device)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    runs = []
    for _ in range(2):
        outs = engine.generate([prompt, prompt], [
            SamplingParams(max_tokens=12, temperature=0.9, seed=11, speculative="off"),
            SamplingParams(max_tokens=12, temperature=0.9, seed=11, speculative="ngram")])
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1]
    assert all(len(t) == 12 for t in runs[0])
    engine.pool.check_idle()
