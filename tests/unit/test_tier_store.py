"""The KV tiers' stores: the host tier's slots in LRU order, the disk tier's files (limit, restart
scan, half-written and malformed files), and the capacity plan's arithmetic."""
from __future__ import annotations

import os

import pytest
import torch

from cluster.config import CacheConfig
from cluster.kv.paged_cache import MemoryPlan
from cluster.kv.tier_plan import plan_tiers
from cluster.kv.tier_store import DiskTier, HostTier


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _payload(value: int, n: int = 64) -> memoryview:
    return memoryview(bytes([value]) * n)


def test_host_tier_reuses_the_least_recently_used_slot():
    host = HostTier(2, (4,), torch.float32, pin=False)
    for i in range(2):
        host.commit(_key(i), host.take_slot(), checksum=i)
    assert host.get(_key(0)).checksum == 0          # key 0 is now the most recent
    slot = host.take_slot()                         # full: key 1's slot is taken
    assert _key(1) not in host and _key(0) in host and slot is not None
    host.commit(_key(2), slot, checksum=2)
    host.drop(_key(0))
    assert len(host) == 1 and host.take_slot() is not None     # the dropped slot is free again
    assert host.take_slot() is not None and len(host) == 0      # then the last entry gives its slot up
    assert HostTier(0, (4,), torch.float32, pin=False).take_slot() is None


def test_disk_tier_round_trip_limit_and_restart(tmp_path):
    disk = DiskTier(tmp_path, "layout", limit=3 * 64)
    for i in range(4):                              # the fourth write evicts the oldest file
        assert disk.write(_key(i), _payload(i), checksum=100 + i)
    assert _key(0) not in disk and len(disk) == 3 and disk.bytes == 3 * 64
    assert not (tmp_path / "layout" / (_key(0).hex() + ".kv")).exists()
    out = bytearray(64)
    entry = disk.read_into(_key(2), memoryview(out))
    assert entry.checksum == 102 and bytes(out) == bytes([2]) * 64
    assert not disk.write(_key(9), _payload(9, n=4 * 64), checksum=0)    # larger than the tier

    (tmp_path / "layout" / ".partial.123.tmp").write_bytes(b"half a block")    # a killed writer's file
    (tmp_path / "layout" / "zz.kv").write_bytes(b"not a block")
    os.utime(tmp_path / "layout" / (_key(1).hex() + ".kv"), ns=(1, 1))        # the oldest on restart
    again = DiskTier(tmp_path, "layout", limit=2 * 64)
    assert again.recovered == 2 and _key(1) not in again                    # trimmed to the limit, oldest first
    assert sorted(p.name for p in (tmp_path / "layout").iterdir()) == sorted(
        _key(i).hex() + ".kv" for i in (2, 3))
    assert DiskTier(tmp_path, "other-layout", limit=1 << 20).recovered == 0


def test_a_truncated_block_file_is_dropped_not_read(tmp_path):
    disk = DiskTier(tmp_path, "layout", limit=1 << 20)
    disk.write(_key(1), _payload(1), checksum=1)
    path = tmp_path / "layout" / (_key(1).hex() + ".kv")
    path.write_bytes(path.read_bytes()[:-10])
    assert disk.read_into(_key(1), memoryview(bytearray(64))) is None
    assert _key(1) not in disk and not path.exists()


def test_capacity_plan_counts_blocks_and_names_the_flag(tmp_path):
    plan = MemoryPlan(budget_bytes=1 << 30, weight_bytes=0, activation_bytes=0, headroom_bytes=0,
                      bytes_per_block=1024, num_blocks=16, limit="--num-kv-blocks")
    cache = CacheConfig(kv_host_bytes=10 * 1024 + 5, kv_disk_dir=str(tmp_path), kv_disk_bytes=3 * 1024)
    tiers = plan_tiers(cache, plan, 1024, torch.device("cpu"))
    assert (tiers.host_blocks, tiers.disk_blocks) == (10, 3)
    assert "host 10 KiB (10 blocks" in tiers.describe() and "disk 3 KiB (3 blocks)" in tiers.describe()
    assert not plan_tiers(CacheConfig(), plan, 1024, torch.device("cpu")).enabled
    with pytest.raises(ValueError, match="--kv-disk-bytes 1 KiB is smaller than one KV block"):
        plan_tiers(CacheConfig(kv_disk_dir=str(tmp_path), kv_disk_bytes=1024), plan, 4096, torch.device("cpu"))
