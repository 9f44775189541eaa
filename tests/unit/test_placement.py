"""Threads and cores per worker (cluster/placement.py)."""
from cluster.placement import CpuShare, local_worker_shares


def test_two_cores_give_each_worker_one_thread():
    assert local_worker_shares(1, None, [0, 1]) == [CpuShare(1, (1,))]             # colocated: the router keeps core 0
    assert local_worker_shares(2, None, [0, 1]) == [CpuShare(1, None)] * 2          # no core of its own: unpinned


def test_a_large_node_is_split_evenly_after_one_core_for_the_router():
    shares = local_worker_shares(2, None, list(range(64)))
    assert [s.threads for s in shares] == [31, 31]
    assert shares[0].cpus == tuple(range(1, 32)) and shares[1].cpus == tuple(range(32, 63))


def test_explicit_threads_are_kept_and_pinned_only_when_they_fit():
    assert local_worker_shares(3, 4, list(range(16)))[2] == CpuShare(4, (9, 10, 11, 12))
    assert local_worker_shares(3, 8, list(range(16))) == [CpuShare(8, None)] * 3
    assert local_worker_shares(1, None, [5]) == [CpuShare(1, (5,))]
