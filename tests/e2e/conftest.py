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


class WorkerSet:
    """Worker processes started on demand and closed together: a module's shared pairs and each
    test's extra ones (all asked to exit first, so they wind down together)."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.started: list[Worker] = []

    def start(self, transport, name, kind="llama", **kwargs) -> Worker:
        w = Worker(self.model_dir(kind), transport, name, **kwargs)
        self.started.append(w)
        return w

    def close(self):
        for w in self.started:
            w.ask_to_exit()
        for w in self.started:
            w.close()


@pytest.fixture(scope="module")
def worker_set(tiny_model_dir):
    workers = WorkerSet(tiny_model_dir)
    yield workers
    workers.close()


@pytest.fixture
def spawn_worker(tiny_model_dir):
    workers = WorkerSet(tiny_model_dir)
    yield workers.start
    workers.close()


def connect(a: Worker, b: Worker) -> None:
    assert "peer" in a.call("add_peer", meta=b.call("meta"))
    assert "peer" in b.call("add_peer", meta=a.call("meta"))
