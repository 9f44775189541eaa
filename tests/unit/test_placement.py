"""Threads and cores per worker (cluster/placement.py)."""
from cluster.placement import ROUTER_CORE_MIN_CPUS, CpuShare, local_worker_shares, worker_env


def test_a_small_node_gives_its_workers_every_core():
    assert local_worker_shares(1, None, [0, 1]) == [CpuShare(2, (0, 1))]            # colocated: both cores
    assert local_worker_shares(2, None, [0, 1]) == [CpuShare(1, (0,)), CpuShare(1, (1,))]   # one core each
    assert local_worker_shares(3, None, [0, 1]) == [CpuShare(1, None)] * 3          # no core of its own: unpinned


def test_a_large_node_is_split_evenly_after_one_core_for_the_router():
    shares = local_worker_shares(2, None, list(range(64)))
    assert [s.threads for s in shares] == [31, 31]
    assert shares[0].cpus == tuple(range(1, 32)) and shares[1].cpus == tuple(range(32, 63))
    assert local_worker_shares(1, None, list(range(ROUTER_CORE_MIN_CPUS - 1)))[0].threads == ROUTER_CORE_MIN_CPUS - 1


def test_explicit_threads_are_kept_and_pinned_only_when_they_fit():
    assert local_worker_shares(3, 4, list(range(16)))[2] == CpuShare(4, (9, 10, 11, 12))
    assert local_worker_shares(3, 8, list(range(16))) == [CpuShare(8, None)] * 3
    assert local_worker_shares(1, None, [5]) == [CpuShare(1, (5,))]


def test_workers_wait_passively_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert worker_env(CpuShare(2, (0, 1))) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env(CpuShare(1, None))["OMP_WAIT_POLICY"] == "ACTIVE"
