"""The typed messages at the process boundaries: the token frame (versioned, decoded strictly), the
worker calls and their results, the stats a poll answers, ServerInfo and the finish-reason forms.
Whatever is refused is refused with an error that names what is wrong, never read as if it were right."""
from __future__ import annotations

import asyncio
import dataclasses
import struct

import msgpack
import pytest

from cluster.token_stream import STREAM_VERSION, ErrorFrame, FrameError, Hello, KeyedDelta, SinkAddress, StepFrame, \
    StreamBroken, StreamError, TokenReceiver, TokenSender, decode_frame, encode_errors, encode_hello, encode_step
from cluster.types import FinishReason, Fork, SamplingParams, TokenDelta, TokenLogprob
from cluster.worker_messages import DecodeCall, GenerateCall, MessageRefused, PrefillCall, PrefillResult, \
    WorkerStats, expect

SINK = SinkAddress("f", "127.0.0.1", 1, b"s")
SP = SamplingParams()


def _body(frame: bytes) -> bytes:
    (n,) = struct.unpack_from(">I", frame)
    assert len(frame) == 4 + n
    return frame[4:]


def _raw(*msg) -> bytes:
    return msgpack.packb(list(msg), use_bin_type=True)


def _record(**change) -> list:
    rec = {"key": 3, "ids": [5, 6], "text": "ab", "finish": "", "lps": None, "n_prompt": 4, "n_output": 2,
           "n_cached": 0, "plps": None} | change
    return list(rec.values())


# --- the token frame ------------------------------------------------------------------------------
def test_a_step_frame_round_trips_every_field():
    lp = (TokenLogprob(5, -0.5, ((5, -0.5), (7, -1.25))), TokenLogprob(6, -0.25))
    deltas = [TokenDelta("a", (5, 6), "ab", None, lp, 4, 2, 1, (TokenLogprob(9, -2.0, ((9, -2.0),)),)),
              TokenDelta("b", (), "", FinishReason.ABORT, (), 4, 0, 0)]
    frame = decode_frame(_body(encode_step([KeyedDelta(1, deltas[0]), KeyedDelta(2, deltas[1])])))
    assert type(frame) is StepFrame and [r.key for r in frame.records] == [1, 2]
    assert [r.delta(d.request_id) for r, d in zip(frame.records, deltas)] == deltas


def test_hello_and_error_frames_round_trip():
    assert decode_frame(_body(encode_hello("w", b"secret"))) == Hello("w", b"secret")
    frame = decode_frame(_body(encode_errors([StreamError(4, "engine step failed")])))
    assert type(frame) is ErrorFrame and [(e.key, e.message) for e in frame.errors] == [(4, "engine step failed")]


@pytest.mark.parametrize("body, names", [
    (_raw(1, "step", [_record()]), "version 1"),                          # another version
    (_raw(STREAM_VERSION + 1, "step", [_record()]), f"version {STREAM_VERSION + 1}"),
    (_raw("2", "step", [_record()]), "version '2'"),                      # the version of another type
    (_raw(STREAM_VERSION, "step", [_record()[:8]]), "9 fields"),          # a field missing
    (_raw(STREAM_VERSION, "step", [_record() + [None]]), "9 fields"),     # one too many
    (_raw(STREAM_VERSION, "step", [_record(text=7)]), "text"),            # a wrong type
    (_raw(STREAM_VERSION, "step", [_record(ids=[1, "2"])]), "token_ids"),
    (_raw(STREAM_VERSION, "step", [_record(key="3")]), "key"),
    (_raw(STREAM_VERSION, "step", [_record(finish="done")]), "finish"),
    (_raw(STREAM_VERSION, "step", [_record(n_output=2.0)]), "counts"),
    (_raw(STREAM_VERSION, "step", [_record(lps=[[5, -1, []]])]), "logprobs"),   # an int logprob
    (_raw(STREAM_VERSION, "step", [_record(plps=[[5, -1.0, [[5, "x"]]]])]), "prompt_logprobs"),
    (_raw(STREAM_VERSION, "step", {"records": []}), "list of records"),
    (_raw(STREAM_VERSION, "error", [[1, 2]]), "[key, message]"),
    (_raw(STREAM_VERSION, "hello", ["w", "not-bytes"]), "hello"),
    (_raw(STREAM_VERSION, "ping", []), "unknown kind"),
    (_raw(STREAM_VERSION, "step"), "[version, kind, body]"),
    (msgpack.packb({"version": STREAM_VERSION}), "[version, kind, body]"),
    (b"\xc1garbage", "not msgpack"),
])
def test_a_frame_of_another_version_a_wrong_type_or_a_missing_field_is_refused(body, names):
    with pytest.raises(FrameError) as info:
        decode_frame(body)
    assert names in str(info.value)


def test_a_refused_step_frame_names_the_streams_it_was_for():
    with pytest.raises(FrameError) as info:
        decode_frame(_raw(STREAM_VERSION, "step", [_record(key=1), _record(key=2, text=None), ["x"]]))
    assert info.value.keys == (1, 2)


def test_the_receiver_counts_a_refused_frame_fails_its_streams_and_keeps_serving():
    async def go():
        receiver = TokenReceiver("f")
        address = await receiver.start()
        key, queue = receiver.open("req")
        sender = TokenSender("old-worker")
        old = msgpack.packb([1, "step", [[key, [5], "x", "", None, 1, 1, 0]]])      # a version-1 worker
        bad = msgpack.packb([STREAM_VERSION, "step", [_record(key=key, ids="5")]])
        assert await asyncio.to_thread(sender.send, address, struct.pack(">I", len(bad)) + bad)
        items = await asyncio.wait_for(queue.take(), 5)
        assert isinstance(items[0], StreamBroken) and "old-worker" in str(items[0])
        sender.close()
        raw_sender = TokenSender("older-worker")
        raw_sender.send(address, struct.pack(">I", len(old)) + old)    # hello of this version, the step v1: refused
        for _ in range(100):
            if receiver.refused == 2:
                break
            await asyncio.sleep(0.02)
        assert receiver.refused == 2
        key2, queue2 = receiver.open("next")
        good = TokenSender("w")
        assert await asyncio.to_thread(good.send, address, encode_step([KeyedDelta(key2, TokenDelta("next", (9,), "z"))]))
        assert (await asyncio.wait_for(queue2.take(), 5))[0].token_ids == (9,)
        good.close()
        raw_sender.close()
        await receiver.stop()
    asyncio.run(go())


def _full_stats() -> WorkerStats:
    from cluster.worker_messages import HandoffStats, PrefillStats, SpecStats
    return WorkerStats(name="w", role="decode", incarnation="i", ready=True, pid=7, steps=3, has_work=True,
                       blocks_used=2, blocks_free=5, blocks_total=7, kv_limit="--kv-cache-bytes", queue_seconds=1,
                       queue_time_buckets=((0.1, 1), (1.0, 2)), spec=(SpecStats("ngram", 4, 2, 1, 3, (1, 1, 1, 1), (1, 1, 0, 0)),),
                       prefill=PrefillStats(1), handoff=HandoffStats(1, 2, 3, 4, 0.5))


def test_worker_stats_cross_the_token_stream_strictly():
    from cluster.token_stream import StatsFrame, encode_stats
    from cluster.worker_messages import stats_from_wire, stats_to_wire
    stats = _full_stats()
    frame = decode_frame(_body(encode_stats(stats_to_wire(stats))))
    assert type(frame) is StatsFrame and stats_from_wire(frame.body) == stats
    body = frame.body          # as it arrives: msgpack lists where the dataclass has tuples
    for change, message in [({"blocks_used": "2"}, "blocks_used"), ({"spec": [{"method": 1}]}, "SpecStats.method"),
                            ({"spec": [{"method": "ngram", "accepted_at": [1.5]}]}, "SpecStats.accepted_at"),
                            ({"handoff": {"bytes": 1.5}}, "HandoffStats.bytes"), ({"extra": 1}, "unknown"),
                            ({"version": 2}, "version 2"), ({"queue_time_buckets": [[1.0]]}, "queue_time_buckets")]:
        with pytest.raises(ValueError, match=message):
            stats_from_wire(body | change)
    with pytest.raises(FrameError, match="stats: a map"):
        decode_frame(_raw(STREAM_VERSION, "stats", [1, 2]))


def test_the_receiver_hands_stats_to_its_router_and_drops_a_peer_whose_stats_it_refuses():
    from cluster.token_stream import encode_stats
    from cluster.worker_messages import stats_from_wire, stats_to_wire
    got = []

    def on_stats(worker, body):
        stats = stats_from_wire(body)
        if stats.name != worker:
            raise ValueError("another worker's stats")
        got.append(stats)

    async def go():
        receiver = TokenReceiver("f", on_stats=on_stats)
        address = await receiver.start()
        w = TokenSender("w")
        assert await asyncio.to_thread(w.send, address, encode_stats(stats_to_wire(_full_stats())))
        liar = TokenSender("x")          # its hello says "x", its stats say "w"
        assert await asyncio.to_thread(liar.send, address, encode_stats(stats_to_wire(_full_stats())))
        for _ in range(100):
            if got and receiver.refused:
                break
            await asyncio.sleep(0.02)
        assert got == [_full_stats()] and receiver.refused == 1
        for _ in range(100):                       # the liar's connection is dropped, w's stays
            if len(receiver.connections) == 1:
                break
            await asyncio.sleep(0.02)
        assert [c.worker for c in receiver.connections] == ["w"]
        w.close()
        liar.close()
        await receiver.stop()
    asyncio.run(go())


# --- the worker calls and what comes back ---------------------------------------------------------
def test_calls_refuse_forks_of_the_wrong_shape():
    with pytest.raises(ValueError, match="Fork"):
        GenerateCall("r", [1, 2], SP, SINK, 1, forks=(("f", SP, 2),))      # the old positional tuples
    with pytest.raises(ValueError, match="stream key"):
        GenerateCall("r", [1, 2], SP, SINK, 1, forks=(Fork("f", SP),))
    with pytest.raises(ValueError, match="stream key"):
        DecodeCall("r", [1, 2], SP, b"h", SINK, 1, forks=(Fork("f", SP),))
    with pytest.raises(ValueError, match="sampling"):
        PrefillCall("r", [1, 2], {"max_tokens": 3})
    with pytest.raises(ValueError, match="handle"):
        DecodeCall("r", [1, 2], SP, "not-bytes", SINK, 1)
    call = DecodeCall("r", [1, 2], SP, b"h", SINK, 1, forks=[Fork("f", SP, 2)])
    assert call.prompt_ids == (1, 2) and call.forks == (Fork("f", SP, 2),)     # stored frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.key = 2


def test_stats_and_results_of_another_type_or_version_are_refused():
    stats = WorkerStats(name="d0", role="decode", incarnation="i", ready=True)
    assert expect(stats, WorkerStats) is stats
    with pytest.raises(MessageRefused, match="version 2"):
        expect(dataclasses.replace(stats, version=2), WorkerStats)
    with pytest.raises(MessageRefused, match="got dict"):
        expect({"name": "d0", "blocks_used": 0}, WorkerStats)       # the old untyped stats
    result = PrefillResult("r", TokenDelta("r", (5,), "x", None, (), 4, 1, 0), b"h")
    with pytest.raises(MessageRefused, match="PrefillResult of version 0"):
        expect(dataclasses.replace(result, version=0), PrefillResult)


def test_the_worker_client_checks_what_a_worker_answers():
    from router.workers import WorkerClient

    class Method:
        def __init__(self, value):
            self.value = value

        def options(self, **_):
            return self

        def remote(self, *_):
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(self.value)
            return fut

    class Handle:
        stats = Method({"name": "w", "ready": True})
        prefill = Method(("r", 5, "x"))

    client = WorkerClient("w", Handle())
    with pytest.raises(MessageRefused):
        asyncio.run(client.stats())
    with pytest.raises(MessageRefused):
        asyncio.run(client.prefill(PrefillCall("r", [1], SP)))


def test_a_prefill_result_gives_every_member_its_first_delta():
    fork = TokenDelta("f", (8,), "y", None, (), 4, 1, 0)
    result = PrefillResult("r", TokenDelta("r", (5,), "x", None, (), 4, 1, 2), b"h", forks=(fork,))
    firsts = result.first_deltas(("f", "g"))
    assert firsts["r"] == TokenDelta("r", (5,), "x", None, (), 4, 1, 2)
    assert firsts["f"] is fork
    assert firsts["g"].finish_reason is FinishReason.ABORT and firsts["g"].token_ids == ()   # never got one
    ended = PrefillResult("r", TokenDelta("r", (), "", FinishReason.ABORT, (), 4, 1, 0), None)
    assert ended.first_deltas()["r"].token_ids == ()


def test_worker_stats_read_by_attribute_with_role_parts():
    from cluster.worker_messages import HandoffStats, PrefillStats, SpecStats
    p = WorkerStats(name="p0", role="prefill", incarnation="i", ready=True, prefill=PrefillStats(leases=2))
    d = WorkerStats(name="d0", role="decode", incarnation="i", ready=True, handoff=HandoffStats(done=3),
                    spec=(SpecStats("ngram", drafted=4, accepted=2, steps=1, emitted=3),))
    assert p.leases == 2 and p.busy and d.leases == 0 and not d.busy
    assert d.spec_of("ngram").accepted == 2 and d.spec_of("eagle") == SpecStats("eagle")


# --- the front door's messages --------------------------------------------------------------------
def test_server_info_has_the_protos_fields_one_for_one():
    from proto.splitserve.v1 import inference_pb2 as pb
    from router.server import ServerInfo
    names = [f.name for f in dataclasses.fields(ServerInfo)]
    assert names == [f.name for f in pb.ServerInfoResponse.DESCRIPTOR.fields]
    info = ServerInfo("0.1.0", "colocated", 0, 1, "tcp", 64, "ngram", "auto", True)
    msg = info.to_proto()
    assert (msg.mode, msg.decode_workers, msg.num_speculative_tokens, msg.deterministic) == ("colocated", 1, "auto", True)


def test_every_finish_reason_has_one_form_per_api():
    from proto.splitserve.v1 import inference_pb2 as pb
    from router.finish_reasons import from_proto, to_openai, to_proto
    for reason in FinishReason:
        assert from_proto(to_proto(reason)) is reason
    assert from_proto(pb.FINISH_REASON_UNSPECIFIED) is None
    from router.server import to_proto as response
    for reason in FinishReason:       # the gRPC response of a final delta
        msg = response(TokenDelta("r", (5,), "x", reason, (), 3, 1, 0), usage_tokens=1)
        assert from_proto(msg.finish_reason) is reason and msg.usage.completion_tokens == 1
    assert [to_openai(r) for r in FinishReason] == ["stop", "length", "length"]     # OpenAI has no "abort"


def test_both_apis_admit_through_one_check():
    from router.admission import Admission, AdmissionConfig, Refused, RefusedWhy

    async def go():
        admission = Admission(AdmissionConfig(max_in_flight=2))
        with pytest.raises(Refused) as closing:
            await admission.admit("t", 1, closing=True)
        with pytest.raises(Refused) as large:
            await admission.admit("t", 3, closing=False)
        ticket = await admission.admit("t", 2, closing=False)
        admission.release(ticket)
        return closing.value.why, large.value.why
    closing, large = asyncio.run(go())
    assert closing is RefusedWhy.SHUTTING_DOWN and (closing.grpc_code, closing.http_status) == ("UNAVAILABLE", 503)
    assert large is RefusedWhy.TOO_LARGE and (large.grpc_code, large.http_status) == ("RESOURCE_EXHAUSTED", 400)
    assert (RefusedWhy.QUEUE_FULL.grpc_code, RefusedWhy.QUEUE_FULL.http_status) == ("RESOURCE_EXHAUSTED", 429)


def test_mutated_frames_get_only_the_decoders_own_error():
    """Random bytes, truncations, bit flips and retyped fields of a valid step frame: a `FrameError`
    or a frame that is well formed (it encodes back to itself), never another exception."""
    import random
    rng = random.Random(2)
    lp = (TokenLogprob(5, -0.5, ((5, -0.5),)),)
    valid = _body(encode_step([KeyedDelta(1, TokenDelta("a", (5, 6), "ab", FinishReason.STOP, lp, 4, 2, 1, lp))]))
    junk = [None, -1, 2**64 - 1, "x", b"\x00", [1, "a"], {"a": 1}, 1.5, True, [], "stop"]
    candidates = [rng.randbytes(rng.randrange(0, 200)) for _ in range(100)]
    candidates += [valid[:rng.randrange(len(valid))] for _ in range(100)]
    for _ in range(100):
        b = bytearray(valid)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        candidates.append(bytes(b))
    for _ in range(200):
        rec = msgpack.unpackb(valid)[2][0]
        rec[rng.randrange(len(rec))] = rng.choice(junk)
        candidates.append(_raw(STREAM_VERSION, "step", [rec]))
    accepted = 0
    for data in candidates:
        try:
            frame = decode_frame(data)
        except FrameError:
            continue
        accepted += 1
        if type(frame) is StepFrame:
            again = encode_step([KeyedDelta(r.key, r.delta("a")) for r in frame.records])
            assert decode_frame(_body(again)) == frame
    assert accepted < 200


def test_stats_read_out_of_order_keep_the_newest_of_an_incarnation():
    from cluster.metrics import ClusterMetrics
    from cluster.worker_messages import StatsSource
    from router.policy import make_policy
    from router.router_config import RouterConfig
    from router.worker_pool import WorkerPool
    newer = WorkerStats(name="w", role="decode", incarnation="i", ready=True, taken_at=2.0)
    older = dataclasses.replace(newer, taken_at=1.0, blocks_used=3, running=1)   # a poll answered before a push
    assert newer.supersedes(older) and not older.supersedes(newer) and newer.supersedes(None)
    assert dataclasses.replace(older, incarnation="j").supersedes(newer)       # a restart: never ordered away
    pool = WorkerPool(RouterConfig(), make_policy("least_loaded"), {}, {"w": None})   # what the metrics read
    m = ClusterMetrics("nixl", "m", workers=pool)
    assert pool.observe(newer, StatsSource.PUSH, 1.0)
    assert not pool.observe(older, StatsSource.POLL, 2.0)
    assert m.worker_stats["w"] is newer
