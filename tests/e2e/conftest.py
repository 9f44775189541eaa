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
        self.name = name
        self.asked_to_exit = False
        self.started = False   # its ready message is read on first use: a test's workers start together

    def _wait_started(self):
        if self.started:
            return
        if not self.conn.poll(120):
            raise RuntimeError(f"{self.name}: worker did not start")
        msgpack.unpackb(self.conn.recv_bytes())
        self.started = True

    def call(self, op, timeout=60, **kwargs):
        self._wait_started()
        self.conn.send_bytes(msgpack.packb({"op": op, **kwargs}))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: {op} did not answer within {timeout}s")
        reply = msgpack.unpackb(self.conn.recv_bytes())
        if not reply["ok"]:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def send(self, op, **kwargs):
        self._wait_started()
        self.conn.send_bytes(msgpack.packb({"op": op, **kwargs}))

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def ask_to_exit(self):
        if self.proc.is_alive() and not self.asked_to_exit:
            self.asked_to_exit = True
            try:
                self.conn.send_bytes(msgpack.packb({"op": "exit"}))
            except (BrokenPipeError, OSError):
                pass

    def close(self):
        self.ask_to_exit()
        self.proc.join(10)
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
    for w in started:   # all asked first: they wind down together
        w.ask_to_exit()
    for w in started:
        w.close()


def connect(a: Worker, b: Worker) -> None:
    assert "peer" in a.call("add_peer", meta=b.call("meta"))
    assert "peer" in b.call("add_peer", meta=a.call("meta"))
