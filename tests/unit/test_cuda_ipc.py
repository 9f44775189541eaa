"""The CUDA IPC transport: a host arena is refused with a clear message; on CUDA, a second process
reads the first one's blocks GPU to GPU (the GPU check runs that case)."""
import subprocess
import sys
import textwrap

import pytest
import torch

from cluster.transfer.base import TransferError, TransferStatus
from cluster.transfer.registry import make_transport
from cluster.types import KVLayout

LAYOUT = KVLayout(model_id="m", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
SHAPE = (2, 2, 8, 4, 2, 16)


def _pattern() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.int16).view(SHAPE).view(torch.bfloat16)


def test_a_host_arena_is_refused():
    transport = make_transport("cuda_ipc", "a")
    try:
        with pytest.raises(TransferError, match="moves device memory"):
            transport.register(torch.zeros(SHAPE, dtype=torch.bfloat16), LAYOUT)
    finally:
        transport.close()


SERVER = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = sys.argv[1:]
    from cluster.transfer.registry import make_transport
    from test_cuda_ipc import LAYOUT, _pattern
    arena = _pattern().cuda()
    t = make_transport("cuda_ipc", "server")
    t.register(arena, LAYOUT)
    print(t.metadata().hex(), flush=True)
    t.add_peer(bytes.fromhex(sys.stdin.readline()))
    sys.stdin.readline()          # the client is done
    print(len(t.notifications()), flush=True)
    t.close()
""")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocks_cross_processes_gpu_to_gpu():
    from pathlib import Path
    here = Path(__file__).resolve()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(here.parents[2]), str(here.parent)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client = make_transport("cuda_ipc", "client")
    try:
        arena = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
        client.register(arena, LAYOUT)
        peer = client.add_peer(bytes.fromhex(server.stdout.readline()))
        server.stdin.write(client.metadata().hex() + "\n")
        server.stdin.flush()
        x = client.read(peer, [1, 6, 3], [0, 2, 5])
        while client.poll(x) is TransferStatus.PENDING:
            pass
        assert client.poll(x) is TransferStatus.DONE
        want = _pattern()
        for local, remote in ((0, 1), (2, 6), (5, 3)):
            assert torch.equal(arena[:, :, local].cpu(), want[:, :, remote])
        assert not arena[:, :, 1].any()
        _read_behind_a_busy_stream(client, peer, arena, want)
        client.notify(peer, b"done?")
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "1"
    finally:
        client.close()
        server.wait(30)


def _read_behind_a_busy_stream(client, peer, arena, want):
    """A read queued behind other work on the transport's stream, while the current stream
    allocates and overwrites memory at once: index tensors made on the current stream (and freed
    when `read` returns) would be handed out again and hold 3s by the time the copy runs."""
    with torch.cuda.stream(client._stream):
        torch.cuda._sleep(500_000_000)   # ~0.3 s of GPU time ahead of the copy
    x = client.read(peer, [4, 7], [6, 7])
    junk = [torch.full((n,), 3, dtype=torch.long, device="cuda") for n in (2, 4, 8, 16, 64) for _ in range(4)]
    while client.poll(x) is TransferStatus.PENDING:
        pass
    assert client.poll(x) is TransferStatus.DONE
    assert torch.equal(arena[:, :, 6].cpu(), want[:, :, 4]) and torch.equal(arena[:, :, 7].cpu(), want[:, :, 7])
    del junk
