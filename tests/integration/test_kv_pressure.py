"""A decode engine with a tiny KV pool, handed-off (P/D) requests and plain ones side by side.

The handoffs run in-process: a producer engine prefills with `hold_kv`, its blocks' tensors are
copied into blocks taken from the consumer's pool (what a pull does) and the consumer joins them
with `decode.handoff.add_prefilled`. Every request must end with exactly the single-engine greedy tokens, none cut
short, the loop must keep making progress, and the pools must end idle.
"""
from __future__ import annotations

import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.errors import WorkerBusy
from cluster.transfer.loopback import LoopbackTransport
from cluster.transfer.producer import KVProducer
from cluster.engine.sequence import Sequence
from cluster.types import FinishReason, KVHandle, SamplingParams, TokenDelta
from decode.handoff import add_prefilled
from prefill.handoff import PrefillHandoff, PrefillLease
from prefill.worker import PrefillWorker

BS = 4


def _engine(model_dir, num_blocks: int, budget: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_model_len=128, num_threads=1,
                                    cache=CacheConfig(block_size=BS, num_blocks=num_blocks),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=budget)),
                       hold_factory=PrefillHandoff)   # both sides of a handoff in one engine: it holds KV for consumers
    return engine


@pytest.fixture(scope="module")
def big(tiny_model_dir):
    """The producer of every handoff, and the single-engine reference."""
    return _engine(tiny_model_dir("llama"), 256, 64)


@pytest.fixture(scope="module")
def small(tiny_model_dir):
    """8 blocks of 4 tokens: one request of 30 tokens fills it."""
    return _engine(tiny_model_dir("llama"), 8, 8)


@pytest.fixture
def engines(big, small):
    for e in (big, small):
        e.pool.reset_prefix_cache()
    yield big, small
    leftovers = [(e.has_unfinished(), list(e.hold_hook.leases)) for e in (big, small)]
    for e in (big, small):   # clean up first, so that one failure does not leak into the next test
        for rid in list(e.requests.seqs):
            e.abort(rid)
        _steps_to_end(e)
        for rid in list(e.hold_hook.leases):
            e.hold_hook.release(rid)
    assert leftovers == [(False, [])] * 2
    for e in (big, small):
        e.pool.check_idle()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sp(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _greedy(big: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    return list(big.generate([prompt], _sp(max_tokens))[0].token_ids)


def _prefill(producer: LLMEngine, rid: str, prompt: list[int]) -> int:
    producer.add_request(prompt, _sp(1), rid, hold_kv=True)
    return next(d.token_ids[0] for d in _steps_to_end(producer) if d.request_id == rid and d.token_ids)


def _pull(producer: LLMEngine, consumer: LLMEngine, rid: str) -> list[int]:
    """What a KV pull does: local blocks from the consumer's pool, the producer's bytes copied in."""
    blocks, _ = producer.hold_hook.take(rid)
    local = consumer.pool.allocate(len(blocks))
    consumer.kv_cache.arena[:, :, local] = producer.kv_cache.arena[:, :, blocks]
    producer.hold_hook.release(rid)
    return local


def _handoff(producer, consumer, rid, prompt, max_tokens) -> int:
    first = _prefill(producer, rid, prompt)
    add_prefilled(consumer, rid, prompt, first, _sp(max_tokens), _pull(producer, consumer, rid))
    return first


class Driver:
    """Steps an engine, gathering each request's tokens and counting idle steps."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, FinishReason] = {}
        self.steps = 0
        self.idle_run = self.longest_idle_run = 0

    def step(self) -> list[TokenDelta]:
        deltas = self.engine.step()
        self.steps += 1
        self.idle_run = self.idle_run + 1 if self.engine.idle_step else 0
        self.longest_idle_run = max(self.longest_idle_run, self.idle_run)
        if self.engine.idle_step:
            assert not deltas
        for d in deltas:
            self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                assert d.request_id not in self.reasons, "two final deltas"
                self.reasons[d.request_id] = d.finish_reason
        return deltas

    def run(self, max_steps: int = 200) -> None:
        while self.engine.has_unfinished():
            assert self.steps < max_steps, "no progress"
            self.step()


def _check_exact(drv: Driver, expected: dict[str, list[int]], handed_off: dict[str, int]) -> None:
    for rid, want in expected.items():
        got = drv.tokens.get(rid, [])
        if rid in handed_off:   # the producer sampled the first token; the consumer streams the rest
            got = [handed_off[rid], *got]
        assert got == want, rid
        assert drv.reasons[rid] is FinishReason.LENGTH   # max_tokens reached: every output is full length


def test_handed_off_waiters_and_plain_requests_under_pressure_match_one_engine(engines):
    big, small = engines
    prompts = {"a": (_ids(10, 1), 20), "b": (_ids(8, 2), 6), "c": (_ids(12, 3), 6), "d": (_ids(6, 4), 8),
               "e": (_ids(9, 5), 5)}
    expected = {rid: _greedy(big, p, m) for rid, (p, m) in prompts.items()}
    discarded = small.kv_discarded
    drv = Driver(small)
    small.add_request(prompts["a"][0], _sp(20), "a")      # 30 tokens in the end: the whole pool
    seq_a = small.requests.seqs["a"]
    while seq_a.num_tokens < 13:                          # its next decode needs a 4th block
        drv.step()
    first = {rid: _handoff(big, small, rid, *prompts[rid]) for rid in ("b", "c")}   # the pool is full now
    assert small.pool.num_free == 0
    small.add_request(prompts["d"][0], _sp(8), "d")
    drv.step()
    assert "a" not in drv.reasons                         # not cut short by the waiters' blocks
    assert small.kv_discarded == discarded + 1            # the youngest handoff gave its blocks back
    while small.pool.num_free < 3:                       # a later pull, once its blocks are free
        assert drv.steps < 100
        drv.step()
    first["e"] = _handoff(big, small, "e", *prompts["e"])
    drv.run()
    _check_exact(drv, expected, first)
    assert drv.longest_idle_run == 0


def test_a_stream_of_mixed_requests_all_complete_exactly(engines):
    """Arrivals every other step; a handoff whose blocks cannot be had at pull time is recomputed
    from its prompt and first token, as the decode worker does."""
    big, small = engines
    g = torch.Generator().manual_seed(13)
    reqs = []
    for i in range(12):
        n = int(torch.randint(3, 21, (1,), generator=g))
        m = int(torch.randint(2, min(12, 32 - n) + 1, (1,), generator=g))   # at most 32 tokens: 8 blocks
        reqs.append((f"r{i}", _ids(n, 100 + i), m, i % 3 != 2))             # two of three are handoffs
    expected = {rid: _greedy(big, p, m) for rid, p, m, _ in reqs}
    drv, first = Driver(small), {}
    for rid, prompt, m, handoff in reqs:
        if not handoff:
            small.add_request(prompt, _sp(m), rid)
        elif small.pool.num_free >= -(-len(prompt) // BS):
            first[rid] = _handoff(big, small, rid, prompt, m)
        else:
            first[rid] = _prefill(big, rid, prompt)
            big.hold_hook.release(rid)
            small.add_request([*prompt, first[rid]], _sp(m - 1), rid)
        for _ in range(2):
            drv.step()
    drv.run()
    _check_exact(drv, expected, first)
    assert drv.longest_idle_run == 0


def test_head_waits_for_a_pull_in_flight_then_takes_the_blocks_it_needs(engines):
    big, small = engines
    p1, p2 = _ids(8, 6), _ids(24, 7)
    expected = {"h1": _greedy(big, p1, 5), "h2": _greedy(big, p2, 4)}
    discarded = small.kv_discarded
    drv = Driver(small)
    first = {"h1": _handoff(big, small, "h1", p1, 5)}     # 2 blocks; its pending token needs a 3rd
    first["h2"] = _prefill(big, "h2", p2)
    in_flight = _pull(big, small, "h2")                   # 6 blocks taken at pull time: none free
    for _ in range(3):                                    # nothing can run: idle, not spinning
        assert drv.step() == [] and small.idle_step
    assert small.requests.seqs["h1"].block_ids and small.kv_discarded == discarded
    add_prefilled(small, "h2", p2, first["h2"], _sp(4), in_flight)   # the pull ends
    drv.step()
    assert not small.idle_step
    assert small.kv_discarded == discarded + 1            # h2 (behind h1, the youngest) is recomputed
    drv.run()
    _check_exact(drv, expected, first)


def test_an_abort_delta_is_not_an_idle_step(engines):
    _, small = engines
    small.add_request(_ids(5, 8), _sp(4), "x")
    small.abort("x")
    assert [d.finish_reason for d in small.step()] == [FinishReason.ABORT] and not small.idle_step
    assert small.step() == [] and small.idle_step


def test_prefill_waits_for_held_blocks_instead_of_ending_without_a_token(engines):
    big, small = engines
    px, py = _ids(16, 9), _ids(20, 10)
    want_y = _greedy(big, py, 1)[0]
    drv = Driver(small)
    small.add_request(px, _sp(1), "x", hold_kv=True)
    drv.run()
    assert small.hold_hook.take("x")[1] == 16             # 4 blocks held for a consumer
    small.add_request(py, _sp(1), "y", hold_kv=True)      # needs 5 blocks: only 4 are free
    for _ in range(6):
        drv.step()
    assert "y" not in drv.reasons and "y" not in small.hold_hook.leases   # waits, holds nothing yet
    assert small.idle_step
    small.hold_hook.release("x")                          # the consumer has read x
    drv.run()
    assert drv.tokens["y"] == [want_y] and drv.reasons["y"] is FinishReason.LENGTH
    blocks, n = small.hold_hook.take("y")
    assert n == 20 and len(blocks) == 5
    small.hold_hook.release("y")


@pytest.fixture
def prefill_worker(small):
    """The prefill worker's publishing step without Ray: its engine and a producer on loopback."""
    worker = PrefillWorker.__new__(PrefillWorker)
    transport = LoopbackTransport("kv-pressure-prefill")
    transport.register(small.kv_cache.arena, small.layout)
    worker.hold = small.hold_hook
    worker.producer = KVProducer(transport, small.layout, small.kv_cache.arena, small.hold_hook.lease_ended)
    yield worker
    transport.close()


def test_publish_hands_off_a_prefilled_request(engines, prefill_worker):
    _, small = engines
    prompt = _ids(10, 11)
    small.add_request(prompt, _sp(1), "p", hold_kv=True)
    last = [d for d in _steps_to_end(small) if d.request_id == "p"][-1]
    result = prefill_worker._publish(small, "p", prompt, _sp(8), last)
    handle = KVHandle.decode(result.handle)
    assert result.first.finish_reason is None and result.first.token_ids == (last.token_ids[0],)
    assert handle.first_token == last.token_ids[0]
    assert len(handle.block_ids) == 3 and handle.num_tokens == 10
    assert prefill_worker.producer.abort("p")             # the lease ends: the blocks go back
    assert "p" not in small.hold_hook.leases


def test_publish_without_a_token_releases_what_is_held_and_says_busy(engines, prefill_worker):
    _, small = engines
    prompt = _ids(30, 12)
    # Partial blocks, as before the fix:
    small.hold_hook.leases["q"] = PrefillLease("q", small.pool.allocate(3), 12, Sequence("q", tuple(prompt), _sp(8)))
    last = TokenDelta("q", (), "", FinishReason.LENGTH, (), len(prompt), 0, 0)
    with pytest.raises(WorkerBusy, match=r"8 KV blocks.*8 in the pool"):
        prefill_worker._publish(small, "q", prompt, _sp(8), last)
    assert "q" not in small.hold_hook.leases
    with pytest.raises(WorkerBusy):                       # nothing held: still busy, never an IndexError
        prefill_worker._publish(small, "q", prompt, _sp(8), last)


def _steps_to_end(engine: LLMEngine, max_steps: int = 200) -> list[TokenDelta]:
    out = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        out += engine.step()
    raise AssertionError("no progress")
