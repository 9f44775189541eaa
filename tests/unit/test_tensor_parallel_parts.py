"""The parts of tensor parallelism that decide (cluster/parallel/): each rank's head, MLP and vocab
ranges (KV heads replicated below the rank count), the split of cores, the step message's round
trip, the layout's TP fields and the settings TP refuses."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.config import ConfigError, EngineConfig, SpeculativeConfig
from cluster.launch.banner import tensor_parallel_line
from cluster.launch.cluster_config import ClusterConfig
from cluster.model.attention import AttentionBatch, PrefillSpan
from cluster.model.model_config import ModelConfig, RopeConfig
from cluster.parallel import step_message
from cluster.parallel.kv_export import full_layout
from cluster.parallel.sharding import ShardingError, rank_shard
from cluster.parallel.threads import rank_cores
from cluster.transfer.base import (
    PROTOCOL_VERSION,
    LayoutMismatch,
    PeerMetadata,
    check_compatible,
)
from cluster.types import KVLayout


def _config(heads=4, kv_heads=2, intermediate=128, vocab=385) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", "tiny", vocab, 64, intermediate, 2, heads, kv_heads, 16, 1e-6, 256,
                       False, False, False, False, RopeConfig(), (None, None), torch.float32)


def test_heads_mlp_and_vocab_split_evenly():
    shards = [rank_shard(_config(), r, 2) for r in range(2)]
    assert [(s.q_start, s.q_heads, s.kv_start, s.kv_heads) for s in shards] == [(0, 2, 0, 1), (2, 2, 1, 1)]
    assert [(s.i_start, s.i_size) for s in shards] == [(0, 64), (64, 64)]
    # 385 rows: 193 a rank, the last rank's share padded by one row
    assert [(s.v_start, s.v_rows, s.v_per) for s in shards] == [(0, 193, 193), (193, 192, 193)]


def test_fewer_kv_heads_than_ranks_replicates_them_on_the_ranks_that_read_them():
    shards = [rank_shard(_config(heads=4, kv_heads=1), r, 4) for r in range(4)]
    assert [(s.q_start, s.kv_start, s.kv_heads) for s in shards] == [(0, 0, 1), (1, 0, 1), (2, 0, 1), (3, 0, 1)]
    shards = [rank_shard(_config(heads=8, kv_heads=2), r, 4) for r in range(4)]
    # query heads 0-3 read KV head 0, 4-7 KV head 1
    assert [(s.q_start, s.kv_start) for s in shards] == [(0, 0), (2, 0), (4, 1), (6, 1)]


def test_kv_groups_that_do_not_divide_split_unevenly():
    """SmolLM2-135M's shape: 9 query heads in 3 KV groups over 2 ranks: 2 groups and 1."""
    shards = [rank_shard(_config(heads=9, kv_heads=3, intermediate=1536), r, 2) for r in range(2)]
    assert [(s.q_start, s.q_heads, s.kv_start, s.kv_heads) for s in shards] == [(0, 6, 0, 2), (6, 3, 2, 1)]


@pytest.mark.parametrize(("shape", "words"), [({"heads": 6, "kv_heads": 2}, "6 attention heads"),
                                              ({"intermediate": 130}, "130 intermediate size"),
                                              ({"heads": 12, "kv_heads": 3}, "3 KV heads")])
def test_shapes_that_do_not_split_are_refused_by_name(shape, words):
    with pytest.raises(ShardingError, match=words):
        rank_shard(_config(**shape), 0, 4)


def test_cores_are_split_and_oversubscription_runs_unpinned():
    assert rank_cores((0, 1, 2, 3), None, 1, 2).cpus == (2, 3)
    assert rank_cores((0, 1, 2, 3), 4, 1, 2).threads == 2
    over = rank_cores((0, 1), None, 2, 3)
    assert over.cpus is None and over.threads == 1 and "unpinned" in over.note


def test_step_message_round_trips_without_pickle():
    slots = torch.tensor([5, 6, 7, 40], dtype=torch.long)
    batch = AttentionBatch(1, (6,), ((0, 1),), (PrefillSpan(1, 3, 3, (2,), ()),), slots, 4,
                           (PrefillSpan(4, 0, 0, (), (0, 0)),))
    msg = step_message.StepMessage(torch.tensor([3, 4, 5, 6]), torch.tensor([5, 0, 1, 2]), batch, torch.tensor([0, 3]))
    raw = step_message.encode(msg)
    assert b"\x80" not in raw[:2]          # a msgpack map, not a pickle stream (protocol 2+ starts with 0x80)
    back = step_message.decode(raw, torch.device("cpu"))
    assert back.input_ids.tolist() == [3, 4, 5, 6] and back.logits_indices.tolist() == [0, 3]
    assert back.batch.slot_mapping.tolist() == slots.tolist()
    assert dataclasses.replace(back.batch, slot_mapping=None) == dataclasses.replace(batch, slot_mapping=None)
    assert step_message.decode(step_message.encode(step_message.stop_message(torch.device("cpu"))),
                               torch.device("cpu")).stop


def test_layout_hash_of_one_rank_is_unchanged_and_ranks_differ():
    base = KVLayout("m", 2, 2, 16, 16, "float32")
    assert dataclasses.replace(base, tp_rank=0, tp_size=1).layout_hash() == base.layout_hash()
    r0 = dataclasses.replace(base, num_kv_heads=1, tp_size=2, total_kv_heads=2)
    assert r0.layout_hash() != base.layout_hash()
    assert r0.layout_hash() != dataclasses.replace(r0, tp_rank=1, kv_head_start=1).layout_hash()


def test_settings_tensor_parallelism_refuses(tiny_model_dir):
    model = tiny_model_dir("llama")
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(model=model, tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="--quantization none"):
        EngineConfig(model=model, tensor_parallel_size=2, quantization="int8")
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(model=model, tensor_parallel_size=2, speculative=SpeculativeConfig(method="ngram"))


def _rank_layout(**kw) -> KVLayout:
    """Rank 1 of a TP 2 worker of a model with 4 KV heads."""
    base = {"model_id": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 16,
            "dtype": "float32", "tp_size": 2, "tp_rank": 1, "kv_head_start": 2, "total_kv_heads": 4}
    return KVLayout(**{**base, **kw})


def test_a_tp_workers_handoff_layout_is_a_single_ranks():
    """What a TP worker's transport shows a peer: every head, the single-rank hash (TP 2 and TP 1
    workers of one model pair up)."""
    single = KVLayout("m", 2, 4, 16, 16, "float32")
    assert full_layout(_rank_layout()) == single
    assert full_layout(_rank_layout()).layout_hash() == single.layout_hash()


@pytest.mark.parametrize("differs", [{"block_size": 32}, {"dtype": "bfloat16"}, {"model_id": "other"}])
def test_a_pair_that_cannot_be_resharded_is_refused_naming_both_layouts(differs):
    """Different block sizes, dtypes or models: refused at the handshake (before any request), one
    error naming the differing field with both workers' values."""
    decode_tp1 = KVLayout("m", 2, 4, 16, 16, "float32")
    prefill_tp2 = full_layout(_rank_layout(**differs))
    peer = PeerMetadata("prefill-0", "tcp", PROTOCOL_VERSION, prefill_tp2, 8, 0, b"")
    with pytest.raises(LayoutMismatch) as refused:
        check_compatible(decode_tp1, "tcp", peer)
    (field, value), = differs.items()
    assert f"{field}: local {getattr(decode_tp1, field)!r}, peer {value!r}" in str(refused.value)


def test_role_sizes_override_the_engine_size(tiny_model_dir):
    engine = EngineConfig(model=tiny_model_dir("llama"), quantization="none", tensor_parallel_size=2)
    cfg = ClusterConfig(engine=engine, colocated=True, num_prefill=0, decode_tensor_parallel_size=4)
    assert (cfg.tensor_parallel_size("prefill"), cfg.tensor_parallel_size("decode")) == (2, 4)
    with pytest.raises(ConfigError, match="--quantization none"):
        ClusterConfig(engine=EngineConfig(model=tiny_model_dir("llama"), quantization="int8"), colocated=True,
                      num_prefill=0, decode_tensor_parallel_size=2)


def test_a_tp_cluster_on_cuda_is_refused_until_ranks_are_actors(tiny_model_dir):
    engine = EngineConfig(model=tiny_model_dir("llama"), quantization="none", device="cuda")
    with pytest.raises(ConfigError, match="runs on CPU for now"):
        ClusterConfig(engine=engine, colocated=True, num_prefill=0, decode_tensor_parallel_size=2)


def test_the_banner_says_each_roles_size_when_one_is_sharded(tiny_model_dir):
    engine = EngineConfig(model=tiny_model_dir("llama"), quantization="none")
    assert tensor_parallel_line(ClusterConfig(engine=engine)) is None
    assert tensor_parallel_line(ClusterConfig(engine=engine, prefill_tensor_parallel_size=2)).startswith(
        "prefill TP 2, decode TP 1")
    assert tensor_parallel_line(ClusterConfig(engine=engine, colocated=True, num_prefill=0,
                                              decode_tensor_parallel_size=2)).startswith("colocated TP 2 (")
