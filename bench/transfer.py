"""KV transfer throughput between two processes, per transport, beside an in-process memcpy.

    python bench/transfer.py [--sizes-mib 1 4 16 64 256] [--transports nixl ucx tcp] [--layout default|llama8b]
    python bench/transfer.py --device cuda --transports cuda_ipc      # GPU to GPU between two processes

`nixl+thread` is NIXL with its busy progress thread on (the library's default, off in splitserve).

A server process registers a KV arena filled with random bytes; this process pulls blocks from it
(non-contiguous: every other block) and times each read. The memcpy column copies the same
segments between two arenas inside one process (torch index_copy), the limit on this machine.
The flat column is one contiguous memcpy of as many bytes. The checksum column is the cost of verifying the payload (xxh3 per block), as a share of the
transfer time. The layout sets the segment size: `default` is the shipped model's (6 layers,
2 KV heads, head dim 64, bf16: 4 KiB segments), `llama8b` a Llama-3-8B's (32 layers, 8 KV heads,
head dim 128: 32 KiB segments).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


LAYOUTS = {"default": (6, 2, 64), "llama8b": (32, 8, 128)}


DEVICE = os.environ.get("BENCH_TRANSFER_DEVICE", "cpu")   # set by --device; the server process inherits it


def _sync() -> None:
    if DEVICE != "cpu":
        import torch
        torch.cuda.synchronize()


def _arena(layout_name: str, num_blocks: int):
    import torch
    from cluster.types import KVLayout
    layers, heads, dim = LAYOUTS[layout_name]
    layout = KVLayout(model_id=f"bench-{layout_name}", num_layers=layers, num_kv_heads=heads, head_dim=dim,
                      block_size=16, dtype="bfloat16")
    arena = torch.empty((layers, 2, num_blocks, 16, heads, dim), dtype=torch.bfloat16, device=DEVICE)
    return layout, arena


def server(conn, transport: str, layout_name: str, num_blocks: int) -> None:
    import torch
    torch.set_num_threads(1)
    from cluster.transfer.registry import make_transport
    layout, arena = _arena(layout_name, num_blocks)
    arena.view(torch.int16).random_()
    from cluster.transfer.base import PollBackoff
    kind, options = _kind(transport)
    t = make_transport(kind, f"bench-server-{transport}", **options)
    t.register(arena, layout)
    conn.send_bytes(t.metadata())
    peer_meta = conn.recv_bytes()
    t.add_peer(peer_meta)
    conn.send_bytes(b"ready")
    # Until the client is done, poll as a producer does while a lease is live (its polls drive UCX
    # progress on this side: a first connection's wire-up, reads emulated over tcp).
    backoff = PollBackoff()
    while not conn.poll(backoff.next(True, bool(t.notifications()))):
        pass
    conn.recv_bytes()
    t.close()


def _kind(transport: str) -> tuple:
    """`nixl+thread`: NIXL with its busy progress thread (the library's default, off in splitserve)."""
    return ("nixl", {"progress_thread": True}) if transport == "nixl+thread" else (transport, {})


def run_transport(transport: str, layout_name: str, sizes_mib: list[int], repeats: int) -> dict[int, float]:
    from cluster.transfer.base import TransferStatus
    from cluster.transfer.registry import make_transport
    layout, _ = _arena(layout_name, 1)
    per_block = layout.bytes_per_block()
    max_blocks = max(sizes_mib) * (1 << 20) // per_block
    num_blocks = 2 * max_blocks + 2
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server, args=(child, transport, layout_name, num_blocks), daemon=True)
    proc.start()
    _, arena = _arena(layout_name, num_blocks)
    arena.zero_()
    kind, options = _kind(transport)
    t = make_transport(kind, f"bench-client-{transport}", **options)
    t.register(arena, layout)
    peer = t.add_peer(parent.recv_bytes())
    parent.send_bytes(t.metadata())
    parent.recv_bytes()
    out = {}
    for mib in sizes_mib:
        n = max(1, mib * (1 << 20) // per_block)
        remote = list(range(0, 2 * n, 2))          # every other block: non-contiguous
        local = list(range(1, 2 * n, 2))
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            x = t.read(peer, remote, local)
            while (s := t.poll(x)) is TransferStatus.PENDING:
                time.sleep(0.00005)   # yield the GIL: tcp/ucx move bytes on Python threads
            times.append(time.perf_counter() - t0)
            t.release(x)
            assert s is TransferStatus.DONE, f"{transport} read failed"
        out[mib] = n * per_block / statistics.median(times[1:]) / 1e9
    parent.send_bytes(b"done")
    proc.join(10)
    t.close()
    return out


def memcpy_and_checksum(layout_name: str, sizes_mib: list[int], repeats: int):
    import torch
    from cluster.transfer.checksum import block_checksums
    layout, _ = _arena(layout_name, 1)
    per_block = layout.bytes_per_block()
    max_blocks = max(sizes_mib) * (1 << 20) // per_block
    _, src = _arena(layout_name, 2 * max_blocks + 2)
    _, dst = _arena(layout_name, 2 * max_blocks + 2)
    src.view(torch.int16).random_()
    copy, check, flat = {}, {}, {}
    for mib in sizes_mib:
        a = torch.empty(mib << 20, dtype=torch.uint8, device=DEVICE).random_(0, 255)
        b = torch.empty_like(a)
        ftimes = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            b.copy_(a)
            _sync()
            ftimes.append(time.perf_counter() - t0)
        flat[mib] = a.numel() / statistics.median(ftimes[1:]) / 1e9
        n = max(1, mib * (1 << 20) // per_block)
        s = torch.arange(0, 2 * n, 2, device=DEVICE)
        d = torch.arange(1, 2 * n, 2, device=DEVICE)
        times, ctimes = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for layer in range(src.shape[0]):
                dst[layer].index_copy_(1, d, src[layer].index_select(1, s))
            _sync()
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            block_checksums(src, s.tolist())
            ctimes.append(time.perf_counter() - t0)
        copy[mib] = n * per_block / statistics.median(times[1:]) / 1e9
        check[mib] = n * per_block / statistics.median(ctimes[1:]) / 1e9
    return copy, check, flat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--transports", nargs="+", default=["nixl", "ucx", "tcp"])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="where the arenas live (cuda: with --transports cuda_ipc)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = os.environ["BENCH_TRANSFER_DEVICE"] = args.device
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import torch
    torch.set_num_threads(1)
    copy, check, flat = memcpy_and_checksum(args.layout, args.sizes_mib, args.repeats)
    print("# in-process copy, GB/s: " + ", ".join(f"{mib} MiB {copy[mib]:.2f}" for mib in args.sizes_mib), flush=True)
    results = {}
    for tr in args.transports:   # each transport's figures as soon as it has them: a run cut short keeps them
        results[tr] = run_transport(tr, args.layout, args.sizes_mib, args.repeats)
        print(f"# {tr}, GB/s: " + ", ".join(f"{mib} MiB {results[tr][mib]:.2f}" for mib in args.sizes_mib), flush=True)
    print(f"# KV pull between two processes, {args.device} arenas, layout {args.layout}, GB/s (ratio to the in-process copy of the same "
          f"segments); flat = one contiguous memcpy of as many bytes")
    head = f"{'MiB':>5} | {'flat':>6} | {'memcpy':>7} | " + " | ".join(f"{tr:>14}" for tr in args.transports)
    print(head + f" | {'checksum GB/s':>13} | {'checksum / nixl time':>20}")
    for mib in args.sizes_mib:
        cells = " | ".join(f"{results[tr][mib]:>6.2f} ({results[tr][mib] / copy[mib]:>4.0%})" for tr in args.transports)
        ref = results.get("nixl", next(iter(results.values())))[mib]
        print(f"{mib:>5} | {flat[mib]:>6.2f} | {copy[mib]:>7.2f} | {cells} | {check[mib]:>13.2f} | {ref / check[mib]:>20.0%}")


if __name__ == "__main__":
    main()
