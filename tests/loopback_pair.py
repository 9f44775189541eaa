"""A prefill worker and a decode worker in this process, joined over the loopback transport: the
in-process P/D handoff that integration tests drive without Ray."""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cluster.config import CacheConfig, DataPlaneConfig, EngineConfig, WorkerConfig
from cluster.token_stream import TokenReceiver
from decode.worker import DecodeWorker
from prefill.worker import PrefillWorker

_names = itertools.count()


@contextmanager
def loopback_pair(model_dir: Path, block_size: int, num_blocks: int = 64) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    """Float32, one thread each; unique agent names; both closed after."""
    cfg = WorkerConfig(engine=EngineConfig(model=model_dir, dtype="float32", num_threads=1,
                                           cache=CacheConfig(block_size=block_size, num_blocks=num_blocks)),
                       data_plane=DataPlaneConfig(transport="loopback"))
    n = next(_names)
    prefill, decode = PrefillWorker(f"lp{n}", cfg), DecodeWorker(f"ld{n}", cfg)
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


async def connect(prefill: PrefillWorker, decode: DecodeWorker) -> TokenReceiver:
    """Each side knows the other; a started token receiver for the decode worker's stream."""
    await decode.add_peer(prefill.metadata())
    await prefill.add_peer(decode.metadata())
    receiver = TokenReceiver("f")
    await receiver.start()
    return receiver
