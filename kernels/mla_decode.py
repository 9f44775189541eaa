"""Absorbed-MLA decode attention over a paged latent cache: the torch reference, the C op
(kernels/cpu/mla.c) and the Triton kernel, one signature.

    mla_decode(q_lat [R, H, C], q_pe [R, H, P], kv [2, blocks, block_size, 1, half], tables
               [R, max_blocks] int64, lens [R] int64, scale) -> [R, H, C]

Row r attends the first lens[r] tokens of its block table. A token's latent vector (C + P wide,
C the compressed KV, P the RoPE'd key) lies split over the two planes: elements [0, half) in
kv[0], the rest in kv[1]. score = (q_lat . c + q_pe . k_pe) * scale; the output is the
softmax-weighted sum of c (the caller multiplies it by W_UV).
"""
from __future__ import annotations

import torch


def latent_rows(kv: torch.Tensor, tables: torch.Tensor, width: int) -> torch.Tensor:
    """[R, max_blocks * block_size, width]: every row's table of latent vectors."""
    r, max_blocks = tables.shape
    block_size, half = kv.shape[2], kv.shape[4]
    planes = kv[:, tables.reshape(-1)].view(2, r, max_blocks * block_size, half)
    return torch.cat((planes[0], planes[1]), dim=-1)[..., :width]


def mla_decode_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                         lens: torch.Tensor, scale: float) -> torch.Tensor:
    c_dim, p_dim = q_lat.shape[-1], q_pe.shape[-1]
    latent = latent_rows(kv, tables, c_dim + p_dim).to(q_lat.dtype)
    scores = torch.einsum("rhc,rlc->rhl", q_lat, latent[..., :c_dim])
    scores = scores + torch.einsum("rhp,rlp->rhl", q_pe, latent[..., c_dim:])
    keys = torch.arange(latent.shape[1], device=lens.device)
    scores = scores.float().masked_fill((keys[None, :] >= lens[:, None])[:, None, :], float("-inf"))
    probs = torch.softmax(scores * scale, dim=-1).to(q_lat.dtype)
    return torch.einsum("rhl,rlc->rhc", probs, latent[..., :c_dim])
