"""Shards a loaded model over the ranks of a group, in place, by swapping its modules: no model
file changes (the modules keep their names, so kernel plans and quantization see plain linears).

- qkv and gate/up: column-parallel (each rank's rows: its query heads, its KV heads, its slice of
  the intermediate size); no collective.
- o and down: row-parallel (each rank's input columns) and one all-reduce each; the bias on rank 0
  only, so it is added once.
- embedding and LM head: vocab-parallel (each rank ceil(V/N) rows, zero-padded): the embedding
  looks up its rows and all-reduces, the head all-gathers its logits.
- KV heads: sharded; with fewer KV heads than ranks each is replicated on the ranks whose query
  heads read it (as vLLM does).

The model's attention modules then read a rank-local `ModelConfig` (its heads, its intermediate
size); the engine's KV cache and attention backend are built from that same config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.deepseek_moe import DeepseekMoE
from cluster.model.model_config import ModelConfig
from cluster.model.moe import SparseMoeBlock
from cluster.parallel.group import RankGroup
from cluster.parallel.mla_sharding import shard_deepseek_moe, shard_mla_attention
from cluster.parallel.moe_sharding import shard_sparse_block
from cluster.parallel.parallel_linear import RowParallelLinear, linear_from


class ShardingError(ValueError):
    """The model's shapes do not split over the group."""


@dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `world` holds: query heads [q_start, q_start + q_heads), KV heads
    [kv_start, kv_start + kv_heads), intermediate [i_start, i_start + i_size), vocab rows
    [v_start, v_start + v_rows) of `v_per` (the padded share)."""
    rank: int
    world: int
    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int
    i_start: int
    i_size: int
    v_start: int
    v_rows: int
    v_per: int


def _split(n: int, rank: int, world: int) -> tuple[int, int]:
    """(start, count) of rank's share of n units, the first n % world ranks one more."""
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def rank_shard(mc: ModelConfig, rank: int, world: int) -> RankShard:
    """Rank `rank`'s ranges, or a ShardingError naming the shape that does not split.

    With at least as many KV heads as ranks, whole KV groups (a KV head and the query heads that
    read it) are split over the ranks, unevenly where they do not divide (SmolLM2's 3 over 2 ranks:
    2 and 1; vLLM refuses these). With fewer, each KV head is replicated on the ranks that share
    its query heads, which must then divide evenly."""
    h, k, i = mc.num_heads, mc.num_kv_heads, mc.intermediate_size
    if i % world:
        raise ShardingError(f"{mc.model_id}: {i} intermediate size do not split over {world} tensor-parallel ranks")
    if mc.mla is not None:
        k = 1               # one latent per token, on every rank (mla_sharding.py): its query heads split
    if k >= world:
        group = h // k
        kv_start, kv_heads = _split(k, rank, world)
        q_start, q_heads = kv_start * group, kv_heads * group
    else:
        if h % world:
            raise ShardingError(f"{mc.model_id}: {h} attention heads do not split over {world} tensor-parallel ranks")
        if world % k:
            raise ShardingError(f"{mc.model_id}: {k} KV heads do not replicate evenly on {world} tensor-parallel ranks")
        q_heads, kv_heads = h // world, 1
        q_start, kv_start = rank * q_heads, rank // (world // k)
    v_per = -(-mc.vocab_size // world)
    v_start = min(rank * v_per, mc.vocab_size)
    return RankShard(rank, world, q_start, q_heads, kv_start, kv_heads, rank * (i // world), i // world,
                     v_start, min(v_per, mc.vocab_size - v_start), v_per)


def local_config(mc: ModelConfig, shard: RankShard) -> ModelConfig:
    """The config a rank's layers compute with: its heads and its slice of the MLP."""
    return dataclasses.replace(mc, num_heads=shard.q_heads, num_kv_heads=shard.kv_heads,
                               intermediate_size=shard.i_size)


class VocabParallelEmbedding(nn.Module):
    """A rank's rows of the embedding table; tokens outside them look up zeros, then all-reduce."""

    def __init__(self, weight: torch.Tensor, shard: RankShard, group: RankGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.rows, self.group = shard.v_start, shard.v_rows, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(x)


class VocabParallelHead(nn.Module):
    """A rank's rows of the LM head; the ranks' logits gathered side by side, the padding cut."""

    def __init__(self, inner: nn.Linear, vocab_size: int, group: RankGroup):
        super().__init__()
        self.inner = inner
        self.vocab_size, self.group = vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.inner.forward(x))[:, : self.vocab_size]


def _rows(t: torch.Tensor, *ranges: tuple[int, int]) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in ranges])


def _shard_attention(attn: nn.Module, mc: ModelConfig, s: RankShard, group: RankGroup, local: ModelConfig) -> None:
    d, q, kv = mc.head_dim, mc.q_size, mc.kv_size
    ranges = ((s.q_start * d, (s.q_start + s.q_heads) * d),
              (q + s.kv_start * d, q + (s.kv_start + s.kv_heads) * d),
              (q + kv + s.kv_start * d, q + kv + (s.kv_start + s.kv_heads) * d))
    qkv = attn.qkv_proj
    attn.qkv_proj = linear_from(_rows(qkv.weight.data, *ranges), None if qkv.bias is None else _rows(qkv.bias.data, *ranges))
    o = attn.o_proj
    cols = o.weight.data[:, s.q_start * d:(s.q_start + s.q_heads) * d]
    attn.o_proj = RowParallelLinear(linear_from(cols, o.bias.data if o.bias is not None and s.rank == 0 else None), group)
    attn.cfg = local


def _shard_mlp(mlp: nn.Module, mc: ModelConfig, s: RankShard, group: RankGroup) -> None:
    i, a, b = mc.intermediate_size, s.i_start, s.i_start + s.i_size
    gu = mlp.gate_up_proj
    mlp.gate_up_proj = linear_from(_rows(gu.weight.data, (a, b), (i + a, i + b)),
                               None if gu.bias is None else _rows(gu.bias.data, (a, b), (i + a, i + b)))
    down = mlp.down_proj
    mlp.down_proj = RowParallelLinear(
        linear_from(down.weight.data[:, a:b], down.bias.data if down.bias is not None and s.rank == 0 else None), group)


def _vocab_rows(weight: torch.Tensor, s: RankShard) -> torch.Tensor:
    rows = weight[s.v_start:s.v_start + s.v_rows]
    pad = s.v_per - s.v_rows
    return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows.clone()   # not a view: frees the rest


def shard_model(model: nn.Module, mc: ModelConfig, group: RankGroup, expert_parallel: bool = False,
                redundant_experts: int = 0) -> ModelConfig:
    """Keeps this rank's share of `model`'s weights (the rest freed) and returns its local config.
    A sparse layer's experts are sliced, or with `expert_parallel` placed whole (moe_sharding.py)."""
    if mc.num_kv_layers != mc.num_layers:   # a sharing layer's query-only projection is not sliced
        raise ValueError("cross-layer KV sharing (num_kv_shared_layers) is not supported with tensor parallelism")
    s = rank_shard(mc, group.rank, group.world)
    local = local_config(mc, s)
    for layer in model.layers:
        if mc.mla is not None:      # DeepSeek: heads split, the latent replicated (mla_sharding.py)
            shard_mla_attention(layer.self_attn, mc.mla, s.q_start, s.q_heads, group)
        else:
            _shard_attention(layer.self_attn, mc, s, group, local)
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp = shard_sparse_block(layer.mlp, group, expert_parallel, redundant_experts)
        elif isinstance(layer.mlp, DeepseekMoE):
            layer.mlp = shard_deepseek_moe(layer.mlp, group, expert_parallel, redundant_experts)
        else:
            _shard_mlp(layer.mlp, mc, s, group)
    tied = mc.tie_word_embeddings
    embed = _vocab_rows(model.embed_tokens.weight.data, s)
    model.embed_tokens = VocabParallelEmbedding(embed, s, group)
    head = model.embed_tokens.weight if tied else nn.Parameter(_vocab_rows(model.lm_head.weight.data, s),
                                                                requires_grad=False)
    inner = nn.Linear(mc.hidden_size, s.v_per, bias=False, device="meta")
    inner.weight = head
    model.lm_head = VocabParallelHead(inner, mc.vocab_size, group)
    return local
