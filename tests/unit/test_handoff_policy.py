"""Lease and handoff policy over the in-process loopback transport, with a fake clock."""
from __future__ import annotations

import itertools

import pytest
import torch

from cluster.kv.block_pool import BlockPool
from cluster.transfer.base import LayoutMismatch, TransferStatus
from cluster.transfer.consumer import KVConsumer, PullState
from cluster.transfer.loopback import LoopbackTransport
from cluster.transfer.messages import Kind, Message
from cluster.transfer.producer import KVProducer
from cluster.types import KVHandle, KVLayout

LAYOUT = KVLayout(model_id="m", num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32")
_names = itertools.count()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Side:
    def __init__(self, clock, layout=LAYOUT, lease=30.0, timeout=10.0):
        self.name = f"agent{next(_names)}"
        self.arena = torch.randn(layout.num_layers, 2, 16, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.pool = BlockPool(16)
        self.held: dict[str, list[int]] = {}
        self.transport = LoopbackTransport(self.name)
        self.transport.register(self.arena, layout)
        self.producer = KVProducer(self.transport, layout, self.arena, self.release, lease_seconds=lease, clock=clock)
        self.consumer = KVConsumer(self.transport, layout, self.arena, timeout_s=timeout, clock=clock)

    def release(self, request_id, state=None):   # the producer's `on_lease_end`
        self.pool.free(reversed(self.held.pop(request_id)))

    def publish(self, request_id, n=3) -> KVHandle:
        self.held[request_id] = self.pool.allocate(n)
        return self.producer.publish(request_id, self.held[request_id], n * 4, first_token=7)

    def close(self):
        self.transport.close()


@pytest.fixture
def pair():
    clock = Clock()
    p, d = Side(clock), Side(clock)
    p.transport.add_peer(d.transport.metadata())
    d.transport.add_peer(p.transport.metadata())
    yield clock, p, d
    p.close()
    d.close()


def _run(p, d, pull, steps=10):
    for _ in range(steps):
        d.consumer.poll()
        p.producer.poll()
        if pull.finished:
            break
    d.consumer.poll()
    return pull


def test_pull_done_copies_bytes_and_releases_producer(pair):
    clock, p, d = pair
    h = p.publish("r")
    local = d.pool.allocate(3)
    pull = _run(p, d, d.consumer.start_pull(h, local))
    assert pull.state is PullState.DONE
    assert torch.equal(d.arena[:, :, local], p.arena[:, :, list(h.block_ids)])
    p.pool.check_idle()
    assert p.producer.num_active() == 0


def test_lease_expires_without_renewal_and_late_done_is_refused(pair):
    clock, p, d = pair
    h = p.publish("r")
    clock.t = 31.0
    p.producer.poll()
    p.pool.check_idle()                                  # released by expiry
    local = d.pool.allocate(3)
    pull = _run(p, d, d.consumer.start_pull(h, local))  # reads stale blocks, then asks for the lease
    assert pull.state is PullState.FAILED and "lease had ended (expired)" in pull.error


def test_consumer_renews_while_waiting_and_lease_expires_once_it_stops():
    clock = Clock()
    p, d = Side(clock, lease=30.0), Side(clock, timeout=1000.0)
    p.transport.add_peer(d.transport.metadata())
    d.transport.add_peer(p.transport.metadata())
    h = p.publish("r", 2)
    d.consumer.start_pull(h, d.pool.allocate(2))
    d.transport.poll = lambda transfer: TransferStatus.PENDING   # a read that never lands: d keeps waiting
    for t in range(0, 90, 2):                            # 90 s, three lease lengths
        clock.t = float(t)
        d.consumer.poll()
        p.producer.poll()
    assert p.producer.num_active() == 1                  # kept alive by RENEW
    clock.t = 200.0                                       # the consumer goes silent
    p.producer.poll()
    assert p.producer.num_active() == 0
    p.pool.check_idle()
    p.close()
    d.close()


def test_failed_read_tells_producer_and_fails(pair):
    clock, p, d = pair
    h = p.publish("r")
    d.transport.fail_next = True
    pull = _run(p, d, d.consumer.start_pull(h, d.pool.allocate(3)))
    assert pull.state is PullState.FAILED and pull.error == "read failed"
    p.producer.poll()
    p.pool.check_idle()


def test_checksum_mismatch_fails_cleanly(pair):
    clock, p, d = pair
    h = p.publish("r")
    p.arena[1, 1, h.block_ids[2], 0, 0, 3] += 1.0        # corrupt the source after the checksum
    pull = _run(p, d, d.consumer.start_pull(h, d.pool.allocate(3)))
    assert pull.state is PullState.FAILED and "checksum mismatch in 1 of 3 blocks (first: block 2)" in pull.error
    p.producer.poll()
    p.pool.check_idle()


def test_timeout_when_producer_is_silent(pair):
    clock, p, d = pair
    h = p.publish("r")
    pull = d.consumer.start_pull(h, d.pool.allocate(3))
    d.consumer.poll()                                   # read done, DONE sent; producer never answers
    assert pull.state is PullState.CONFIRMING
    clock.t = 11.0
    d.consumer.poll()
    assert pull.state is PullState.FAILED and "timed out in state confirming" in pull.error


def test_messages_from_other_peers_are_ignored(pair):
    clock, p, d = pair
    h = p.publish("r")
    intruder = Side(clock)
    intruder.transport.add_peer(p.transport.metadata())
    p.transport.add_peer(intruder.transport.metadata())
    d.transport.notify(p.name, Message(Kind.RENEW, h.lease_id).encode())   # binds the lease to d
    p.producer.poll()
    intruder.transport.notify(p.name, Message(Kind.ABORT, h.lease_id).encode())
    p.producer.poll()
    assert p.producer.num_active() == 1 and p.producer.leases[h.lease_id].consumer == d.name
    intruder.close()


def test_layout_mismatch_names_fields():
    clock = Clock()
    a = Side(clock)
    b = Side(clock, layout=KVLayout(model_id="m", num_layers=2, num_kv_heads=1, head_dim=8, block_size=8,
                                    dtype="bfloat16"))
    with pytest.raises(LayoutMismatch, match=r"block_size: local 4, peer 8; dtype: local 'float32', peer 'bfloat16'"):
        a.transport.add_peer(b.transport.metadata())
    h = b.publish("r")
    with pytest.raises(LayoutMismatch, match="cannot be read here"):
        a.consumer.start_pull(h, a.pool.allocate(3))
    a.close()
    b.close()


def test_handle_and_messages_round_trip_without_pickle():
    h = KVHandle("r", "p", "l", (3, 1, 2), 12, 7, "abc", (1, 2, 3))
    assert KVHandle.decode(h.encode()) == h
    assert Message.decode(b"\x80garbage") is None


def _progress(side, role):
    """Poll `side`'s producer or consumer on a KV progress thread, as a worker does."""
    from cluster.transfer.progress import KVProgress
    part = getattr(side, role)

    def poll():
        part.poll()
        return part.poll_interval()
    progress = KVProgress(poll, f"kv-{side.name}")
    part.on_work = progress.wake
    return progress


def test_handoffs_complete_on_the_progress_threads_while_the_engine_threads_are_busy():
    """The regression behind 1P1D's timeouts: a producer that answered only between engine steps
    made pulls time out behind multi-second prefill steps. On the progress threads the read, DONE
    and ACK complete with neither engine thread turning; the lease's blocks wait for the producer's
    engine thread (here: a list nobody drains until the end) and are freed there."""
    import time
    p, d = Side(time.monotonic, timeout=5.0), Side(time.monotonic, timeout=5.0)
    p.transport.add_peer(d.transport.metadata())
    d.transport.add_peer(p.transport.metadata())
    for_engine_thread = []
    p.producer.on_lease_end = lambda request_id, state: for_engine_thread.append(request_id)
    threads = [_progress(p, "producer"), _progress(d, "consumer")]
    try:
        pulls = [d.consumer.start_pull(p.publish(f"r{i}"), d.pool.allocate(3)) for i in range(4)]
        limit = time.monotonic() + 5.0
        while not all(x.finished for x in pulls) and time.monotonic() < limit:
            time.sleep(0.01)
        assert [x.state for x in pulls] == [PullState.DONE] * 4, [x.error for x in pulls]
        assert p.producer.num_active() == 0 and sorted(for_engine_thread) == ["r0", "r1", "r2", "r3"]
        for rid in for_engine_thread:                       # the engine thread's turn
            p.release(rid)
        assert p.pool.num_free == 16
        for x in pulls:
            assert torch.equal(d.arena[:, :, x.local_blocks], p.arena[:, :, list(x.handle.block_ids)])
    finally:
        for t in threads:
            t.close()
        p.close()
        d.close()


def test_an_idle_progress_thread_sleeps_until_something_is_in_flight(pair):
    """Nothing spins: with no lease live the thread does not turn; a lease wakes it, it polls
    while the lease lives (the lease can expire), and it sleeps again once the lease has ended."""
    import time
    clock, p, d = pair
    progress = _progress(p, "producer")
    try:
        time.sleep(0.3)
        assert progress.turns == 0
        p.publish("r")
        time.sleep(0.3)
        busy = progress.turns
        assert busy >= 50                                  # polled every 50 us - 1 ms while live
        clock.t = 31.0                                     # the lease expires on that thread
        limit = time.monotonic() + 5.0
        while "r" in p.held and time.monotonic() < limit:
            time.sleep(0.01)
        assert "r" not in p.held and p.pool.num_free == 16
        time.sleep(0.05)
        settled = progress.turns
        time.sleep(0.3)
        assert progress.turns - settled <= 1
    finally:
        progress.close()
