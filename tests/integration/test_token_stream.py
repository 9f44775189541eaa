"""The token data plane in one process: a real engine on its loop thread sending step frames over
real TCP on 127.0.0.1 to a real `TokenReceiver`; no Ray."""
from __future__ import annotations

import asyncio
import socket
import struct
import threading

import msgpack
import pytest
import torch

from cluster.config import CacheConfig, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.engine_loop import EngineLoop
from cluster.token_stream import StreamBroken, TokenReceiver, TokenSender
from cluster.types import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir("llama"), dtype="float32",
                                  cache=CacheConfig(block_size=4, num_blocks=128)))


def _prompts(n):
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, 384, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


async def _serve(loop_: EngineLoop, receiver: TokenReceiver, prompts, sampling):
    """Run every prompt as a stream; returns each stream's messages (lists of deltas)."""
    async def one(i, prompt):
        key, q = receiver.open(f"r{i}")
        call = asyncio.ensure_future(loop_.run(f"r{i}", lambda e: e.add_request(prompt, sampling, f"r{i}"),
                                               receiver.address, key))
        msgs = []
        while not msgs or msgs[-1][-1].finish_reason is None:
            msgs.append(await q.take())
        await call
        receiver.close_key(key)
        return msgs
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.mark.parametrize("interval", [1, 3])
def test_step_frames_carry_every_token_in_order(engine, interval):
    prompts = _prompts(6)
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = [list(c.token_ids) for c in engine.generate(prompts, sampling)]
    loop_ = EngineLoop(engine, sender=TokenSender("w"), stream_interval=interval)

    async def main():
        receiver = TokenReceiver("f")
        await receiver.start()
        try:
            return await _serve(loop_, receiver, prompts, sampling)
        finally:
            await receiver.stop()
    try:
        outs = asyncio.run(main())
    finally:
        loop_.close()
    for msgs, want in zip(outs, ref):
        deltas = [d for m in msgs for d in m]
        assert [t for d in deltas for t in d.token_ids] == want
        sizes = [len(d.token_ids) for d in deltas]
        assert sizes[0] == 1                                   # the first token never waits
        if interval > 1:
            assert all(s >= interval for s in sizes[1:-1]) and len(sizes) < len(want)
    assert engine.pool.num_used == 0


def test_a_frontend_that_vanishes_fails_its_streams_and_frees_blocks(engine):
    loop_ = EngineLoop(engine, sender=TokenSender("w"))

    async def main():
        receiver = TokenReceiver("f")
        address = await receiver.start()
        key, q = receiver.open("gone")
        call = asyncio.ensure_future(loop_.run("gone", lambda e: e.add_request(
            _prompts(1)[0], SamplingParams(max_tokens=200, ignore_eos=True), "gone"), address, key))
        await q.take()
        await receiver.stop()                    # the listener goes, and its connections with it
        with pytest.raises(StreamBroken):
            await asyncio.wait_for(call, 30)
    try:
        asyncio.run(main())
        assert loop_.call(lambda e: e.pool.num_used).result(10) == 0
    finally:
        loop_.close()


def test_a_peer_without_the_secret_is_cut_off_before_any_record(engine):
    async def main():
        receiver = TokenReceiver("f")
        address = await receiver.start()
        key, q = receiver.open("x")

        def intrude():
            s = socket.create_connection((address.host, address.port))
            for body in ([1, "hello", "evil", b"wrong-secret"],
                         [1, "step", [[key, [1], "a", FinishReason.STOP.value, None, 1, 1, 0]]]):
                data = msgpack.packb(body, use_bin_type=True)
                s.sendall(struct.pack(">I", len(data)) + data)
            s.settimeout(5)
            closed = s.recv(1) == b""
            s.close()
            return closed
        closed = await asyncio.get_running_loop().run_in_executor(None, intrude)
        await receiver.stop()
        return closed, list(q.items)
    closed, items = asyncio.run(main())
    assert closed and items == []


def test_a_loop_whose_work_waits_for_blocks_held_elsewhere_sleeps_instead_of_spinning(engine):
    """A request that cannot be admitted because blocks are held outside the scheduler (pulls in
    flight) makes every step idle: the thread sleeps until something changes, then serves it."""
    import asyncio
    import time
    steps = [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()
    engine.step = counted
    loop_ = EngineLoop(engine, sender=TokenSender("w"))
    try:
        held = loop_.call(lambda e: e.pool.allocate(e.pool.num_blocks)).result(5)   # as pulls in flight do

        async def run():
            return await loop_.run("r", lambda e: e.add_request(_prompts(1)[0], SamplingParams(max_tokens=3), "r"))
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("last", asyncio.run(run())))
        t.start()
        time.sleep(0.5)
        idle_steps = steps[0]
        loop_.call(lambda e: e.pool.free(reversed(held))).result(5)            # the pulls end
        t.join(10)
    finally:
        loop_.close()
        engine.step = step
    assert idle_steps <= 3, f"{idle_steps} engine steps in 0.5 s while waiting for blocks"
    assert result["last"].finish_reason is FinishReason.LENGTH and result["last"].num_output_tokens == 3
    engine.pool.check_idle()
