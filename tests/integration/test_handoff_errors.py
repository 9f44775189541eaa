"""A handoff's error paths with the real worker classes in one process (no Ray; the loopback
transport): a full decode worker declines at once and the producer's pins go with it; a handoff
that fails between the pull and the batch frees its blocks; errors are typed by whose fault. And
its forks: every sample continues from the first token its handle carries."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from loopback_pair import connect, loopback_pair

from cluster.errors import RequestError, WorkerBusy
from cluster.token_stream import TokenReceiver
from cluster.types import Fork, KVHandle, SamplingParams
from cluster.worker_messages import DecodeCall, GenerateCall, PrefillCall


@pytest.fixture
def pair(tiny_model_dir):
    with loopback_pair(tiny_model_dir("llama"), block_size=4) as workers:
        yield workers


async def _connect(prefill, decode) -> TokenReceiver:
    receiver = await connect(prefill, decode)
    assert await decode.add_peer(prefill.metadata())          # the same metadata again: a no-op
    return receiver


async def _released(prefill, timeout=2.0) -> bool:
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        if prefill.stats().leases == 0 and prefill.stats().blocks_used == 0:
            return True
        await asyncio.sleep(0.01)
    return False


PROMPT = list(range(5, 45))
SAMPLING = SamplingParams(max_tokens=6, ignore_eos=True)


def test_a_full_decode_worker_declines_at_once_and_the_producer_releases(pair):
    prefill, decode = pair

    async def go():
        receiver = await _connect(prefill, decode)
        try:
            held = await decode.loop.acall(lambda e: e.pool.allocate(e.pool.num_blocks))   # a full pool
            result = await prefill.prefill(PrefillCall("r1", PROMPT, SAMPLING))
            assert prefill.stats().leases == 1
            key, _ = receiver.open("r1")
            with pytest.raises(WorkerBusy, match="no room for a 10-block handoff"):
                await decode.decode(DecodeCall("r1", PROMPT, SAMPLING, result.handle, receiver.address, key))
            # Told at once: the pins go long before the 30 s lease would have run out.
            assert await _released(prefill), prefill.stats()
            assert decode.stats().handoff.declined == 1 and decode.stats().handoff.failed == 0
            await decode.loop.acall(lambda e: e.pool.free(reversed(held)))
            await decode.loop.acall(lambda e: e.pool.check_idle())
        finally:
            await receiver.stop()
    asyncio.run(go())


def test_a_handoff_that_fails_between_pull_and_batch_frees_its_blocks(pair, monkeypatch):
    prefill, decode = pair

    def refuse(*args, **kwargs):
        raise ValueError("this engine cannot continue that request")
    monkeypatch.setattr("decode.handoff.add_prefilled", refuse)

    async def go():
        receiver = await _connect(prefill, decode)
        try:
            result = await prefill.prefill(PrefillCall("r2", PROMPT, SAMPLING))
            key, _ = receiver.open("r2")
            with pytest.raises(RequestError, match="cannot continue"):
                await decode.decode(DecodeCall("r2", PROMPT, SAMPLING, result.handle, receiver.address, key))
            await decode.loop.acall(lambda e: e.pool.check_idle())
            assert await _released(prefill)
        finally:
            await receiver.stop()
    asyncio.run(go())


def test_a_bad_request_is_typed_as_the_requests_fault(pair):
    prefill, decode = pair

    async def go():
        receiver = await _connect(prefill, decode)
        try:
            key, _ = receiver.open("r3")
            with pytest.raises(RequestError, match="token ids must be in"):
                await decode.generate(GenerateCall("r3", [1, 10_000], SAMPLING, receiver.address, key))
            with pytest.raises(RequestError, match="token ids must be in"):
                await prefill.prefill(PrefillCall("r4", [1, 10_000], SAMPLING))
            assert decode.stats().ready is False            # not handshaken by a driver: no work for it yet
        finally:
            await receiver.stop()
    asyncio.run(go())


async def _samples(receiver, start) -> dict[str, list[int]]:
    """Run `start(key, forks)` for "r5" and its fork, reading both streams to their ends."""
    key, queue = receiver.open("r5")
    fork_key, _ = receiver.open("r5-f", queue)
    call = asyncio.ensure_future(start(key, (replace(FORK, stream_key=fork_key),)))
    tokens: dict[str, list[int]] = {"r5": [], "r5-f": []}
    running = 2
    while running:
        for d in await queue.take():
            if isinstance(d, BaseException):
                raise d
            tokens[d.request_id].extend(d.token_ids)
            running -= d.finish_reason is not None
    await call
    receiver.close_key(key)
    receiver.close_key(fork_key)
    return tokens


FORK = Fork("r5-f", SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=4))


def test_every_sample_continues_from_the_first_token_its_handle_carries(pair):
    """n = 2 across the handoff: the handle carries both samples' first tokens (the one place they
    travel), and the decode worker's tokens equal the same request computed on one engine."""
    prefill, decode = pair

    async def go():
        receiver = await _connect(prefill, decode)
        try:
            result = await prefill.prefill(PrefillCall("r5", PROMPT, SAMPLING, (FORK,)))
            firsts = {rid: d.token_ids[0] for rid, d in result.first_deltas(("r5-f",)).items()}
            assert KVHandle.decode(result.handle).first_tokens() == firsts
            handed = await _samples(receiver, lambda key, forks: decode.decode(
                DecodeCall("r5", PROMPT, SAMPLING, result.handle, receiver.address, key, forks=forks)))
            assert decode.stats().handoff.done == 1 and decode.stats().handoff.failed == 0
            handed = {rid: [firsts[rid], *tokens] for rid, tokens in handed.items()}
            one_engine = await _samples(receiver, lambda key, forks: decode.generate(
                GenerateCall("r5", PROMPT, SAMPLING, receiver.address, key, forks=forks)))
            assert handed == one_engine and len(one_engine["r5"]) == 6 and len(one_engine["r5-f"]) == 5
            assert await _released(prefill)
            await decode.loop.acall(lambda e: e.pool.check_idle())
        finally:
            await receiver.stop()
    asyncio.run(go())
