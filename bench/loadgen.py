"""Closed-loop load generator, run as its own process so that the CPU it burns is measured apart.

    python bench/loadgen.py SPEC.json OUT.json

SPEC is a JSON object: {"backend": "openai_http" | "splitserve" | "engine", "target": ..., "max_tokens": N,
"warmup": {"concurrency": C, "prompts": [[ids], ...]}, "levels": [{"concurrency": C, "prompts":
[[ids], ...]}, ...]} plus, for openai_http, "model" (the served model name); for engine, optionally
"threads" (absent or null: the engine's default); and optionally "server": {"pid": the server's
leader process, "kind": "vllm" | "splitserve"}, to account the server's CPU per level.

  openai_http  target is http://HOST:PORT of an OpenAI-compatible server: `vllm serve`, or
               `splitserve serve --http-port` (bench/serve_vs_vllm.py's -http modes), both through
               this one code path so that they are measured by the same client. Streaming POST
               /v1/completions with token-id prompts, ignore_eos, return_token_ids (the token ids
               of each streamed choice) and stream_options.include_usage (the final usage chunk
               gives the server's own completion token count); one thread and `requests` session
               per stream (the system Python has no async HTTP client; `requests` comes with Ray, a
               dependency of the project). "vllm", its former name, is accepted as well.
  splitserve   target is HOST:PORT; router/client.py's AsyncClient (gRPC), one coroutine per stream
  engine       target is a model directory; cluster.engine.engine.LLMEngine in this process, one
               request at a time (batch 1): the ceiling that serving overhead is measured against

At each level C streams send requests back to back until the level's prompts run out. Every
request is greedy with ignore_eos, so each returns exactly max_tokens tokens. OUT holds, per level,
the wall time, this process's CPU seconds (getrusage, all threads) and one record per request:
send time, time to first token, inter-token gaps, token count and the token ids; with "server",
also "server_cpu": the CPU seconds of every process of the server over the level's timed window,
by role (frontend, engine, other) and by process (bench/proc_cpu.py).
"""
from __future__ import annotations

import asyncio
import json
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # router/, cluster/ of this tree
sys.path.append(str(Path(__file__).resolve().parent))         # proc_cpu; last, so bench/ shadows nothing


def _record(i: int, t0: float, sent: float, times: list[float], ids: list[int], reported: int | None) -> dict:
    if not times:
        raise RuntimeError(f"request {i} returned no tokens")
    return {"i": i, "sent": sent - t0, "ttft": times[0] - sent, "itl": [b - a for a, b in zip(times, times[1:])],
            "tokens": len(times), "done": times[-1] - t0, "token_ids": ids,
            "reported_tokens": len(ids) if reported is None else reported}


# --- OpenAI-compatible HTTP (vLLM, splitserve --http-port), server-sent events ---------------
def _openai_http_level(spec: dict, prompts: list, concurrency: int) -> list[dict]:
    import requests
    url = spec["target"].rstrip("/") + "/v1/completions"
    lock, results, errors = threading.Lock(), [], []
    todo = iter(enumerate(prompts))

    def one(session, i, prompt):
        body = {"model": spec["model"], "prompt": prompt, "max_tokens": spec["max_tokens"], "temperature": 0.0,
                "ignore_eos": True, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        times, ids, usage = [], [], None
        sent = time.perf_counter()
        with session.post(url, json=body, stream=True, timeout=600) as r:
            if r.status_code != 200:
                raise RuntimeError(f"POST {url} -> HTTP {r.status_code}: {r.text[:500]!r}")
            # chunk_size=None: hand over each HTTP chunk as it arrives (a fixed size would wait
            # for that many bytes and bunch tokens together).
            for line in r.iter_lines(chunk_size=None):
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(line[6:])
                if msg.get("error"):
                    raise RuntimeError(f"error event in the stream: {line[:500]!r}")
                if msg.get("usage"):
                    usage = msg["usage"]["completion_tokens"]
                for choice in msg.get("choices") or []:
                    if choice.get("text") and "token_ids" not in choice:
                        raise RuntimeError(f"a streamed choice without token_ids (return_token_ids ignored?): "
                                           f"{line[:300]!r}")
                    new = choice.get("token_ids") or []
                    ids.extend(new)
                    times.extend([now] * len(new))
        return _record(i, t0, sent, times, ids, usage)

    def stream():
        with requests.Session() as session:
            while True:
                with lock:
                    item = next(todo, None)
                if item is None:
                    return
                try:
                    rec = one(session, *item)
                except Exception as e:   # noqa: BLE001 - reported by the parent
                    errors.append(repr(e))
                    return
                with lock:
                    results.append(rec)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} HTTP request(s) to {spec['target']} failed, first: {errors[0]}")
    return results


# --- splitserve: the gRPC API --------------------------------------------------------------
def _splitserve_level(spec: dict, prompts: list, concurrency: int) -> list[dict]:
    from router.client import AsyncClient

    async def run() -> list[dict]:
        client = AsyncClient(spec["target"])
        todo, results = iter(enumerate(prompts)), []

        async def stream():
            for i, prompt in todo:   # one shared iterator: each stream takes the next prompt
                times, ids = [], []
                sent = time.perf_counter()
                async for msg in client.stream(prompt, max_tokens=spec["max_tokens"], temperature=0.0,
                                               ignore_eos=True):
                    now = time.perf_counter()
                    ids.extend(msg.token_ids)
                    times.extend([now] * len(msg.token_ids))
                results.append(_record(i, t0, sent, times, ids, None))
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(stream() for _ in range(concurrency)))
        finally:
            await client.close()
        return results
    return asyncio.run(run())


# --- the in-process engine, batch 1 --------------------------------------------------------
_ENGINE = None


def _engine_level(spec: dict, prompts: list, concurrency: int) -> list[dict]:
    global _ENGINE
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams
    if concurrency != 1:
        raise ValueError("the engine backend runs one request at a time")
    if _ENGINE is None:
        threads = {} if spec.get("threads") is None else {"num_threads": spec["threads"]}
        # The documented call, on the bf16 weights vLLM serves (a GGUF's converted directory would
        # otherwise be served from its stored blocks: --quantization auto).
        _ENGINE = LLMEngine.from_model_dir(spec["target"], dtype="bfloat16", quantization="none", **threads)
    sampling = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    results = []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        times, ids = [], []
        sent = time.perf_counter()
        for delta in _ENGINE.stream(prompt, sampling):
            now = time.perf_counter()
            ids.extend(delta.token_ids)
            times.extend([now] * len(delta.token_ids))
        results.append(_record(i, t0, sent, times, ids, None))
    return results


BACKENDS = {"openai_http": _openai_http_level, "vllm": _openai_http_level,   # "vllm": the former name
            "splitserve": _splitserve_level, "engine": _engine_level}


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _server_snapshot(server: dict) -> tuple[dict, float]:
    """The server's processes and their CPU now (bench/proc_cpu.py), and when."""
    import proc_cpu
    return proc_cpu.snapshot(server["pid"], server["kind"]), time.perf_counter()


def _server_cpu_since(server: dict, start: tuple[dict, float]) -> dict:
    import proc_cpu
    after, t1 = _server_snapshot(server)
    return proc_cpu.between(start[0], after, t1 - start[1]).to_json()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    level_fn = BACKENDS[spec["backend"]]
    if spec.get("warmup"):
        level_fn(spec, spec["warmup"]["prompts"], spec["warmup"]["concurrency"])
    out = []
    for level in spec["levels"]:
        # Read outside c0..c1, so the /proc reads are not the client's CPU; the server's window encloses the level.
        server_start = _server_snapshot(spec["server"]) if spec.get("server") else None
        c0, w0 = _cpu_seconds(), time.perf_counter()
        records = level_fn(spec, level["prompts"], level["concurrency"])
        out.append({"concurrency": level["concurrency"], "wall_s": time.perf_counter() - w0,
                    "cpu_s": _cpu_seconds() - c0, "results": sorted(records, key=lambda r: r["i"])})
        if server_start:
            out[-1]["server_cpu"] = _server_cpu_since(spec["server"], server_start)
        print(f"  {spec['backend']}: concurrency {level['concurrency']} done, {len(records)} requests in "
              f"{out[-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    Path(sys.argv[2]).write_text(json.dumps({"levels": out}))


if __name__ == "__main__":
    main()
