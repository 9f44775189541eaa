"""Every token of a flat batch as a decode row of its own: the layout of the batch-invariant mode.

Reads the engine's AttentionBatch by attribute (kernels never imports cluster). Decodes come
first, then verification and prefill spans by query start; each token gets its sequence's block
table and its own context length (its position + 1), so a position's attention reads the same
keys in the same order however its token was batched or chunked. torch only: both attention
backends (the C kernel's and the Triton one's) build their rows here.
"""
from __future__ import annotations

import torch


def tree_depths(parents) -> list[int]:
    """Depth of each node of a token tree (parents[i] < i, -1 the root; the root's children are 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def tree_path(parents, node: int) -> list[int]:
    """The nodes from the root's child down to `node` (its ancestors, then itself)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def tree_tails(first: int, parents, table, block_size: int) -> list[list[int]]:
    """Per row of a tree verification (the root at position `first`, then each draft), the row's
    tail for the kernels: [t, t flat slots]: its path's keys, which sit at slots first + 1 + i."""
    def slot(i: int) -> int:
        p = first + 1 + i
        return table[p // block_size] * block_size + p % block_size
    return [[0]] + [[len(path), *map(slot, path)] for path in (tree_path(parents, i) for i in range(len(parents)))]


def tails_tensor(tails: list[list[int]], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Rows [t, slots...] padded to one width: [rows, 1 + max t]."""
    width = max(len(t) for t in tails)
    return torch.tensor([t + [0] * (width - len(t)) for t in tails], dtype=dtype)


def every_token_rows(batch, dtype: torch.dtype = torch.long
                     ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """(tables [T, width] padded with block 0, context lengths [T], the longest context, tails):
    tails is None unless a verification is a token tree; then [T, 1 + W] (`tree_tails`, 0 for
    every other row): a tree row reads its ancestors' slots as the end of its keys."""
    bs = batch.block_size
    spans = [(i, 1, n, t, ()) for i, (n, t) in enumerate(zip(batch.decode_context_lens, batch.decode_block_tables))]
    spans += [(s.query_start, s.query_len, s.context_len, s.block_table, getattr(s, "tree", ()))
              for s in (*batch.verifies, *batch.prefills)]
    spans.sort(key=lambda s: s[0])
    width = max(-(-ctx // bs) for _, _, ctx, _, _ in spans)
    tables, lens, row = [], [], 0
    tails: list[list[int]] = []
    singles: list[int] = []   # consecutive one-token rows (decodes) go into one tensor, not one each
    single_lens: list[int] = []

    def flush() -> None:
        if singles:
            tables.append(torch.tensor(singles, dtype=dtype).view(-1, width))
            lens.append(torch.tensor(single_lens, dtype=dtype))
            singles.clear()
            single_lens.clear()
    for start, q_len, ctx, table, tree in spans:
        assert start == row, "the flat batch's spans must be contiguous"
        n = -(-ctx // bs)
        padded = (*table[:n], *(0,) * (width - n))
        if q_len == 1:
            singles.extend(padded)
            single_lens.append(ctx)
            tails.append([0])
        else:   # a chunk's tokens share one table row: expanded, not copied
            flush()
            tables.append(torch.tensor(padded, dtype=dtype).expand(q_len, width))
            first = ctx - q_len
            if tree:
                lens.append(torch.tensor([first + 1 + d for d in (0, *tree_depths(tree))], dtype=dtype))
                tails += tree_tails(first, tree, table, bs)
            else:
                lens.append(torch.arange(first + 1, ctx + 1, dtype=dtype))
                tails += [[0]] * q_len
        row += q_len
    flush()
    trees = any(len(t) > 1 for t in tails)
    return (torch.cat(tables), torch.cat(lens), max(ctx for _, _, ctx, _, _ in spans),
            tails_tensor(tails, dtype) if trees else None)
