"""Reading a prefix another worker holds, when that is cheaper than computing it.

The cluster-wide KV index (`kv_index.py`) says which leading blocks of a prompt each worker holds,
in its pool, its host tier or its disk tier. A decode worker that would compute a prompt whose
prefix a prefill worker elsewhere holds (typically on another node: a node's workers share their
host tier, so a same-node holder's blocks are already the decode worker's own) can instead have
that worker export the blocks (load them from its tiers, publish them under a lease) and pull
them over the transport (NIXL), then compute only the rest (`PrefillPlace.FETCHED`).

Whether to is decided from measured costs, per request: the fetch costs the holder's tier load
(its tiers' measured seconds per loaded block), the transfer (the bytes over the cluster's
measured handoff bandwidth), the holder's recompute of the prefix's last block (a prefill never
ends on a cache hit) and a fixed round trip; not fetching costs the prefix's computation at the
decode worker's measured prefill speed. Without measurements (no handoff or prefill seen yet)
nothing is fetched. The holder must hold most of the prompt (`local_prefill_cached_fraction`):
the decode worker computes the rest, as for `PrefillPlace.CACHED`. `--prefix-fetch off` turns it
off, `always` fetches whenever a holder has more (tests, and operators who know their network).
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.worker_messages import WorkerStats
from router.policy import WorkerView

FETCH_ROUND_TRIP_S = 0.02   # the export call, the handle's trip, the pull's start and its ACK
MIN_GAIN_BLOCKS = 2         # fewer blocks than this are not worth a round trip


@dataclass(frozen=True)
class FetchPlan:
    source: str            # the worker that exports the prefix
    blocks: int            # leading blocks it exports
    fetch_s: float         # the estimate that chose it ...
    compute_s: float       # ... against computing those blocks on the decode worker


def plan_fetch(hashes: list, dec: WorkerView, holders: list[WorkerView], stats: dict[str, WorkerStats],
               block_size: int, cached_fraction: float, mode: str = "auto") -> FetchPlan | None:
    """The cheapest holder to fetch `hashes`' prefix from for decode worker `dec`, or None.
    `mode` (RouterConfig.prefix_fetch): "off" never, "always" from the longest holder whatever the costs."""
    index = dec.index
    if index is None or not hashes or mode == "off":
        return None
    own = index.cached(dec.name, hashes).disk
    rate = _prefill_rate(stats.get(dec.name), stats.values())
    bandwidth = _bandwidth(stats.values())
    if mode == "always":
        rate, bandwidth = rate or 1.0, bandwidth or 1e12    # costs only order the holders
    elif rate is None or bandwidth is None:
        return None
    best = None
    for view in holders:
        held = index.cached(view.name, hashes)
        gain = held.disk - own
        if gain < MIN_GAIN_BLOCKS or held.disk < cached_fraction * len(hashes):
            continue
        s = stats.get(view.name)
        bytes_per_block = s.kv_bytes / max(1, s.blocks_total) if s is not None and s.kv_bytes else 0
        if not bytes_per_block:
            continue
        fetch = (FETCH_ROUND_TRIP_S + gain * bytes_per_block / bandwidth
                 + (held.disk - held.pool) * _load_seconds_per_block(s)
                 + block_size / (_prefill_rate(s, stats.values()) or rate))
        compute = gain * block_size / rate
        if (fetch < compute or mode == "always") and (best is None or fetch - compute < best.fetch_s - best.compute_s):
            best = FetchPlan(view.name, held.disk, fetch, compute)
    return best


def _prefill_rate(own: WorkerStats | None, every) -> float | None:
    """Prompt tokens a second: the worker's own measurement, else the cluster's."""
    if own is not None and own.prompt_tokens_computed >= 256 and own.prompt_seconds > 0:
        return own.prompt_tokens_computed / own.prompt_seconds
    tokens = sum(s.prompt_tokens_computed for s in every)
    seconds = sum(s.prompt_seconds for s in every)
    return tokens / seconds if tokens >= 256 and seconds > 0 else None


def _bandwidth(every) -> float | None:
    """Bytes a second of the decode workers' pulls so far."""
    moved = sum(s.handoff.bytes for s in every if s.handoff is not None)
    seconds = sum(s.handoff.seconds for s in every if s.handoff is not None)
    return moved / seconds if moved and seconds > 0 else None


def _load_seconds_per_block(s: WorkerStats | None) -> float:
    if s is None or s.tiers is None:
        return 0.0
    loaded = s.tiers.loaded_host + s.tiers.loaded_disk
    return s.tiers.load_seconds / loaded if loaded else 0.0
