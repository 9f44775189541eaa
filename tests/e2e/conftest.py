import multiprocessing as mp
import os
import signal

import msgpack
import pytest

import kv_worker


class Worker:
    """One kv_worker process, driven over a pipe with msgpack."""

    def __init__(self, model_dir, transport, name, **kwargs):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=kv_worker.serve, args=(child, str(model_dir), transport, name),
                                kwargs=kwargs, daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("worker did not start")
        msgpack.unpackb(self.conn.recv_bytes())
        self.name = name

    def call(self, op, timeout=60, **kwargs):
        self.conn.send_bytes(msgpack.packb({"op": op, **kwargs}))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: {op} did not answer within {timeout}s")
        reply = msgpack.unpackb(self.conn.recv_bytes())
        if not reply["ok"]:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def send(self, op, **kwargs):
        self.conn.send_bytes(msgpack.packb({"op": op, **kwargs}))

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(msgpack.packb({"op": "exit"}))
                self.proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        if self.proc.is_alive():
            self.kill()


@pytest.fixture
def spawn_worker(tiny_model_dir):
    started = []

    def start(transport, name, kind="llama", **kwargs):
        w = Worker(tiny_model_dir(kind), transport, name, **kwargs)
        started.append(w)
        return w
    yield start
    for w in started:
        w.close()


def connect(a: Worker, b: Worker) -> None:
    assert "peer" in a.call("add_peer", meta=b.call("meta"))
    assert "peer" in b.call("add_peer", meta=a.call("meta"))
