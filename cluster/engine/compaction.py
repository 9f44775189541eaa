"""KV compaction of long prompts in the serving path (docs/kv_compress.md; the selection and the
gather are cluster/kv/compaction.py's): which requests compact, what they are refused with, and
the swap of a sequence's blocks once its prefill has computed the prompt.

A compacting sequence's prefill captures its last `observe` prompt queries per layer (the runner
asks the attention backend for them in the chunks that hold them: `capture_rows`); in the step
whose chunk reaches the prompt's end, before the scheduler's update (so a P/D producer holds the
compacted blocks), `after_pass` gathers the kept entries into new blocks, frees the originals and
sets the sequence's `compaction_offset`: later tokens sit at cache index position - offset, as a
windowed sequence's do (the runner's layout reads `Sequence.cache_offset`).

Prefix caching (decision): the prompt's full blocks are exact when its prefill ends, so they are
published under the request's own keys before they are freed (a repeat of the prompt hits them
and compacts again); the compacted blocks and every later one are never published (their
contents depend on the whole prompt and the selection: no block key describes them).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from cluster.engine.scheduler import StepPlan
from cluster.engine.sequence import Sequence
from cluster.kv import compaction
from cluster.kv.hashing import hash_prefix_blocks
from cluster.types import KVCompaction, SamplingParams

log = logging.getLogger(__name__)


def resolve(sampling: SamplingParams, default_ratio: float | None, default_method: str) -> KVCompaction | None:
    """A request's compaction: its own ("off" turns the server's off), else the server's default."""
    spec = sampling.kv_compaction
    if spec is None and default_ratio:
        spec = KVCompaction(ratio=default_ratio, method=default_method)
    return None if spec is None or spec.method == "off" else spec


def compacting_sampling(sampling: SamplingParams, spec: KVCompaction) -> SamplingParams:
    """`sampling` as a compacting sequence runs it: its compaction written in, speculation off (a
    verification's spans are laid out without the cache offset)."""
    return dataclasses.replace(sampling, kv_compaction=spec, speculative="off", num_speculative_tokens=None)


class Compactor:
    """The engine's collaborator for compaction. `arena`: the KV cache's [layers, 2, blocks, bs,
    Hkv, D']; `pool`: its blocks; `scale`: the attention's softmax scale."""

    def __init__(self, arena: torch.Tensor, pool, block_size: int, scale: float):
        self.arena = arena
        self.pool = pool
        self.block_size = block_size
        self.scale = scale
        self.num_compacted = 0       # prompts compacted
        self.num_skipped = 0         # prompts left exact (no room for the compact copy)
        self.seconds = 0.0           # spent compacting (selection, fit, gathers): part of the TTFT

    @staticmethod
    def refusal(sampling: SamplingParams, unsupported: str | None, windowed: bool, forks: int) -> str | None:
        """Why a compacting request cannot run here (None: it can). `unsupported`: the engine's
        reason (its backend, TP, MLA), checked by the caller."""
        if sampling.speculative not in (None, "off") or sampling.num_speculative_tokens is not None:
            return "speculative decoding (a verification's spans are laid out without the cache offset)"
        if windowed:
            return "kv_window (a window over a compacted prompt is not built)"
        if forks:
            return "n > 1 (forks share the prompt's blocks, compacted after the first sample)"
        return unsupported

    @staticmethod
    def capture_rows(seq: Sequence, start: int, n: int) -> tuple[int, int] | None:
        """The rows of a chunk (positions start..start+n-1) whose queries the compaction observes:
        the prompt's last `observe` positions; None when there are none or nothing compacts."""
        spec = seq.kv_compaction
        if spec is None or seq.compacted:
            return None
        prompt = seq.num_prompt_tokens
        lo, hi = max(start, prompt - spec.observed), min(start + n, prompt)
        return (lo - start, hi - start) if lo < hi else None

    def after_pass(self, plan: StepPlan) -> None:
        """Compact every sequence whose chunk in `plan` computed its prompt's last token."""
        for chunk in plan.decodes + plan.prefills:
            seq = chunk.seq
            end = chunk.start + chunk.num_tokens
            if seq.kv_compaction is not None and not seq.compacted and chunk.start < seq.num_prompt_tokens <= end \
                    and not seq.is_finished:
                t0 = time.perf_counter()
                self._compact(seq, end)
                self.seconds += time.perf_counter() - t0

    def _compact(self, seq: Sequence, computed: int) -> None:
        spec, bs = seq.kv_compaction, self.block_size
        new_len = spec.kept(seq.num_prompt_tokens) + computed - seq.num_prompt_tokens
        need = -(-new_len // bs)
        # The compact rows are copied out first, so the sequence's own blocks count as room (those
        # no other sequence shares): under pressure the compaction frees blocks, it never needs more.
        room = self.pool.num_free + sum(self.pool.ref_counts[b] == 1 for b in seq.block_ids)
        if not seq.captured or need > room:    # (no queries cannot happen: `Sequence.max_prefix_tokens`)
            log.warning("%s: its prompt stays exact (%d blocks to compact into, room for %d)", seq.request_id,
                        need, room)
            self.num_skipped += 1
            seq.captured, seq.kv_compaction = [], None
            return
        layers = self.arena.shape[0]
        queries = [torch.cat([c[layer] for c in seq.captured]) for layer in range(layers)]
        slots = _slots(seq.block_ids, computed, bs, self.arena.device)
        rows = compaction.compact(self.arena, spec, queries, slots, seq.num_prompt_tokens, computed, self.scale)
        self._publish_exact(seq, computed)
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids = self.pool.allocate(need)
        compaction.write(self.arena, rows, _slots(seq.block_ids, new_len, bs, self.arena.device))
        seq.compaction_offset = computed - new_len
        seq.compacted = True
        seq.captured = []
        self.num_compacted += 1

    def _publish_exact(self, seq: Sequence, computed: int) -> None:
        """The full blocks the prefill computed exactly, under the request's keys (see the module's note)."""
        if not self.pool.enable_prefix_caching:
            return
        full = computed // self.block_size
        seq.block_hashes = hash_prefix_blocks(seq.token_ids[:full * self.block_size], self.block_size,
                                              seq.sampling.cache_salt, seq.block_hashes)
        for i in range(seq.num_published_blocks, full):
            self.pool.cache_block(seq.block_ids[i], seq.block_hashes[i])
        seq.num_published_blocks = full


def _slots(blocks: list[int], length: int, bs: int, device) -> torch.Tensor:
    """The flat slots of cache indices 0..length-1 of a table of `blocks`."""
    table = torch.tensor(blocks, dtype=torch.long, device=device)
    return (table[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)[:length]
