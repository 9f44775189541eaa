"""A worker process for transfer tests: a real engine, a real transport, a producer and a consumer.

The parent drives it over a pipe with msgpack messages (no pickle of our own). Between commands
the worker keeps polling its producer, as a prefill worker's loop would.
"""
from __future__ import annotations

import os
import time
import traceback

import msgpack


def serve(conn, model_dir: str, transport_kind: str, name: str, block_size: int = 4, num_blocks: int = 96,
          lease_seconds: float = 30.0, timeout_s: float = 10.0, dtype: str = "float32",
          max_batched_tokens: int = 64, secret: str = "kv-worker-test-cluster-secret-0123") -> None:
    """`secret`: the cluster secret that seals the KV plane, as a served cluster's workers run."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
    from cluster.engine.engine import LLMEngine
    from cluster.transfer.consumer import KVConsumer, PullState
    from cluster.transfer.auth import Sealer
    from cluster.transfer.messages import Mailbox
    from cluster.transfer.producer import KVProducer
    from cluster.transfer.registry import make_transport
    from cluster.types import KVHandle, SamplingParams
    from decode.handoff import add_prefilled
    from prefill.handoff import PrefillHandoff

    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, cache=CacheConfig(block_size=block_size,
                                                                                    num_blocks=num_blocks),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=max_batched_tokens)),
                       hold_factory=PrefillHandoff)
    sealer = Sealer(secret.encode())
    options = {"sealer": sealer} if transport_kind in ("tcp", "ucx") else {}
    transport = make_transport(transport_kind, name, **options)
    transport.register(engine.kv_cache.arena, engine.layout)
    mailbox = Mailbox(transport, sealer=sealer)
    hold = engine.hold_hook
    producer = KVProducer(transport, engine.layout, engine.kv_cache.arena, hold.lease_ended,
                          lease_seconds=lease_seconds, mailbox=mailbox)
    consumer = KVConsumer(transport, engine.layout, engine.kv_cache.arena, timeout_s=timeout_s, mailbox=mailbox)

    def run_to_end(rid: str) -> list[int]:
        out = []
        while engine.has_unfinished():
            for d in engine.step():
                if d.request_id == rid:
                    out.extend(d.token_ids)
        return out

    def handle(cmd: dict):
        op = cmd["op"]
        if op == "meta":
            return transport.metadata()
        if op == "add_peer":
            try:
                return {"peer": transport.add_peer(cmd["meta"])}
            except Exception as exc:  # noqa: BLE001 - reported to the test
                return {"error": f"{type(exc).__name__}: {exc}"}
        if op == "timed_prefill":
            t0 = time.perf_counter()
            raw = handle({**cmd, "op": "prefill"})
            return {"handle": raw, "prefill_s": time.perf_counter() - t0,
                    "checksum_s": producer.checksum_seconds}
        if op == "configure":   # a module's shared workers take each test's lease and pull limits
            producer.lease_seconds = float(cmd.get("lease_seconds", producer.lease_seconds))
            consumer.timeout_s = float(cmd.get("timeout_s", consumer.timeout_s))
            return {}
        if op == "set_verify":
            consumer.verify = producer.checksums = bool(cmd["on"])
            return {}
        if op == "prefill":
            sp = SamplingParams(max_tokens=1, temperature=cmd.get("temperature", 0.0), seed=cmd.get("seed"))
            rid = engine.add_request(cmd["prompt"], sp, request_id=cmd["rid"], hold_kv=True)
            first = None
            while engine.has_unfinished():
                for d in engine.step():
                    first = d.token_ids[0]
            return hold.publish(producer, rid, first)
        if op == "pull":
            h = KVHandle.decode(cmd["handle"])
            local = engine.pool.allocate(len(h.block_ids))
            pull = consumer.start_pull(h, local)
            prompt = cmd["prompt"]
            if cmd.get("abort_after_start"):
                consumer.abort(pull.lease_id)
            consumer.wait(pull)
            if pull.state is not PullState.DONE:
                engine.pool.free(reversed(pull.local_blocks))
                return {"state": pull.state.value, "error": pull.error}
            first = pull.handle.first_token
            if cmd.get("ready_only"):
                engine.pool.free(reversed(pull.local_blocks))
                t = pull.timings
                return {"state": "done", "ready_s": t["acked"] - t["start"], "read_s": t["read"] - t["start"],
                        "verify_s": t.get("verified", t["read"]) - t["read"]}
            if cmd.get("bytes_only"):
                data = engine.kv_cache.arena[:, :, pull.local_blocks].contiguous().view(torch.uint8).numpy().tobytes()
                engine.pool.free(reversed(pull.local_blocks))
                return {"state": "done", "bytes": data}
            add_prefilled(engine, cmd["rid"], prompt, first, SamplingParams(max_tokens=cmd["max_tokens"]),
                          pull.local_blocks)
            return {"state": "done", "tokens": [first] + run_to_end(cmd["rid"]), "timings": pull.timings}
        if op == "pull_and_hang":
            h = KVHandle.decode(cmd["handle"])
            consumer.start_pull(h, engine.pool.allocate(len(h.block_ids)))
            time.sleep(3600)
        if op == "source_bytes":
            h = KVHandle.decode(cmd["handle"])
            return engine.kv_cache.arena[:, :, list(h.block_ids)].contiguous().view(torch.uint8).numpy().tobytes()
        if op == "corrupt":
            h = KVHandle.decode(cmd["handle"])
            seg = engine.kv_cache.arena[cmd.get("layer", 0), 0, h.block_ids[cmd.get("index", 0)]]
            seg.view(torch.uint8).view(-1)[7] ^= 0x10
            return {}
        if op == "abort_producer":
            return {"found": producer.abort(cmd["rid"])}
        if op == "pool":
            producer.poll()
            return {"used": engine.pool.num_used, "held": len(hold.leases),
                    "leases": producer.num_active()}
        raise ValueError(f"unknown op {op}")

    conn.send_bytes(msgpack.packb({"ready": True}))
    while True:
        if conn.poll(0.002):
            cmd = msgpack.unpackb(conn.recv_bytes())
            if cmd["op"] == "exit":
                transport.close()
                conn.send_bytes(msgpack.packb({"bye": True}))
                return
            try:
                result = handle(cmd)
                conn.send_bytes(msgpack.packb({"ok": True, "result": result}))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                conn.send_bytes(msgpack.packb({"ok": False, "error": f"{exc}\n{traceback.format_exc()}"}))
        producer.poll()
        if consumer.pulls:
            consumer.poll()
