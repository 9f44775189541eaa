"""The chaos benchmark's load generator (bench/chaos.py starts it), in its own process so that
its CPU is measured apart from the router's.

    python bench/chaos_load.py SPEC.json OUT.json

SPEC: {"target": "127.0.0.1:PORT", "concurrency": C, "duration": S, "grace": G, "run": "ref",
"requests": [{"i", "kind", "prompt", "sampling", "timeout", "cancel_after"}, ...]}. C coroutines
take requests in order from one shared list over the gRPC aio stub (router/client.py's
`build_request`). No request is started after S seconds; requests still running G seconds after
that are cancelled and reported with code "UNFINISHED". A request with `cancel_after` k is
cancelled by the client once k tokens have streamed; `timeout` is the gRPC deadline.

OUT: {"wall_s", "cpu_s" (this process, getrusage: user + system, all threads), "not_sent",
"results": [{"i", "kind", "code" (a grpc.StatusCode name, or UNFINISHED), "details", "tokens",
"finish_reason", "sent", "ttft", "e2e"}, ...]}: times in seconds from the run's start.
"""
from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # router/, proto/ of this tree


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _one(stub, req: dict, run: str, t0: float, calls: dict) -> dict:
    import grpc
    from router.client import build_request
    from router.finish_reasons import from_proto
    msg = build_request(req["prompt"], f"{run}-{req['i']}", **req["sampling"])
    if req.get("empty_prompt"):
        msg.token_ids.SetInParent()                # the oneof set, with no ids in it
    sent = time.perf_counter()
    out = {"i": req["i"], "kind": req["kind"], "code": "OK", "details": "", "tokens": [], "finish_reason": "",
           "sent": sent - t0, "ttft": None, "e2e": None}
    call = stub.Generate(msg, timeout=req.get("timeout"))
    calls[req["i"]] = call
    cancel_after = req.get("cancel_after")
    try:
        async for resp in call:
            if out["ttft"] is None and resp.token_ids:
                out["ttft"] = time.perf_counter() - sent
            out["tokens"].extend(resp.token_ids)
            if resp.finish_reason:
                reason = from_proto(resp.finish_reason)
                out["finish_reason"] = reason.value if reason is not None else str(resp.finish_reason)
            if cancel_after is not None and len(out["tokens"]) >= cancel_after and not out["finish_reason"]:
                call.cancel()
                out["code"] = "CANCELLED"
                break
    except asyncio.CancelledError:
        out["code"] = "UNFINISHED"
        call.cancel()
    except grpc.aio.AioRpcError as exc:
        out["code"], out["details"] = exc.code().name, (exc.details() or "")[:200]
    except Exception as exc:  # noqa: BLE001 - reported, never fatal to the run
        out["code"], out["details"] = "CLIENT_ERROR", repr(exc)[:200]
    finally:
        calls.pop(req["i"], None)
    if out["code"] == "OK" and out["finish_reason"]:
        out["e2e"] = time.perf_counter() - sent
    elif out["code"] == "OK":
        out["code"] = "NO_FINISH"                  # the stream ended without a finish reason
    return out


async def run(spec: dict) -> dict:
    import grpc
    from proto.splitserve.v1 import inference_pb2_grpc as pb_grpc
    channel = grpc.aio.insecure_channel(spec["target"])
    stub = pb_grpc.InferenceStub(channel)
    todo = list(reversed(spec["requests"]))
    results, calls, tasks = [], {}, set()
    t0 = time.perf_counter()
    stop_at = t0 + spec["duration"]
    total = len(todo)

    async def stream():
        while todo and time.perf_counter() < stop_at:
            task = asyncio.ensure_future(_one(stub, todo.pop(), spec["run"], t0, calls))
            tasks.add(task)
            try:
                results.append(await asyncio.shield(task))
            except asyncio.CancelledError:
                results.append(await task)         # _one turns its own cancellation into UNFINISHED
                raise
            finally:
                tasks.discard(task)
            if len(results) % max(1, total // 20) == 0:
                print(f"\r  {spec['run']}: {len(results)}/{total}", end="", file=sys.stderr, flush=True)
    workers = [asyncio.ensure_future(stream()) for _ in range(spec["concurrency"])]
    done, pending = await asyncio.wait(workers, timeout=spec["duration"] + spec["grace"])
    for task in list(tasks):                       # past the grace period: cancel what still runs
        task.cancel()
    for w in pending:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    wall = time.perf_counter() - t0
    print(f"\r  {spec['run']}: {len(results)}/{total} in {wall:.1f} s", file=sys.stderr, flush=True)
    await channel.close()
    return {"wall_s": wall, "not_sent": len(todo), "results": sorted(results, key=lambda r: r["i"])}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    c0 = _cpu_seconds()
    out = asyncio.run(run(spec))
    out["cpu_s"] = _cpu_seconds() - c0
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
