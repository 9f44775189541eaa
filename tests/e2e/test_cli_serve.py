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


def test_serve_until_ctrl_c_then_nothing_left(tiny_model_dir):
    import os
    import re
    import signal
    import time

    from router.client import Client
    before = _raylets()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--model", str(tiny_model_dir("llama")),
                             "--port", "0", "--transport", "tcp"], stderr=subprocess.PIPE, text=True)
    try:
        target = None
        deadline = time.monotonic() + 180
        while target is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            match = re.search(r"--server (\S+:\d+)", line)
            if match:
                target = match.group(1)
        assert target, "serve never printed where it listens"
        out = Client(target).generate("def add(a, b):", max_tokens=4)
        assert len(out.token_ids) == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert not _raylets() - before, "the Ray it started was left running"
