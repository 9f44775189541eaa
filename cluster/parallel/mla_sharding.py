"""DeepSeek's layers over the ranks of a tensor-parallel group.

- Latent attention, split by heads: each rank its query heads' rows of q_proj / q_b_proj and of
  kv_b_proj, their slices of the absorbed W_UK and W_UV, and its columns of o_proj (row-parallel,
  one all-reduce). The latent path (kv_a_proj with its norm, q_a_proj with its norm) is
  replicated: every rank computes and caches the same latent vector per token, so each rank's KV
  cache is the whole model's (a P/D handoff moves it as a single rank's, cluster/parallel/
  kv_export.py, its one "KV head" owned by every rank).
- The mixture of experts as the other families' (moe_sharding.py): the router replicated (every
  rank routes every token alike), the routed experts sliced or placed whole, the shared experts
  sliced, the block's output one all-reduce.
"""
from __future__ import annotations

from torch import nn

from cluster.model.deepseek import MLAAttention
from cluster.model.deepseek_moe import DeepseekMoE
from cluster.model.mla_config import MLAConfig
from cluster.parallel.group import RankGroup
from cluster.parallel.moe_sharding import ReducedBlock, shard_experts, slice_dense_mlp
from cluster.parallel.parallel_linear import RowParallelLinear, linear_from


def shard_mla_attention(attn: MLAAttention, mla: MLAConfig, q_start: int, q_heads: int, group: RankGroup) -> None:
    """Keeps query heads [q_start, q_start + q_heads) of `attn` (no bias in these projections)."""
    qk, per, v = mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim, mla.v_head_dim
    rows = slice(q_start * qk, (q_start + q_heads) * qk)
    if mla.q_lora_rank is None:
        attn.q_proj = linear_from(attn.q_proj.weight.data[rows], None)
    else:
        attn.q_b_proj = linear_from(attn.q_b_proj.weight.data[rows], None)
    attn.kv_b_proj = linear_from(attn.kv_b_proj.weight.data[q_start * per:(q_start + q_heads) * per], None)
    heads = slice(q_start, q_start + q_heads)
    attn.w_uk = nn.Parameter(attn.w_uk.data[heads].clone(), requires_grad=False)
    attn.w_uv = nn.Parameter(attn.w_uv.data[heads].clone(), requires_grad=False)
    o = attn.o_proj
    cols = o.weight.data[:, q_start * v:(q_start + q_heads) * v]
    bias = o.bias.data if o.bias is not None and group.rank == 0 else None    # added once, on rank 0
    attn.o_proj = RowParallelLinear(linear_from(cols, bias), group)
    attn.num_heads = q_heads


def shard_deepseek_moe(block: DeepseekMoE, group: RankGroup, expert_parallel: bool,
                       redundant_experts: int = 0) -> ReducedBlock:
    """`block` with this rank's share of its experts and shared experts, wrapped in the all-reduce."""
    block.experts = shard_experts(block.experts, group, expert_parallel, redundant_experts)
    if block.shared_experts is not None:
        slice_dense_mlp(block.shared_experts, group.rank, group.world)
    return ReducedBlock(block, group)
