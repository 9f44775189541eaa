"""KV block checksums: xxh3 in place on host memory, a position-weighted sum on device memory
(exercised here through its torch path on CPU, and on CUDA in the GPU check); either catches a
flipped bit and a moved block. A handle's lease exists only once its checksums are computed."""
import pytest
import torch

from cluster.transfer import checksum
from cluster.transfer.base import ArenaGeometry
from cluster.transfer.checksum import block_checksums

from test_handoff_policy import Clock, Side


def _arena(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 8, 4, 2, 16, generator=g).to(dtype)   # layers, k/v, blocks, slots, heads, dim


def _both(arena, blocks):
    geo = ArenaGeometry.of(arena)
    layers = list(range(geo.num_layers))
    return {"host": block_checksums(arena, blocks), "device": checksum._device_checksums(arena, geo, blocks, layers)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_kind_catches_a_flipped_bit_and_a_moved_block(dtype):
    arena = _arena(dtype=dtype)
    blocks = [1, 4, 6]
    before = _both(arena, blocks)
    assert before == _both(arena.clone(), blocks)                  # the same bytes, the same digests
    flipped = arena.clone()
    words = flipped.view(torch.int16)
    words[2, 1, 4, 3, 1, 5] ^= 1 << 9                              # one bit of block 4, last layer's V
    after = _both(flipped, blocks)
    for kind in before:
        assert [a != b for a, b in zip(before[kind], after[kind])] == [False, True, False], kind
    swapped = arena.clone()
    swapped[:, :, [1, 4]] = arena[:, :, [4, 1]]
    moved = _both(swapped, [4, 1, 6])
    assert moved == before                                          # digests follow the bytes...
    assert _both(swapped, blocks)["device"][:2] != before["device"][:2]   # ...not the block ids


def test_swapping_two_words_of_a_segment_changes_the_device_sum():
    seg = torch.arange(1, 65, dtype=torch.int16).view(1, -1)
    swapped = seg.clone()
    swapped[0, [3, 40]] = seg[0, [40, 3]]
    assert checksum.position_weighted_sums(seg) != checksum.position_weighted_sums(swapped)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_checksums_on_cuda_equal_the_same_arithmetic_on_cpu():
    arena = _arena()
    geo = ArenaGeometry.of(arena)
    on_gpu = block_checksums(arena.cuda(), [0, 3, 7])
    assert on_gpu == checksum._device_checksums(arena, geo, [0, 3, 7], list(range(geo.num_layers)))


def test_a_failed_checksum_leaves_no_lease(monkeypatch):
    side = Side(Clock())
    try:
        monkeypatch.setattr(side.producer, "_checksums", lambda blocks: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError):
            side.publish("r1")
        assert side.producer.leases == {}
    finally:
        side.close()
