"""Everything that crosses a process boundary is decoded strictly: random and mutated bytes thrown
at each decoder and at the TCP transport's listener get a clean refusal (the decoder's own error,
or None), never a crash, an allocation past the limit or a thread spent on an unauthenticated
connection. Sealed KV-plane messages: forged, tampered, expired and replayed ones do not open."""
from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import msgpack
import pytest
import torch

from cluster.transfer.auth import Sealer
from cluster.transfer.base import PeerMetadata, TransferError
from cluster.transfer.messages import Kind, Mailbox, Message
from cluster.transfer.tcp import MAX_HELLO, TcpTransport
from cluster.types import ForkFirst, KVHandle, KVLayout

SECRET = b"s" * 32
LAYOUT = KVLayout("m", 2, 2, 8, 4, "float32")


def _mutations(valid: bytes, rng: random.Random, n: int = 400):
    """Random bytes, truncations, bit flips, and valid msgpack with fields retyped."""
    for _ in range(n // 4):
        yield rng.randbytes(rng.randrange(0, 300))
    for _ in range(n // 4):
        yield valid[:rng.randrange(len(valid))]
    for _ in range(n // 4):
        b = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        yield bytes(b)
    raw = msgpack.unpackb(valid)
    junk = [None, -1, 2**64 - 1, "x" * 10, b"\x00" * 10, [1, "a"], {"a": 1}, 1.5, True, [-5], [2**40]]
    for _ in range(n // 4):
        mutated = dict(raw)
        key = rng.choice(list(mutated))
        if rng.random() < 0.2:
            del mutated[key]
        else:
            mutated[key] = rng.choice(junk)
        yield msgpack.packb(mutated)


def _handle() -> bytes:
    return KVHandle("req", "prefill-0", "lease-1", (3, 4, 5), 10, 7, "abcd", (1, 2, 3)).encode()


def _metadata() -> bytes:
    return PeerMetadata("prefill-0", "tcp", 1, LAYOUT, 64, 0, msgpack.packb({"host": "127.0.0.1", "port": 1})).encode()


@pytest.mark.parametrize("decode, valid, errors", [
    (KVHandle.decode, _handle(), (ValueError,)),
    (PeerMetadata.decode, _metadata(), (TransferError,)),
    (Message.decode, Message(Kind.DONE, "lease-1", reason="checksum").encode(), ()),   # None, never raises
])
def test_decoders_refuse_cleanly(decode, valid, errors):
    rng = random.Random(1)
    decode(valid)                                      # the valid one decodes
    accepted = 0
    for data in _mutations(valid, rng):
        try:
            out = decode(data)
        except errors:
            continue
        if out is not None:
            accepted += 1
            assert type(out).decode(out.encode()) == out   # whatever is accepted is well formed
    assert accepted < 150


def test_a_handle_out_of_range_is_refused():
    good = msgpack.unpackb(_handle())
    for field, value in [("block_ids", []), ("block_ids", [1, 1]), ("block_ids", [-1]), ("block_ids", [2**31]),
                         ("checksums", [1]), ("num_tokens", 2), ("lease_seconds", 0), ("first_token", -1),
                         ("producer", ""), ("feature", "x"), ("forks", [["f", -1]]), ("forks", [["", 3]]),
                         ("forks", [["f"]]), ("forks", {"f": 3})]:
        with pytest.raises(ValueError, match=field):
            KVHandle.decode(msgpack.packb({**good, field: value}))
    with pytest.raises(ValueError):
        KVHandle.decode(msgpack.packb({"version": 1, "block_ids": list(range(1 << 19))}))   # over the bound


def test_a_handle_carries_its_forks_first_tokens():
    handle = KVHandle("req", "prefill-0", "lease-1", (3, 4, 5), 10, 7, "abcd", (1, 2, 3),
                      forks=(ForkFirst("f1", 9), ForkFirst("f2", 0)))
    assert KVHandle.decode(handle.encode()) == handle
    assert handle.first_tokens() == {"req": 7, "f1": 9, "f2": 0}


def test_sealed_messages_open_once_and_only_with_the_secret():
    sealer, other = Sealer(SECRET), Sealer(b"t" * 32)
    body = Message(Kind.ABORT, "lease-9").encode()
    sealed = sealer.seal(b"kv-message", body)
    assert other.open(b"kv-message", sealed, 1 << 20) is None                  # forged: another secret
    assert sealer.open(b"peer-metadata", sealed, 1 << 20) is None              # another context
    tampered = bytearray(sealed)
    tampered[30] ^= 1
    assert sealer.open(b"kv-message", bytes(tampered), 1 << 20) is None
    assert sealer.open(b"kv-message", sealed, 8) is None                       # over the size bound
    assert sealer.open(b"kv-message", sealed, 1 << 20) == body
    assert sealer.open(b"kv-message", sealed, 1 << 20) is None                 # replayed
    old = Sealer(SECRET, window_s=0.05)
    stale = old.seal(b"kv-message", body)
    time.sleep(0.1)
    assert old.open(b"kv-message", stale, 1 << 20) is None                     # too old
    rng = random.Random(2)
    assert all(sealer.open(b"kv-message", rng.randbytes(rng.randrange(200)), 1 << 20) is None for _ in range(300))


class _Inbox:
    """A transport stand-in that only holds notifications (the Mailbox's policy under test)."""

    def __init__(self):
        self.items, self.sent = [], []

    def notifications(self):
        out, self.items = self.items, []
        return out

    def notify(self, peer, data):
        self.sent.append((peer, data))


def test_the_mailbox_drops_forged_and_replayed_messages():
    inbox = _Inbox()
    box = Mailbox(inbox, sealer=Sealer(SECRET))
    Mailbox(inbox, sealer=Sealer(SECRET)).send("p", Message(Kind.DONE, "lease-1"))
    (_, sealed), = inbox.sent
    forged = Sealer(b"x" * 32).seal(b"kv-message", Message(Kind.ABORT, "lease-1").encode())
    inbox.items = [("p", sealed), ("p", sealed), ("p", forged), ("p", Message(Kind.ABORT, "lease-1").encode())]
    taken = box.take(lambda m: True)
    assert [m.kind for _, m in taken] == [Kind.DONE] and box.refused == 3


def _transport(name, sealer, **kw) -> TcpTransport:
    t = TcpTransport(name, sealer=sealer, **kw)
    arena = torch.arange(2 * 2 * 8 * 4 * 2 * 8, dtype=torch.float32).view(2, 2, 8, 4, 2, 8).clone()
    t.register(arena, LAYOUT)
    return t


def test_the_tcp_listener_spends_no_thread_on_a_bad_hello():
    a, b = _transport("a", Sealer(SECRET), hello_timeout_s=0.5), _transport("b", Sealer(SECRET))
    intruder = _transport("x", Sealer(b"y" * 32))
    try:
        for t, o in ((a, b), (b, a), (intruder, a)):
            t.add_peer(o.metadata())
        threads = threading.active_count()
        host, port = a.address
        rng = random.Random(3)
        socks = []
        for i in range(40):
            s = socket.create_connection((host, port))
            if i % 4 == 0:
                s.sendall(struct.pack("!I", 1 << 30))              # announces a gigabyte
            elif i % 4 == 1:
                s.sendall(struct.pack("!I", 64) + rng.randbytes(64))
            elif i % 4 == 2:
                s.sendall(rng.randbytes(rng.randrange(1, MAX_HELLO)))
            socks.append(s)                                         # i % 4 == 3: says nothing (slow loris)
        # A peer with another secret is refused too; its read fails, the transfer does not hang.
        bad = intruder.read("a", [0], [1])
        for _ in range(100):
            if bad.future.done():
                break
            time.sleep(0.05)
        assert bad.future.exception() is not None
        time.sleep(1.0)                                             # past the hello timeout
        assert threading.active_count() <= threads + 1              # no thread per connection
        assert a.refused >= 41
        assert all(s.recv(10) == b"" for s in socks)                # every one was closed
        ok = b.read("a", [2], [5])                                  # a real peer is still served
        ok.future.result(10)
        assert torch.equal(b.arena[:, :, 5], a.arena[:, :, 2])
        for s in socks:
            s.close()
    finally:
        for t in (a, b, intruder):
            t.close()


def test_the_token_listener_drops_bad_peers_and_keeps_serving():
    """A frontend's token listener (deltas from workers): random bytes, a huge length, a wrong
    hello secret and a bad record each close that connection; a real worker's frames still arrive."""
    import asyncio
    from cluster.token_stream import STREAM_VERSION, KeyedDelta, StreamBroken, TokenReceiver, TokenSender, \
        encode_step
    from cluster.types import TokenDelta

    async def go():
        receiver = TokenReceiver("f", host="127.0.0.1")
        address = await receiver.start()
        rng = random.Random(4)
        hostile = [rng.randbytes(200), struct.pack(">I", 1 << 30) + b"x" * 100,
                   _frame([STREAM_VERSION, "hello", ["w", b"wrong-secret"]]), _frame([STREAM_VERSION, "step", []])]
        for data in hostile:
            r, w = await asyncio.open_connection(address.host, address.port)
            w.write(data)
            await w.drain()
            assert await asyncio.wait_for(r.read(), 5) == b""        # closed by the listener
            w.close()
        key, queue = receiver.open("req")
        sender = TokenSender("worker")
        await asyncio.to_thread(sender.send, address, encode_step([KeyedDelta(key, TokenDelta("req", (5,), "x"))]))
        items = await asyncio.wait_for(queue.take(), 5)
        assert items[0].token_ids == (5,)
        sender.send(address, _frame([STREAM_VERSION, "step", [[key, "not-a-list", 3, "bogus", None, 0, 0, 0, None]]]))
        broken = await asyncio.wait_for(queue.take(), 5)             # its stream fails at once, not at a timeout
        assert isinstance(broken[0], StreamBroken) and "token_ids" in str(broken[0])
        await asyncio.sleep(0.2)                                     # a bad record drops that connection only
        assert len(receiver.connections) == 0 and receiver.refused == len(hostile) + 1
        sender.close()
        await receiver.stop()
    asyncio.run(go())


def _frame(body) -> bytes:
    data = msgpack.packb(body, use_bin_type=True)
    return struct.pack(">I", len(data)) + data
