import pytest

from cluster.kv.block_pool import BlockPool, NoFreeBlocks
from cluster.kv.hashing import hash_block, hash_prefix_blocks


def test_allocate_free_and_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.touch(a[:1])                 # a second owner of the first block
    pool.free(reversed(a))
    assert pool.num_free == 3 and pool.ref_counts[a[0]] == 1
    pool.free([a[0]])
    pool.check_idle()
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([a[0]])


def test_prefix_cache_hits_survive_free_until_evicted():
    pool = BlockPool(3)
    hashes = hash_prefix_blocks(list(range(8)), 4)
    blocks = pool.allocate(2)
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    pool.free(reversed(blocks))
    assert pool.match_prefix(hashes) == blocks         # free but still cached
    pool.allocate(1)                                    # takes the never-used block first
    assert pool.match_prefix(hashes) == blocks
    pool.allocate(1)                                    # LRU: the tail block (freed first) goes next
    assert pool.match_prefix(hashes) == blocks[:1]


def test_duplicate_content_keeps_first_block_canonical():
    pool = BlockPool(2)
    h = hash_block(None, [1, 2, 3, 4])
    a, b = pool.allocate(2)
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.match_prefix([h]) == [a]
    pool.free([b, a])
    pool.check_idle()


def test_chained_hash_depends_on_parent_and_salt():
    x = hash_prefix_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    y = hash_prefix_blocks([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert x[1] != y[1]                                 # same tokens, different parent
    assert hash_prefix_blocks([1, 2, 3, 4], 4, salt="tenant-a") != hash_prefix_blocks([1, 2, 3, 4], 4, salt="tenant-b")
    assert hash_prefix_blocks([1, 2, 3], 4) == []       # partial blocks are never keyed


def test_disabled_prefix_cache_never_matches():
    pool = BlockPool(2, enable_prefix_caching=False)
    h = hash_block(None, [1, 2])
    (b,) = pool.allocate(1)
    pool.cache_block(b, h)
    assert pool.match_prefix([h]) == []
