"""The router's one decode path, against fake workers (no Ray, no engine): the typed calls it
sends, a group of samples that fails over member by member from the tokens each has streamed, a
busy worker's decline continued elsewhere, and a handoff continued into every sample."""
from __future__ import annotations

import asyncio
import time

from cluster.errors import WorkerBusy
from cluster.token_stream import StepRecord, TokenReceiver
from cluster.types import FinishReason, ForkFirst, GenerateRequest, KVHandle, SamplingParams, TokenDelta
from cluster.worker_messages import DecodeCall, GenerateCall, PrefillResult, StatsSource, WorkerStats
from router.policy import make_policy
from router.router import Router, RouterConfig
from router.worker_pool import WorkerPool

PROMPT = tuple(range(1, 9))


class FakeDecode:
    """Streams token 100 + position for every member of a call, position counted from the original
    prompt (so a resumed attempt continues the sequence); `script` says how each call goes."""

    def __init__(self, receiver: TokenReceiver, script: list[str]):
        self.receiver, self.script, self.calls = receiver, script, []

    def generate(self, call):
        self.calls.append(call)
        return asyncio.ensure_future(self._run(call, self.script.pop(0)))

    decode = generate

    async def abort(self, request_id: str) -> None:
        pass

    async def _run(self, call, how: str):
        await asyncio.sleep(0)
        if how == "busy":
            raise WorkerBusy("no room")
        start = len(call.prompt_ids) - len(PROMPT) + (1 if isinstance(call, DecodeCall) else 0)
        members = [(call.key, call.sampling), *((f.stream_key, f.sampling) for f in call.forks)]
        left = call.sampling.max_tokens - (1 if isinstance(call, DecodeCall) else 0)
        for i in range(left):
            if how == "fail" and i == 1:
                raise RuntimeError("the worker crashed")
            for key, _ in members:
                end = FinishReason.LENGTH if i == left - 1 else None
                self.receiver.deliver((StepRecord(key, (100 + start + i,), "t", end, (), len(PROMPT), i + 1, 0, ()),))
            await asyncio.sleep(0)
        return FinishReason.LENGTH


def _handle(call) -> bytes:
    """What a prefill worker publishes: the handle carries every sample's first token."""
    return KVHandle(call.request_id, "p0", "lease", (0,), len(PROMPT), 100, "layout",
                    forks=tuple(ForkFirst(f.request_id, 100) for f in call.forks)).encode()


class FakePrefill:
    def __init__(self):
        self.calls = []

    async def prefill(self, call):
        self.calls.append(call)
        forks = tuple(TokenDelta(f.request_id, (100,), "t", None, (), len(PROMPT), 1, 0) for f in call.forks)
        first = TokenDelta(call.request_id, (100,), "t", None, (), len(PROMPT), 1, 0)
        return PrefillResult(call.request_id, first, _handle(call), forks=forks)

    async def abort(self, request_id: str) -> None:
        pass


def _stats(name: str, role: str) -> WorkerStats:
    return WorkerStats(name=name, role=role, incarnation="i", ready=True, blocks_free=32, blocks_total=32)


async def _run(script: list[str], n: int = 1, colocated: bool = True):
    receiver = TokenReceiver("f")
    await receiver.start()
    decode = FakeDecode(receiver, script)
    prefill = FakePrefill()
    config = RouterConfig(colocated=colocated, local_prefill_max_tokens=0, block_size=4)
    router = Router(config, WorkerPool(config, make_policy("round_robin"), {} if colocated else {"p0": prefill},
                                       {"d0": decode, "d1": decode}), receiver)
    for name, role in (("d0", "decode"), ("d1", "decode"), *(() if colocated else (("p0", "prefill"),))):
        router.workers.observe(_stats(name, role), StatsSource.POLL, time.monotonic())
    sp = SamplingParams(max_tokens=4)
    req = GenerateRequest("r", PROMPT, sp)
    forks = tuple(GenerateRequest(f"f{i}", PROMPT, SamplingParams(max_tokens=4, seed=i)) for i in range(1, n))
    out: dict[str, list[int]] = {}
    async for d in router.generate(req, forks):
        out.setdefault(d.request_id, []).extend(d.token_ids)
    assert receiver.queues == {} and router.active == {} and router.in_flight == 0
    await receiver.stop()
    return out, decode.calls, prefill.calls, router


def test_a_group_that_fails_over_continues_each_sample_alone_from_its_own_tokens():
    out, calls, _, router = asyncio.run(_run(["fail", "ok", "ok", "ok"], n=3))
    assert out == {rid: [100, 101, 102, 103] for rid in ("r", "f1", "f2")}
    first, *resumed = calls
    assert isinstance(first, GenerateCall) and [f.request_id for f in first.forks] == ["f1", "f2"]
    assert all(f.stream_key is not None for f in first.forks)
    assert sorted(c.request_id for c in resumed) == ["f1", "f2", "r"]
    for c in resumed:      # the prompt plus the token it streamed; its generator skips that draw
        assert isinstance(c, GenerateCall) and c.forks == () and c.resume_samples == 1
        assert c.prompt_ids == (*PROMPT, 100) and c.sampling.max_tokens == 3
    assert router.recoveries == 1 and router.busy_retries == 0


def test_a_busy_decode_worker_is_retried_elsewhere():
    out, calls, _, router = asyncio.run(_run(["busy", "ok"]))
    assert out == {"r": [100, 101, 102, 103]}
    assert [c.resume_samples for c in calls] == [0, 0]
    assert router.busy_retries == 1 and router.recoveries == 0


def test_a_handoff_continues_into_every_sample_with_its_first_token():
    out, calls, prefills, router = asyncio.run(_run(["ok"], n=2, colocated=False))
    assert out == {"r": [100, 101, 102, 103], "f1": [100, 101, 102, 103]}
    assert [f.request_id for f in prefills[0].forks] == ["f1"]
    (call,) = calls
    assert isinstance(call, DecodeCall) and call.handle == _handle(prefills[0])   # the prefill's handle, as is
    assert KVHandle.decode(call.handle).first_tokens() == {"r": 100, "f1": 100}
    assert [f.request_id for f in call.forks] == ["f1"]
