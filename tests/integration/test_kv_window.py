"""Attention sinks with a window (cluster/kv/window.py): a windowed sequence's greedy tokens equal
transformers' under the same sink + window mask, whatever the chunking and the prefix cache do;
its blocks in use stay bounded while it generates past the window and the context; the pool ends
where it started; with the window off nothing changes."""
from __future__ import annotations

import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.kv.window import KVWindow
from cluster.types import FinishReason, SamplingParams

BS, WINDOW, SINKS = 4, 12, 3     # sinks: one block of 4; the window: 12 to 15 tokens
MAX_TOKENS = 40


def _engine(model_dir, budget=2048, **cache) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model_dir, dtype="float32", cache=CacheConfig(block_size=BS, num_blocks=64, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def _reference(model, prompt: list[int], max_tokens: int, window: KVWindow) -> list[int]:
    """Greedy decoding by full recomputation under the window's mask (each token's mask depends on
    its own position only, so this is what an incremental cache with the mask computes)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        pos = torch.arange(len(ids))
        allowed = window.mask(pos[:, None], pos[None, :])
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
        with torch.no_grad():
            logits = model(torch.tensor([ids]), attention_mask=mask, position_ids=pos[None]).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    import transformers
    path = tiny_model_dir("llama")
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 30)]   # within and past the window


def test_windowed_tokens_equal_the_masked_reference(llama):
    """Per request (the server has no window): a short prompt generating past the window, a long
    one prefilled in chunks whose queries each see their own window, then both again from the
    prefix cache (the window's own keys). Full attention on the same engine still matches plain
    transformers (the window off changes nothing)."""
    path, model = llama
    window = KVWindow(WINDOW, SINKS, BS)
    engine = _engine(path, budget=7)    # chunks of 7 tokens: the window slides inside a chunk
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, kv_window=WINDOW, kv_sink_tokens=SINKS)
    prompts = _prompts()
    want = [_reference(model, p, MAX_TOKENS, window) for p in prompts]
    for _ in range(2):    # the second pass hits the prefix cache
        outs = engine.generate(prompts, sp)
        assert [list(o.token_ids) for o in outs] == want
        engine.pool.check_idle()
    assert outs[1].num_cached_tokens > 0
    full = engine.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    ref = model.generate(torch.tensor([prompts[0]]), max_new_tokens=MAX_TOKENS, do_sample=False,
                         eos_token_id=None)[0, len(prompts[0]):].tolist()
    assert list(full[0].token_ids) == ref
    assert ref != want[0]   # the window does change what this model attends
    engine.pool.check_idle()


def test_blocks_stay_bounded_past_the_window_and_the_context(tiny_model_dir):
    """The server's window (--kv-window): 300 tokens past a model's 256 positions (its context),
    never more blocks than the sinks' and those a window of 12 to 15 tokens spans."""
    engine = _engine(tiny_model_dir("llama"), kv_window=WINDOW, kv_sink_tokens=SINKS, kv_window_max_positions=512)
    engine.add_request(list(range(5, 20)), SamplingParams(max_tokens=300, ignore_eos=True), request_id="long")
    bound = 1 + -(-(WINDOW + BS - 1) // BS)
    most, tokens, reason = 0, 0, None
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += len(delta.token_ids)
            reason = delta.finish_reason or reason
        most = max(most, engine.pool.num_used)
    assert (tokens, reason) == (300, FinishReason.LENGTH)
    assert most <= bound, (most, bound)
    engine.pool.check_idle()


def test_windowed_requests_refused_where_unsupported(tiny_model_dir):
    engine = _engine(tiny_model_dir("mistral"))
    with pytest.raises(ValueError, match="kv_window is not supported with a model with sliding-window layers"):
        engine.add_request([5, 6, 7], SamplingParams(kv_window=8))
