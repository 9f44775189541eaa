"""The one-call handoff against fake workers (no Ray, no engine): the router's one call on the
prefill worker, which streams the first token and starts the named decode worker itself, and every
way it can fail: the decode worker declines or dies (the router continues from what streamed, as
from its own call), the prefill worker dies before its first token (the next one takes it) or after
handing on (the decode is aborted and the request continues elsewhere)."""
from __future__ import annotations

import asyncio
import time

from cluster.errors import WorkerBusy
from cluster.token_stream import StepRecord, TokenReceiver
from cluster.types import (
    FinishReason,
    ForkFirst,
    GenerateRequest,
    KVHandle,
    SamplingParams,
    TokenDelta,
)
from cluster.worker_messages import (
    DecodeCall,
    GenerateCall,
    PrefillResult,
    StatsSource,
    WorkerStats,
)
from router.policy import make_policy
from router.router import Router, RouterConfig
from router.worker_pool import WorkerPool

PROMPT = tuple(range(1, 9))


class FakeDecode:
    """Streams token 100 + position for every member (a resumed attempt continues the sequence);
    `script` says how each call goes; `aborted` records aborts."""

    def __init__(self, receiver: TokenReceiver, script: list[str]):
        self.receiver, self.script, self.calls, self.aborted = receiver, script, [], []

    def generate(self, call):
        self.calls.append(call)
        return asyncio.ensure_future(self._run(call, self.script.pop(0)))

    decode = generate

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def _run(self, call, how: str):
        await asyncio.sleep(0)
        if how == "busy":
            raise WorkerBusy("no room")
        start = len(call.prompt_ids) - len(PROMPT) + (1 if isinstance(call, DecodeCall) else 0)
        keys = [call.key, *(f.stream_key for f in call.forks)]
        left = call.sampling.max_tokens - (1 if isinstance(call, DecodeCall) else 0)
        for i in range(left):
            if how == "fail" and i == 1:
                raise RuntimeError("the worker crashed")
            for key in keys:
                end = FinishReason.LENGTH if i == left - 1 else None
                self.receiver.deliver((StepRecord(key, (100 + start + i,), "t", end, (), len(PROMPT), i + 1, 0, ()),))
            await asyncio.sleep(0)
        return FinishReason.LENGTH


class HandingOnPrefill:
    """As `PrefillWorker.prefill` with a `HandOn`: every member's first token (100) over the token
    stream, then the named decode worker's `decode` started here, its error in the answer.
    `script`: ok, busy (declines before a token), die_before, die_after (after its first token
    streamed, its decode call lost with it)."""

    def __init__(self, receiver: TokenReceiver, decodes: dict, script: list[str]):
        self.receiver, self.decodes, self.script, self.calls = receiver, decodes, script, []

    async def prefill(self, call):
        self.calls.append(call)
        how = self.script.pop(0)
        if how == "busy":
            raise WorkerBusy("full")
        if how == "die_before":
            raise RuntimeError("the prefill worker crashed")
        for key in (call.hand_on.key, *(f.stream_key for f in call.forks)):
            self.receiver.deliver((StepRecord(key, (100,), "t", None, (), len(PROMPT), 1, 3, ()),))
        handle = KVHandle(call.request_id, "p", "lease", (0,), len(PROMPT), 100, "layout",
                          forks=tuple(ForkFirst(f.request_id, 100) for f in call.forks)).encode()
        decode = DecodeCall(call.request_id, call.prompt_ids, call.sampling, handle, call.hand_on.sink,
                            call.hand_on.key, forks=call.forks)
        first = TokenDelta(call.request_id, (100,), "t", None, (), len(PROMPT), 1, 3)
        if how == "die_after":              # its first token reached the client, its decode call was lost
            await asyncio.sleep(0.01)
            raise RuntimeError("the prefill worker crashed after handing on")
        ref = self.decodes[call.hand_on.decode_name].decode(decode)
        try:
            await ref
        except Exception as exc:  # noqa: BLE001 - the answer carries it
            return PrefillResult(call.request_id, first, handle, streamed=True, handed_on=True, decode_error=exc)
        return PrefillResult(call.request_id, first, handle, streamed=True, handed_on=True)

    async def abort(self, request_id: str) -> None:
        pass


def _stats(name: str, role: str) -> WorkerStats:
    return WorkerStats(name=name, role=role, incarnation="i", ready=True, blocks_free=32, blocks_total=32)


async def _run(decode_script: list[str], prefill_scripts: list[list[str]], n: int = 1):
    receiver = TokenReceiver("f")
    await receiver.start()
    decode = FakeDecode(receiver, decode_script)
    decodes = {"d0": decode, "d1": decode}
    prefills = {f"p{i}": HandingOnPrefill(receiver, decodes, s) for i, s in enumerate(prefill_scripts)}
    config = RouterConfig(local_prefill_max_tokens=0, block_size=4)
    router = Router(config, WorkerPool(config, make_policy("round_robin"), prefills, decodes), receiver)
    for name in (*decodes, *prefills):
        router.workers.observe(_stats(name, "decode" if name in decodes else "prefill"), StatsSource.POLL,
                               time.monotonic())
    req = GenerateRequest("r", PROMPT, SamplingParams(max_tokens=4))
    forks = tuple(GenerateRequest(f"f{i}", PROMPT, SamplingParams(max_tokens=4, seed=i)) for i in range(1, n))
    out: dict[str, list[int]] = {}
    async for d in router.generate(req, forks):
        out.setdefault(d.request_id, []).extend(d.token_ids)
        if d.finished:
            out.setdefault("cached", []).append(d.num_cached_tokens)
    assert receiver.queues == {} and router.active == {} and router.in_flight == 0
    await receiver.stop()
    return out, decode, prefills, router


def test_a_handoff_is_one_call_from_the_router_and_the_prefill_worker_starts_the_decode():
    out, decode, prefills, router = asyncio.run(_run(["ok"], [["ok"]], n=2))
    assert out == {"r": [100, 101, 102, 103], "f1": [100, 101, 102, 103], "cached": [3, 3]}   # the prefill's hits
    assert router.worker_calls == 1
    (call,) = prefills["p0"].calls
    assert call.hand_on is not None and call.hand_on.decode_name in ("d0", "d1")
    assert [f.request_id for f in call.forks] == ["f1"] and all(f.stream_key is not None for f in call.forks)
    (dcall,) = decode.calls
    assert isinstance(dcall, DecodeCall) and dcall.key == call.hand_on.key


def test_a_decode_worker_that_declines_is_continued_elsewhere_from_the_first_token():
    out, decode, _, router = asyncio.run(_run(["busy", "ok"], [["ok"]]))
    assert out["r"] == [100, 101, 102, 103] and router.busy_retries == 1 and router.recoveries == 0
    resumed = decode.calls[1]
    assert isinstance(resumed, GenerateCall) and resumed.prompt_ids == (*PROMPT, 100) and resumed.resume_samples == 1


def test_a_decode_worker_that_fails_mid_stream_is_recovered_from_what_streamed():
    out, decode, _, router = asyncio.run(_run(["fail", "ok", "ok"], [["ok"]], n=2))
    assert out["r"] == out["f1"] == [100, 101, 102, 103] and router.recoveries == 1
    assert sorted(c.prompt_ids for c in decode.calls[1:]) == [(*PROMPT, 100, 101)] * 2


def test_a_prefill_worker_that_fails_before_its_first_token_is_replaced_by_the_next():
    out, decode, prefills, router = asyncio.run(_run(["ok"], [["die_before"], ["ok"]]))
    assert out["r"] == [100, 101, 102, 103]
    assert len(prefills["p0"].calls) == len(prefills["p1"].calls) == 1 and isinstance(decode.calls[0], DecodeCall)
    assert decode.aborted == ["r"]     # it may have handed on: aborted there before the retry


def test_a_busy_prefill_worker_and_no_other_leaves_the_prompt_to_the_decode_worker():
    out, decode, _, _ = asyncio.run(_run(["ok"], [["busy"]]))
    assert out["r"] == [100, 101, 102, 103] and isinstance(decode.calls[0], GenerateCall)
    assert decode.aborted == []


def test_a_prefill_worker_that_dies_after_handing_on_costs_latency_not_the_request():
    out, decode, _, router = asyncio.run(_run(["ok"], [["die_after"]]))
    assert out["r"] == [100, 101, 102, 103] and router.recoveries == 1
    assert decode.aborted == ["r"]
    (resumed,) = decode.calls
    assert isinstance(resumed, GenerateCall) and resumed.prompt_ids == (*PROMPT, 100) and resumed.resume_samples == 1
