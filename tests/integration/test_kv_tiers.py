"""KV tiers below a small pool, in-process: blocks evicted from the pool come back from the host or
disk tier instead of being recomputed, with output equal to a cache-free engine; the disk tier
outlives its engine; a corrupt block is recomputed, never served; tenants stay apart; an abort while
a request waits for its blocks leaks nothing; configurations that do not fit are refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from cluster.engine.engine import TIER_LOOKAHEAD, LLMEngine
from cluster.types import SamplingParams

BS = 4
PROMPT = 41          # 10 full blocks, the last token in the 11th
POOL = 24            # two prompts' worth: a third evicts the first


def _engine(model_dir, tmp: Path | None = None, host: int | None = None, blocks: int = POOL,
            caching: bool = True, disk_bytes: int | None = None, shared: str | None = None) -> LLMEngine:
    cache = CacheConfig(block_size=BS, num_blocks=blocks, enable_prefix_caching=caching, kv_host_bytes=host,
                        kv_disk_dir=str(tmp) if tmp else None, kv_disk_bytes=disk_bytes, kv_host_shared=shared)
    return LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_model_len=128, num_threads=1, cache=cache,
                                  scheduler=SchedulerConfig(max_num_batched_tokens=64)))


def _prompt(seed: int, n: int = PROMPT) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SP = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of a cache-free engine, per prompt seed."""
    engine = _engine(model, blocks=128, caching=False)
    return {seed: list(engine.generate([_prompt(seed)], SP)[0].token_ids) for seed in range(6)}


def _run(engine: LLMEngine, seed: int, salt: str = ""):
    sp = SamplingParams(max_tokens=6, ignore_eos=True, cache_salt=salt)
    return engine.generate([_prompt(seed)], sp)[0]


def _settle(engine: LLMEngine) -> None:
    """Every tier job done and polled, then the pool must be idle."""
    for seq in engine.tiers.drain():
        engine.scheduler.add(seq)
    assert not engine.has_unfinished()
    engine.pool.check_idle()


def _block_bytes(engine: LLMEngine) -> int:
    return engine.kv_cache.nbytes() // engine.kv_cache.num_blocks


def test_evicted_prefix_is_loaded_from_the_host_tier_not_recomputed(model, reference, tmp_path):
    probe = _engine(model)
    engine = _engine(model, host=64 * _block_bytes(probe))
    first = _run(engine, 0)
    for seed in (1, 2):                    # two more prompts evict the first from the pool
        assert list(_run(engine, seed).token_ids) == reference[seed]
        _settle(engine)
    assert engine.pool.match_prefix(engine.prefix_keys(_prompt(0))) == []
    computed = engine.prompt_tokens_computed
    again = _run(engine, 0)
    assert list(first.token_ids) == list(again.token_ids) == reference[0]
    assert again.num_cached_tokens == (PROMPT - 1) // BS * BS
    assert engine.prompt_tokens_computed - computed == PROMPT - again.num_cached_tokens
    stats = engine.tiers.stats()
    assert stats.loaded_host == (PROMPT - 1) // BS and stats.loaded_disk == 0 and stats.corrupt == 0
    _settle(engine)


def test_disk_tier_survives_its_engine_and_a_corrupt_block_is_recomputed(model, reference, tmp_path):
    engine = _engine(model, tmp_path)          # disk only
    for seed in (3, 4, 5):
        assert list(_run(engine, seed).token_ids) == reference[seed]
    _settle(engine)
    assert engine.tiers.stats().disk_blocks >= 3 * ((PROMPT - 1) // BS)
    engine.tiers.close()
    files = sorted((tmp_path / engine.layout.layout_hash()).glob("*.kv"))
    assert files and not list(tmp_path.rglob("*.tmp"))

    restarted = _engine(model, tmp_path)       # a new engine rebuilds its index from the files
    assert restarted.tiers.stats().recovered == len(files)
    hit = _run(restarted, 3)
    assert list(hit.token_ids) == reference[3] and hit.num_cached_tokens == (PROMPT - 1) // BS * BS
    assert restarted.tiers.stats().loaded_disk == (PROMPT - 1) // BS

    keys = restarted.prefix_keys(_prompt(4))
    bad = tmp_path / restarted.layout.layout_hash() / (keys[2].hex() + ".kv")
    raw = bytearray(bad.read_bytes())
    raw[-5] ^= 0x40                            # one flipped bit in the third block's payload
    bad.write_bytes(bytes(raw))
    hit = _run(restarted, 4)
    assert list(hit.token_ids) == reference[4]
    assert hit.num_cached_tokens == 2 * BS     # served the two good blocks, recomputed from the bad one on
    _settle(restarted)
    stats = restarted.tiers.stats()
    assert stats.corrupt == 1 and stats.offloaded == 1    # the recomputed block replaced the bad file
    assert bad.read_bytes() != bytes(raw) and len(bad.read_bytes()) == len(raw)


def test_tenants_do_not_share_tier_blocks_and_an_abort_while_loading_leaks_nothing(model, reference):
    probe = _engine(model)
    engine = _engine(model, host=256 * _block_bytes(probe))
    _run(engine, 0, salt="tenant-a")
    for seed in (1, 2):
        _run(engine, seed)
    other = _run(engine, 0, salt="tenant-b")
    assert other.num_cached_tokens == 0 and list(other.token_ids) == reference[0]
    for seed in (1, 2):
        _run(engine, seed, salt="x")           # evict tenant-a's prompt from the pool again
    _settle(engine)
    rid = engine.add_request(_prompt(0), SamplingParams(max_tokens=6, ignore_eos=True, cache_salt="tenant-a"))
    assert engine.tiers.is_parked(engine.sequence(rid))
    assert engine.abort(rid)
    deltas = engine.step()
    assert [d.request_id for d in deltas if d.finished] == [rid]
    _settle(engine)


def test_requests_queued_after_their_loads_pin_nothing(model, reference):
    """Loaded blocks are published and unpinned before their request is queued: a queued request
    holding blocks would be a resource the scheduler cannot see (two of them, each waiting behind
    the other's pins, once stalled a decode worker)."""
    engine = _engine(model, host=64 * _block_bytes(_engine(model)), blocks=2 * ((PROMPT + 6) // BS + 1))
    for seed in (0, 1, 2, 3):
        _run(engine, seed)
    _settle(engine)
    ids = [engine.add_request(_prompt(seed), SP) for seed in (0, 1)]
    assert all(engine.tiers.is_parked(engine.sequence(rid)) for rid in ids)
    for seq in engine.tiers.drain():
        engine.scheduler.add(seq)
    assert engine.pool.num_used == 0 and len(engine.scheduler.waiting) == 2
    tokens, finished = {rid: [] for rid in ids}, set()
    while len(finished) < 2:
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
            if d.finished:
                finished.add(d.request_id)
    assert [tokens[rid] for rid in ids] == [reference[0], reference[1]]
    _settle(engine)


def test_only_requests_next_in_line_load_and_the_rest_load_when_they_get_there(model, reference):
    """Prefetch at admission, not on arrival: blocks loaded for a request deep in the queue would be
    evicted again before it runs. The first TIER_LOOKAHEAD requests load; the others load as they
    reach the head, and every one is served from the tier."""
    engine = _engine(model, host=256 * _block_bytes(_engine(model)), blocks=96)
    seeds = range(6)
    for seed in seeds:
        _run(engine, seed)
    for salt in ("flush", "flush-again"):       # evicts every unsalted prompt from the pool
        for seed in seeds:
            _run(engine, seed, salt=salt)
    _settle(engine)
    assert all(engine.pool.match_prefix(engine.prefix_keys(_prompt(seed))) == [] for seed in seeds)
    computed = engine.prompt_tokens_computed
    ids = [engine.add_request(_prompt(seed), SP) for seed in seeds]
    parked = [engine.tiers.is_parked(engine.sequence(rid)) for rid in ids]
    assert parked == [True] * TIER_LOOKAHEAD + [False] * (len(ids) - TIER_LOOKAHEAD)
    tokens, finished = {rid: [] for rid in ids}, set()
    while len(finished) < len(ids):
        engine.wait_for_tiers()
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
            if d.finished:
                finished.add(d.request_id)
    assert [tokens[rid] for rid in ids] == [reference[seed] for seed in seeds]
    full = (PROMPT - 1) // BS
    assert engine.tiers.stats().loaded_host >= len(ids) * full
    assert engine.prompt_tokens_computed - computed == len(ids) * (PROMPT - full * BS)
    _settle(engine)


def test_workers_sharing_a_host_tier_read_each_others_prefixes(model, reference):
    """Two engines (two workers of a node) map one shared host segment: a prompt the first computed
    is loaded by the second, never computed there."""
    import uuid
    from cluster.kv.shared_host import segment_path
    name = uuid.uuid4().hex[:12]
    host = 64 * _block_bytes(_engine(model))
    a, b = _engine(model, host=host, shared=name), _engine(model, host=host, shared=name)
    try:
        assert list(_run(a, 0).token_ids) == reference[0]
        _settle(a)
        computed = b.prompt_tokens_computed
        hit = _run(b, 0)
        assert list(hit.token_ids) == reference[0] and hit.num_cached_tokens == (PROMPT - 1) // BS * BS
        assert b.tiers.stats().loaded_host == (PROMPT - 1) // BS
        assert b.prompt_tokens_computed - computed == PROMPT - hit.num_cached_tokens
        _settle(b)
        assert a.tiers.stats().host_blocks == b.tiers.stats().host_blocks > 0    # one index
    finally:
        for e in (a, b):
            e.tiers.close()
        segment_path(name).unlink()


def test_tier_configurations_that_do_not_fit_are_refused(model, tmp_path):
    with pytest.raises(ValueError, match="--kv-host-bytes .* does not fit"):
        _engine(model, host=1 << 50)
    with pytest.raises(ValueError, match="--kv-disk-bytes .* does not fit"):
        _engine(model, tmp_path, disk_bytes=1 << 60)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        _engine(model, host=100)
    with pytest.raises(ConfigError, match="needs --kv-disk-dir"):
        CacheConfig(kv_disk_bytes=1 << 20)
