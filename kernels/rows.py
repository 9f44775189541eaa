"""Every token of a flat batch as a decode row of its own: the layout of the batch-invariant mode.

Reads the engine's AttentionBatch by attribute (kernels never imports cluster). Decodes come
first, then verification and prefill spans by query start; each token gets its sequence's block
table and its own context length (its position + 1), so a position's attention reads the same
keys in the same order however its token was batched or chunked. torch only: both attention
backends (the C kernel's and the Triton one's) build their rows here.
"""
from __future__ import annotations

import torch


def every_token_rows(batch, dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tables [T, width] padded with block 0, context lengths [T], the longest context)."""
    bs = batch.block_size
    spans = [(i, 1, n, t) for i, (n, t) in enumerate(zip(batch.decode_context_lens, batch.decode_block_tables))]
    spans += [(s.query_start, s.query_len, s.context_len, s.block_table) for s in (*batch.verifies, *batch.prefills)]
    spans.sort(key=lambda s: s[0])
    width = max(-(-ctx // bs) for _, _, ctx, _ in spans)
    tables, lens, row = [], [], 0
    singles: list[int] = []   # consecutive one-token rows (decodes) go into one tensor, not one each
    single_lens: list[int] = []

    def flush() -> None:
        if singles:
            tables.append(torch.tensor(singles, dtype=dtype).view(-1, width))
            lens.append(torch.tensor(single_lens, dtype=dtype))
            singles.clear()
            single_lens.clear()
    for start, q_len, ctx, table in spans:
        assert start == row, "the flat batch's spans must be contiguous"
        n = -(-ctx // bs)
        padded = (*table[:n], *(0,) * (width - n))
        if q_len == 1:
            singles.extend(padded)
            single_lens.append(ctx)
        else:   # a chunk's tokens share one table row: expanded, not copied
            flush()
            tables.append(torch.tensor(padded, dtype=dtype).expand(q_len, width))
            lens.append(torch.arange(ctx - q_len + 1, ctx + 1, dtype=dtype))
        row += q_len
    flush()
    return torch.cat(tables), torch.cat(lens), max(ctx for _, _, ctx, _ in spans)
