"""KV compaction of long prompts (cluster/engine/compaction.py, docs/kv_compress.md): a compacted
request's greedy tokens equal the measured prototype's (bench/kv_compaction_proto.py: transformers
with its own attention function, selecting independently of the serving path), prefilled in chunks
and again from the prefix cache; ratio 1 equals no compaction; the handoff moves the compacted
blocks only and the decode worker continues as one engine; refusals by name; pools end empty."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from loopback_pair import connect, loopback_pair

from cluster.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from cluster.engine.compaction import Compactor
from cluster.engine.engine import LLMEngine
from cluster.types import Fork, KVCompaction, KVHandle, SamplingParams
from cluster.worker_messages import DecodeCall, GenerateCall, PrefillCall

BS, MAX_TOKENS = 4, 12
SPEC = KVCompaction(ratio=4, recent=4, observe=6, sinks=1, pool=3)   # 40 tokens -> 10 entries, 4 exact
SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, kv_compaction=SPEC)
def _engine(model_dir, **cache) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model_dir, dtype="float32", cache=CacheConfig(block_size=BS, num_blocks=64, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=7)))    # chunks of 7: the observed queries span two


def _prompt() -> list[int]:
    return torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def _prototype_tokens(model_dir, prompt: list[int], generated: list[int], spec: KVCompaction) -> list[int]:
    """The prototype's greedy continuation, teacher-forced on `generated`: one pass of prompt +
    continuation in which the continuation attends each layer's compacted prompt (its own
    selection, and fit, from the prefill's queries and keys; values only, as served)."""
    import transformers
    from transformers import AttentionInterface

    from bench import kv_compaction_proto as proto
    AttentionInterface.register("kv_compaction_proto", proto.attention)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                              attn_implementation="kv_compaction_proto").eval()
    proto.STATE.update(method=spec.method, prompt=len(prompt), budget=spec.kept(len(prompt)), recent=spec.recent,
                       obs=spec.observe, pool=spec.pool, sinks=spec.sinks, keep_sinks=spec.sinks > 0, fit_bias=False)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:]
    return logits.argmax(-1).tolist()


def test_compacted_tokens_equal_the_prototype_and_ratio_one_equals_none(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine, prompt = _engine(path), _prompt()
    outs = [engine.generate([prompt], SAMPLING)[0] for _ in range(2)]   # the second from the prefix cache
    tokens = list(outs[0].token_ids)
    assert list(outs[1].token_ids) == tokens and outs[1].num_cached_tokens > 0
    assert engine.compactor.num_compacted == 2
    assert _prototype_tokens(path, prompt, tokens, SPEC) == tokens
    fit = replace(SPEC, method="fit", recent=8)     # values fitted to the last 8 queries' outputs
    fitted = list(engine.generate([prompt], replace(SAMPLING, kv_compaction=fit))[0].token_ids)
    assert _prototype_tokens(path, prompt, fitted, fit) == fitted
    full = list(engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids)
    assert full != tokens     # compaction does change what this model attends
    one = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, kv_compaction=KVCompaction(ratio=1, recent=4, observe=6))
    assert list(engine.generate([prompt], one)[0].token_ids) == full
    engine.pool.check_idle()
    # The server's default (--kv-compaction-ratio), and a request turning it off.
    server = _engine(path, kv_compaction_ratio=4.0)
    off = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, kv_compaction=KVCompaction(method="off"))
    assert list(server.generate([prompt], off)[0].token_ids) == full and server.compactor.num_compacted == 0
    server.generate([prompt], SamplingParams(max_tokens=2))
    assert server.compactor.num_compacted == 1
    server.pool.check_idle()


def test_compaction_needs_no_more_room_than_it_gives_back(tiny_model_dir):
    """A pool of 11 blocks: the 40-token prompt takes 10, and its compaction into 3 still runs
    (the kept rows are copied out before its blocks are freed), with the same tokens."""
    path = tiny_model_dir("llama")
    small = LLMEngine(EngineConfig(model=path, dtype="float32", cache=CacheConfig(block_size=BS, num_blocks=11),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=7)))
    out = small.generate([_prompt()], SAMPLING)[0]
    assert (small.compactor.num_compacted, small.compactor.num_skipped) == (1, 0)
    assert list(out.token_ids) == list(_engine(path).generate([_prompt()], SAMPLING)[0].token_ids)
    small.pool.check_idle()


def test_compaction_refused_where_unsupported(tiny_model_dir):
    engine = _engine(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="kv_compaction is not supported with kv_window"):
        engine.add_request(_prompt(), SamplingParams(kv_compaction=SPEC, kv_window=8))
    # (This engine has no speculator, so it refuses a speculative request before; one with one:)
    assert Compactor.refusal(SamplingParams(speculative="ngram"), None, False, 0).startswith("speculative decoding")
    with pytest.raises(ValueError, match="kv_compaction is not supported with n > 1"):
        engine.add_request(_prompt(), SAMPLING, forks=(Fork("f", SAMPLING),))
    assert not engine.has_unfinished()
    mistral = _engine(tiny_model_dir("mistral"))
    with pytest.raises(ValueError, match="kv_compaction is not supported with a model with sliding-window layers"):
        mistral.add_request(_prompt(), SAMPLING)
    gemma4 = _engine(tiny_model_dir("gemma4"))    # cross-layer KV sharing (and sliding layers)
    with pytest.raises(ValueError, match="kv_compaction is not supported with"):
        gemma4.add_request(_prompt(), SAMPLING)


@pytest.fixture
def pair(tiny_model_dir):
    with loopback_pair(tiny_model_dir("llama"), block_size=BS) as workers:
        yield workers


async def _tokens(receiver, rid: str, start) -> list[int]:
    key, queue = receiver.open(rid)
    call = asyncio.ensure_future(start(key))
    tokens, done = [], False
    while not done:
        for d in await queue.take():
            if isinstance(d, BaseException):
                raise d
            tokens.extend(d.token_ids)
            done = done or d.finish_reason is not None
    await call
    receiver.close_key(key)
    return tokens


def test_the_handoff_moves_the_compacted_blocks_only(pair):
    """The prefill worker compacts before the handoff: the handle names ceil(10 / 4) = 3 blocks
    (not the prompt's 10) and the offset of the 30 tokens left out; the decode worker continues
    on them exactly as one engine compacting the same request."""
    prefill, decode = pair
    prompt = _prompt()

    async def go():
        receiver = await connect(prefill, decode)
        try:
            result = await prefill.prefill(PrefillCall("c1", prompt, SAMPLING))
            handle = KVHandle.decode(result.handle)
            assert (len(handle.block_ids), handle.cache_offset, handle.num_tokens) == (3, 30, 40)
            first = result.first_deltas(())["c1"].token_ids[0]
            handed = await _tokens(receiver, "c1", lambda key: decode.decode(
                DecodeCall("c1", prompt, SAMPLING, result.handle, receiver.address, key)))
            stats = decode.stats().handoff
            per_block = await decode.loop.acall(lambda e: e.transfer_layout.bytes_per_block())
            assert (stats.done, stats.failed, stats.bytes) == (1, 0, 3 * per_block)
            one_engine = await _tokens(receiver, "c2", lambda key: decode.generate(
                GenerateCall("c2", prompt, SAMPLING, receiver.address, key)))
            assert [first, *handed] == one_engine and len(one_engine) == MAX_TOKENS
            await decode.loop.acall(lambda e: e.pool.check_idle())
            for _ in range(200):     # the producer ends the lease once the consumer's DONE arrives
                if prefill.stats().leases == 0 and prefill.stats().blocks_used == 0:
                    break
                await asyncio.sleep(0.01)
            assert (prefill.stats().leases, prefill.stats().blocks_used) == (0, 0)
        finally:
            await receiver.stop()
    asyncio.run(go())
