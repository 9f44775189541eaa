"""Attention sinks with a window (StreamingLLM's recipe for models trained without one): a
windowed sequence keeps the KV of its first tokens (the sinks) and of its last ones, and frees the
blocks in between as it grows, so it generates without bound in bounded memory.

Whole blocks, never parts of one: the sinks are the first `ceil(sink_tokens / block_size)`
blocks, and the query at position q sees the blocks from `(q - window + 1) // block_size` on (every
block holding one of its last `window` positions: between `window` and `window + block_size - 1`
tokens). A sequence's block table keeps its live blocks only, sinks first, then the window: the
attention kernels read it as a plain, shorter sequence (its cache index), while RoPE keeps the
original positions (`cache_offset` = the tokens dropped between the sinks and the window). The
keys keep the rotation they were written with, so nothing in the cache is rewritten as the
window slides; StreamingLLM's re-indexing of positions inside the cache would rotate every cached
key again per dropped block.

A windowed block's KV depends on what its tokens could see, so windowed sequences key their
prefix-cache entries under their own salt (`salted`): never served to a full-attention request.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

SALT_MARK = "\x00kv-window:"


@dataclass(frozen=True)
class KVWindow:
    window: int          # tokens kept at the end (whole blocks: up to window + block_size - 1)
    sink_tokens: int     # tokens kept at the start (whole blocks: rounded up)
    block_size: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.sink_tokens < 0 or self.block_size < 1:
            raise ValueError(f"kv_window must be >= 1 and kv_sink_tokens >= 0, got {self.window} and "
                             f"{self.sink_tokens}")

    @property
    def sink_blocks(self) -> int:
        return -(-self.sink_tokens // self.block_size)

    def first_window_block(self, query_pos: int) -> int:
        """The first block past the sinks the query at `query_pos` sees."""
        return max(self.sink_blocks, (query_pos - self.window + 1) // self.block_size)

    def to_drop(self, query_pos: int, num_dropped: int) -> range:
        """Logical blocks to free before the query at `query_pos` runs, given `num_dropped` already freed."""
        return range(self.sink_blocks + num_dropped, self.first_window_block(query_pos))

    def drops_within(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` has freed blocks by its last token."""
        return self.first_window_block(num_tokens - 1) > self.sink_blocks

    def salted(self, salt: str | None) -> str:
        """The prefix-cache salt of a windowed sequence (idempotent)."""
        salt = salt or ""
        mark = f"{SALT_MARK}{self.window}:{self.sink_blocks}"
        return salt if salt.endswith(mark) else salt + mark

    def mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Which keys each query sees, by original positions ([Q, 1] and [1, K] -> [Q, K] bool):
        causal, and a sink or inside the query's window. The reference the engine must match."""
        bs = self.block_size
        first = torch.clamp((query_pos - self.window + 1).div(bs, rounding_mode="floor"), min=self.sink_blocks)
        key_block = key_pos.div(bs, rounding_mode="floor")
        return (key_pos <= query_pos) & ((key_block < self.sink_blocks) | (key_block >= first))

    def span_mask(self, num_queries: int, context_len: int, dropped: int,
                  device: torch.device | str = "cpu") -> torch.Tensor | None:
        """`mask` for a prefill chunk over its compacted table: its keys at cache indices
        0..context_len-1 (past the sinks, `dropped` tokens later), its queries the last
        `num_queries`. None where that is plain causal attention (no query of the chunk has a
        block of the table outside its window)."""
        first_query = context_len - num_queries + dropped
        if self.first_window_block(first_query + num_queries - 1) <= self.sink_blocks + dropped // self.block_size:
            return None
        q = torch.arange(first_query, first_query + num_queries, device=device)[:, None]
        k = torch.arange(context_len, device=device)
        sink_end = self.sink_blocks * self.block_size
        k = torch.where(k < sink_end, k, k + dropped) if dropped else k
        return self.mask(q, k[None, :])


def resolve(kv_window: int | None, kv_sink_tokens: int | None, default_window: int | None,
            default_sinks: int, block_size: int) -> KVWindow | None:
    """A request's window: its own (0 turns the server's off), else the server's default."""
    window = default_window if kv_window is None else kv_window
    if not window:
        return None
    return KVWindow(window, default_sinks if kv_sink_tokens is None else kv_sink_tokens, block_size)


def windowed_sampling(sampling, window: KVWindow):
    """`sampling` as a windowed sequence runs it: its window written in, its cache salt its own,
    speculation off (a verification's drafts would need the window's masks too)."""
    return dataclasses.replace(sampling, kv_window=window.window, kv_sink_tokens=window.sink_tokens,
                               cache_salt=window.salted(sampling.cache_salt), speculative="off",
                               num_speculative_tokens=None)
