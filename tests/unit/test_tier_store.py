"""The KV tiers' stores: the host tier's slots in LRU order, the disk tier's files (limit, restart
scan, half-written and malformed files), and the capacity plan's arithmetic."""
from __future__ import annotations

import os

import pytest
import torch

from cluster.config import CacheConfig
from cluster.kv.paged_cache import MemoryPlan
from cluster.kv.tier_plan import plan_tiers
from cluster.kv.disk_io import NixlFileIO, PlainFileIO, make_file_io
from cluster.kv.tier_store import DiskTier, HostTier


def _nixl_io():
    try:
        return NixlFileIO(64)
    except Exception:  # noqa: BLE001
        pytest.skip("NIXL's POSIX backend does not load here")


IO = [pytest.param(PlainFileIO, id="plain"), pytest.param(_nixl_io, id="nixl-posix")]


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


@pytest.mark.parametrize("io", IO)
def test_disk_tier_round_trip_limit_and_restart(tmp_path, io):
    disk = DiskTier(tmp_path, "layout", limit=3 * 64, io=io())
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
    again = DiskTier(tmp_path, "layout", limit=2 * 64, io=io())
    assert again.recovered == 2 and _key(1) not in again                    # trimmed to the limit, oldest first
    assert sorted(p.name for p in (tmp_path / "layout").iterdir()) == sorted(
        _key(i).hex() + ".kv" for i in (2, 3))
    assert DiskTier(tmp_path, "other-layout", limit=1 << 20).recovered == 0


@pytest.mark.parametrize("io", IO)
def test_a_truncated_block_file_is_dropped_not_read(tmp_path, io):
    disk = DiskTier(tmp_path, "layout", limit=1 << 20, io=io())
    disk.write(_key(1), _payload(1), checksum=1)
    path = tmp_path / "layout" / (_key(1).hex() + ".kv")
    path.write_bytes(path.read_bytes()[:-10])
    assert disk.read_into(_key(1), memoryview(bytearray(64))) is None
    assert _key(1) not in disk and not path.exists()


def test_the_file_io_is_nixl_where_its_posix_backend_loads():
    io = make_file_io(64)
    assert io.name in ("nixl-posix", "plain")
    assert make_file_io(64, "plain").name == "plain"
    if io.name == "nixl-posix":
        disk_bytes = bytes(range(64))
        path = None
        import tempfile
        with tempfile.NamedTemporaryFile("wb", delete=False) as f:   # written by NIXL, read back plainly
            f.write(b"0123")
            io.write(f, 4, memoryview(disk_bytes))
            path = f.name
        with open(path, "rb") as f:
            assert f.read() == b"0123" + disk_bytes
        os.unlink(path)


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


def _shared(name: str, capacity: int = 4):
    from cluster.kv.shared_host import SharedHostTier
    return SharedHostTier(name, capacity, (8,), torch.float32, layout_tag="layout")


def test_a_shared_host_tier_is_one_index_for_every_mapping_of_it():
    import uuid
    from cluster.kv.shared_host import segment_path
    name = uuid.uuid4().hex[:12]
    a, b = _shared(name), _shared(name)
    try:
        slot = a.take_slot()
        a.slots[slot].fill_(7.0)
        a.commit(_key(1), slot, checksum=11)
        entry = b.get(_key(1))                       # the other worker finds it, bytes and checksum
        assert entry.checksum == 11 and bool((b.slots[entry.where] == 7.0).all()) and b.still(entry)
        for i in range(2, 6):                        # four more blocks through b: the LRU one (key 1) goes
            s = b.take_slot()
            b.commit(_key(i), s, checksum=i)
        assert _key(1) not in a and len(a) == 4 and not a.still(entry)   # a reader of key 1 sees it moved
        dup = a.take_slot()                          # the same key stored by two workers: one copy stays
        a.commit(_key(5), dup, checksum=5)
        assert len(a) == 3 and a.get(_key(5)).where != dup
        for i in (2, 3, 4, 5):                       # deletion keeps every other key reachable
            a.drop(_key(i))
            assert all(_key(k) in b for k in range(i + 1, 6))
        assert len(b) == 0
        with pytest.raises(ValueError, match="made for another model or size"):
            _shared(name, capacity=8)
    finally:
        a.close()
        b.close()
        segment_path(name).unlink()


def test_a_slot_left_writing_by_a_dead_worker_is_reclaimed():
    import subprocess
    import sys
    import uuid
    from cluster.kv.shared_host import segment_path
    name = uuid.uuid4().hex[:12]
    code = ("import torch; from cluster.kv.shared_host import SharedHostTier as T; "
            f"t = T({name!r}, 1, (8,), torch.float32, 'layout'); print(t.take_slot())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == "0", out.stderr
    tier = _shared(name, capacity=1)
    try:
        assert tier.take_slot() == 0                 # its writer exited mid-copy: the slot is free again
    finally:
        tier.close()
        segment_path(name).unlink()


def test_a_load_never_takes_more_blocks_than_are_free_once_its_cached_prefix_is_pinned():
    """The cached prefix's blocks that nobody holds sit in the free queue; pinning them for the load
    takes them out of it. The load is sized after that (it once was sized before, and a decode
    worker's prefetch failed with NoFreeBlocks: 'need 6 blocks, 1 free')."""
    from cluster.kv.block_pool import BlockPool
    from cluster.kv.tiers import KVTiers
    pool = BlockPool(10)
    keys = [_key(i) for i in range(12)]
    cached = pool.allocate(5)
    for block, key in zip(cached, keys):
        pool.cache_block(block, key)
    pool.free(reversed(cached))                      # cached, held by nobody: in the free queue
    held = pool.allocate(3)                          # 2 blocks free besides the 5 cached ones
    assert pool.num_free == 7
    arena = torch.zeros(1, 2, 10, 4)
    host = HostTier(8, (1, 2, 4), torch.float32, pin=False)
    for key in keys[5:11]:                           # the next 6 blocks are in the host tier
        host.commit(key, host.take_slot(), checksum=0)
    tiers = KVTiers(pool, arena, host, None)
    try:
        seq = type("Seq", (), {"is_finished": False})()
        assert tiers.prefetch(seq, keys, 11)         # loads what fits: 1 block, leaving one free
        assert pool.num_free == 1
        ready = []
        while not ready:
            tiers.wait(0.05)
            ready = tiers.poll()
        assert ready == [seq]
    finally:
        tiers.close()
    pool.free(reversed(held))
    pool.check_idle()                                # the load's pins and blocks all came back
