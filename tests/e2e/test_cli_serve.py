"""`splitserve serve` as a user runs it: a subprocess that starts Ray, serves gRPC, answers, exits."""
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


class Run:
    """One command's processes: its environment carries a tag that every process it starts (Ray's
    raylet, the worker actors) inherits, so what is left of it is told from any other Ray on the
    machine (this suite's own session Ray, another suite's)."""

    def __init__(self):
        self.tag = f"SPLITSERVE_TEST_RUN={uuid.uuid4().hex}".encode()
        name, value = self.tag.decode().split("=")
        self.env = {**os.environ, name: value}

    def processes(self, pattern: str) -> set[str]:
        pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        return {pid for pid in pids if self.tag in _environ(pid)}

    def raylets(self) -> set[str]:
        return self.processes("ray/raylet")

    def workers(self) -> set[str]:
        return self.processes("ray::(Decode|Prefill)Worker")


def _environ(pid: str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:   # gone meanwhile
        return []


@pytest.fixture(scope="module")
def generated(tiny_model_dir):
    """`splitserve generate` in-process, each distinct command run once for the module."""
    outputs = {}

    def run(*args: str) -> str:
        if args not in outputs:
            outputs[args] = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "generate", *args],
                                           capture_output=True, text=True, timeout=120, check=True).stdout
        return outputs[args]
    return run


def test_serve_answers_a_request_like_the_single_engine_and_leaves_no_ray(tiny_model_dir, generated):
    """With only the HTTP API (`--grpc-port none`): the request goes through its completions route."""
    model = str(tiny_model_dir("llama"))
    prompt = "def add(a, b):"
    run = Run()
    served = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "serve", "--model", model, "--grpc-port", "none",
                             "--http-port", "0", "--transport", "tcp", "--request", prompt, "--max-tokens", "12"],
                            capture_output=True, text=True, timeout=240, env=run.env)
    assert served.returncode == 0, served.stderr[-2000:]
    assert served.stdout == generated("--model", model, "--max-tokens", "12", prompt)
    assert "on 1 prefill + 1 decode workers, KV over tcp" in served.stderr
    assert "OpenAI API: http://127.0.0.1:" in served.stderr and "gRPC" not in served.stderr
    assert not run.raylets(), "the Ray it started was left running"


def test_sigterm_finishes_streams_in_flight_refuses_new_ones_and_leaves_no_process():
    """The suite's model on the default ports, as a vLLM user starts it: the banner's addresses
    answer (the OpenAI API on vLLM's port 8000, with max_model_len in /v1/models). SIGTERM (a
    Kubernetes pod deleted) is a graceful shutdown: readiness turns NOT_SERVING (liveness holds) and
    /health 503, a new
    request is refused with UNAVAILABLE saying why, the stream in flight runs to its last token,
    the server exits 0, and neither Ray nor a worker process it started is left."""
    import http.client
    import re
    import signal
    import threading
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from openai import OpenAI

    from router.client import Client
    run = Run()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.launch.cli", "serve", "--transport", "tcp",
                             "--drain-timeout", "120"], stderr=subprocess.PIPE, text=True, env=run.env)
    try:
        target, banner = None, []
        deadline = time.monotonic() + 240
        while target is None and time.monotonic() < deadline:
            banner.append(proc.stderr.readline())
            match = re.search(r"--server (\S+:\d+)", banner[-1])
            if match:
                target = match.group(1)
        assert target == "127.0.0.1:50051", "".join(banner)
        later: list[str] = []
        threading.Thread(target=lambda: later.extend(proc.stderr), daemon=True).start()   # keep its pipe drained
        assert "  OpenAI API: http://127.0.0.1:8000/v1 " in "".join(banner)
        model = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").models.list().data[0]
        from proto.splitserve.v1 import inference_pb2 as pb
        (served,) = Client(target).stub.ListModels(pb.ListModelsRequest()).models
        assert (model.id, model.max_model_len) == (served.id, served.max_model_len) and served.max_model_len > 0
        assert f"serving {model.id} on 1 prefill + 1 decode workers" in "".join(banner)
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
        got, finish, refused = [], None, None
        for msg in Client(target).stream("def fibonacci(n):", max_tokens=600, ignore_eos=True, timeout=180):
            got.extend(msg.token_ids)
            finish = msg.finish_reason or finish
            if len(got) >= 3 and refused is None:
                proc.send_signal(signal.SIGTERM)
                limit = time.monotonic() + 30
                ready = health_pb2.HealthCheckRequest(service="splitserve.v1.Inference")
                while health.Check(ready).status == health_pb2.HealthCheckResponse.SERVING:
                    assert time.monotonic() < limit, "still SERVING 30 s after SIGTERM"
                    time.sleep(0.05)
                alive = health.Check(health_pb2.HealthCheckRequest()).status    # liveness holds while draining
                assert alive == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.RpcError) as refused:
                    Client(target).generate("def add(a, b):", max_tokens=4)
                conn = http.client.HTTPConnection("127.0.0.1", 8000, timeout=10)
                conn.request("GET", "/health")
                assert conn.getresponse().status == 503
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
        assert len(got) == 600 and finish == pb.FINISH_REASON_LENGTH, (len(got), finish)
        assert proc.wait(timeout=60) == 0
        assert any("finishing the requests in flight" in line for line in later), "".join(later)[-2000:]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    limit = time.monotonic() + 20
    while (run.raylets() or run.workers()) and time.monotonic() < limit:
        time.sleep(0.2)
    assert not run.raylets(), "the Ray it started was left running"
    assert not run.workers(), "a worker process was left running"


def test_the_main_job_answers_a_question_with_the_real_default_model():
    """The README's main job as a new user runs it: no --model (SmolLM2-135M-Instruct from its
    GGUF), the question sent through the chat template, a sensible answer on stdout."""
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_MODEL"}
    served = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "serve", "--port", "0", "--http-port", "0",
                             "--transport", "tcp", "--request", "What is the capital of France?", "--max-tokens", "24",
                             "--seed", "1"],   # it samples (the model's chat settings): one seed, one answer
                            capture_output=True, text=True, timeout=600, env=env)
    assert served.returncode == 0, served.stderr[-2000:]
    assert "Paris" in served.stdout, served.stdout
    assert "SmolLM2-135M-Instruct" in served.stderr


def test_chat_and_generate_apply_the_models_template(tmp_path):
    """`splitserve chat` against a local cluster: two turns, each answered as the single engine
    answers the conversation rendered by the model's template; `generate` renders the same way."""
    from tiny_models import make_chat_model
    from cluster.launch.chat_cli import PromptBuilder
    from cluster.config import EngineConfig
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams
    model = make_chat_model(tmp_path / "chat", "llama")
    chat = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "chat", "--model", str(model), "--port", "0",
                           "--http-port", "none", "--transport", "tcp", "--max-tokens", "6", "--colocated",
                           "--temperature", "0"],
                          input="hello there\nand again\n/exit\n", capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr[-2000:]
    builder = PromptBuilder(model)
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", kernels="torch"))
    messages, want = [], []
    for line in ("hello there", "and again"):
        messages.append({"role": "user", "content": line})
        text = engine.generate([builder.conversation(messages)], SamplingParams(max_tokens=6))[0].text
        messages.append({"role": "assistant", "content": text})
        want.append(text)
    assert chat.stdout == "".join(f"> {t}\n" for t in want) + "> ", chat.stdout
    alone = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "generate", "--model", str(model), "--max-tokens",
                            "6", "hello there"], capture_output=True, text=True, timeout=120, check=True)
    assert alone.stdout == want[0] + "\n"


def test_serve_from_yaml_answers_like_the_flags(tiny_model_dir, tmp_path, generated):
    """The settings the README names, from a YAML file, reach a running cluster (it answers as
    `generate` does, through the gRPC API: the HTTP API is off)."""
    model = str(tiny_model_dir("llama"))
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"model: {model}\nport: 0\nhttp_port: none\ntransport: tcp\nunavailable_wait: 60\nlease_seconds: 20\n"
                   "transfer_timeout: 5\nenable_chunked_prefill: true\nngram_max: 3\nstall_timeout: 30\n")
    served = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "serve", "--config", str(cfg),
                             "--request", "def add(a, b):", "--max-tokens", "12"],
                            capture_output=True, text=True, timeout=240)
    assert served.returncode == 0, served.stderr[-2000:]
    assert served.stdout == generated("--model", model, "--max-tokens", "12", "def add(a, b):")
    assert "on 1 prefill + 1 decode workers, KV over tcp" in served.stderr and "OpenAI API" not in served.stderr


def test_a_port_in_use_is_refused_in_one_line_before_ray_starts(tiny_model_dir):
    import socket
    run = Run()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        served = subprocess.run([sys.executable, "-m", "cluster.launch.cli", "serve", "--model",
                                 str(tiny_model_dir("llama")), "--port", "0", "--http-port", str(port)],
                                capture_output=True, text=True, timeout=120, env=run.env)
    assert served.returncode == 2
    assert served.stderr == f"splitserve: error: --http-port 127.0.0.1:{port} is in use; give another port, or 0 " \
                            "for a free one\n"
    assert not run.raylets()
