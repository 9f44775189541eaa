"""`splitserve serve` as a user runs it: a subprocess that starts Ray, serves gRPC, answers, exits."""
import subprocess
import sys


def _raylets() -> set[str]:
    out = subprocess.run(["pgrep", "-f", "ray/raylet"], capture_output=True, text=True).stdout
    return set(out.split())


def test_serve_answers_a_request_like_the_single_engine_and_leaves_no_ray(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    prompt = "def add(a, b):"
    before = _raylets()
    served = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--model", model, "--port", "0",
                             "--transport", "tcp", "--request", prompt, "--max-tokens", "12"],
                            capture_output=True, text=True, timeout=240)
    assert served.returncode == 0, served.stderr[-2000:]
    alone = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--model", model, "--max-tokens", "12",
                            prompt], capture_output=True, text=True, timeout=120, check=True)
    assert served.stdout == alone.stdout
    assert "(1 prefill + 1 decode, KV over tcp)" in served.stderr
    assert not _raylets() - before, "the Ray it started was left running"


def _workers() -> set[str]:
    out = subprocess.run(["pgrep", "-f", "ray::(Decode|Prefill)Worker"], capture_output=True, text=True).stdout
    return set(out.split())


def test_sigterm_ends_streams_in_flight_clearly_and_leaves_no_process():
    """The default model (slow enough that a long stream is still running when the signal lands):
    the stream ends with UNAVAILABLE saying why, the server exits 0, and neither Ray nor a worker
    process it started is left."""
    import os
    import re
    import signal
    import threading
    import time

    import grpc

    from router.client import Client
    before, workers_before = _raylets(), _workers()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", "0", "--transport", "tcp"],
                            stderr=subprocess.PIPE, text=True)
    try:
        target = None
        deadline = time.monotonic() + 240
        while target is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            match = re.search(r"--server (\S+:\d+)", line)
            if match:
                target = match.group(1)
        assert target, "serve never printed where it listens"
        threading.Thread(target=proc.stderr.read, daemon=True).start()    # keep its pipe drained
        got, error = [], None
        try:
            for msg in Client(target).stream("def fibonacci(n):", max_tokens=600, ignore_eos=True, timeout=120):
                got.extend(msg.token_ids)
                if len(got) >= 3 and proc.poll() is None and not error:
                    proc.send_signal(signal.SIGTERM)
                    error = "sent"
        except grpc.RpcError as exc:
            error = exc
        assert isinstance(error, grpc.RpcError), f"the stream ended without an error after {len(got)} tokens"
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.details()
        assert 3 <= len(got) < 600
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    limit = time.monotonic() + 20
    while (_raylets() - before or _workers() - workers_before) and time.monotonic() < limit:
        time.sleep(0.2)
    assert not _raylets() - before, "the Ray it started was left running"
    assert not _workers() - workers_before, "a worker process was left running"
