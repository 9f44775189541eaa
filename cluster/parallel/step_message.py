"""The step message: what rank 0 broadcasts to the other ranks once per forward pass, so that they
run the same pass over their shards: the flat token run, positions, the `AttentionBatch` (each
rank prepares its own backend's metadata from it) and the rows whose logits are wanted.

Encoded as one msgpack map (int64 tensors as raw bytes; never pickle), sent as its length then
its bytes. Its `op` says what the followers do: `pass` (the forward pass), `gather` / `scatter`
(blocks of KV to or from rank 0's full-head export arena, `kv_export.py`), `experts` (the expert
balancer's new placement, every sparse layer's, `expert_balancer.py`), `stop` (end the loop).
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack
import torch

from cluster.model.attention import AttentionBatch, PrefillSpan
from cluster.parallel.group import RankGroup

VERSION = 2
OPS = ("pass", "gather", "scatter", "experts", "stop")


@dataclass(frozen=True)
class StepMessage:
    input_ids: torch.Tensor        # [T] long
    positions: torch.Tensor        # [T] long
    batch: AttentionBatch
    logits_indices: torch.Tensor   # [R] long
    op: str = "pass"
    blocks: tuple[int, ...] = ()   # gather / scatter: the block ids
    # experts: per sparse layer, per rank, the logical expert in each slot
    placement: tuple[tuple[tuple[int, ...], ...], ...] = ()

    @property
    def stop(self) -> bool:
        return self.op == "stop"


def _ints(t: torch.Tensor) -> bytes:
    return t.to("cpu", torch.int64).contiguous().numpy().tobytes()


def _tensor(raw: bytes, device: torch.device) -> torch.Tensor:
    if not raw:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(bytearray(raw), dtype=torch.int64).to(device)


def _span(s: PrefillSpan) -> list:
    return [s.query_start, s.query_len, s.context_len, list(s.block_table), list(s.tree)]


def _unspan(v: list) -> PrefillSpan:
    return PrefillSpan(v[0], v[1], v[2], tuple(v[3]), tuple(v[4]))


def encode(msg: StepMessage) -> bytes:
    b = msg.batch
    return msgpack.packb({
        "v": VERSION, "op": msg.op, "blocks": list(msg.blocks),
        "placement": [[list(slots) for slots in layer] for layer in msg.placement],
        "ids": _ints(msg.input_ids), "pos": _ints(msg.positions),
        "rows": _ints(msg.logits_indices), "slots": _ints(b.slot_mapping), "block_size": b.block_size,
        "num_decode": b.num_decode, "decode_lens": list(b.decode_context_lens),
        "decode_tables": [list(t) for t in b.decode_block_tables],
        "prefills": [_span(s) for s in b.prefills], "verifies": [_span(s) for s in b.verifies]})


def decode(raw: bytes, device: torch.device) -> StepMessage:
    m = msgpack.unpackb(raw)
    if m["v"] != VERSION or m["op"] not in OPS:
        raise ValueError(f"step message version {m['v']} op {m['op']!r}, this rank reads {VERSION} {OPS}")
    batch = AttentionBatch(num_decode=m["num_decode"], decode_context_lens=tuple(m["decode_lens"]),
                           decode_block_tables=tuple(tuple(t) for t in m["decode_tables"]),
                           prefills=tuple(_unspan(s) for s in m["prefills"]),
                           slot_mapping=_tensor(m["slots"], device), block_size=m["block_size"],
                           verifies=tuple(_unspan(s) for s in m["verifies"]))
    return StepMessage(_tensor(m["ids"], device), _tensor(m["pos"], device), batch, _tensor(m["rows"], device),
                       m["op"], tuple(m["blocks"]),
                       tuple(tuple(tuple(slots) for slots in layer) for layer in m["placement"]))


def control_message(device: torch.device, op: str, blocks: tuple[int, ...] = (), placement: tuple = ()) -> StepMessage:
    """A message without a pass: stop, a gather or scatter of `blocks`, or the experts' `placement`."""
    empty = torch.empty(0, dtype=torch.long, device=device)
    return StepMessage(empty, empty, AttentionBatch(0, (), (), (), empty, 1), empty, op, tuple(blocks), placement)


def stop_message(device: torch.device) -> StepMessage:
    return control_message(device, "stop")


class StepSender:
    """Rank 0's side: one broadcast of the length, one of the bytes, per forward pass."""

    def __init__(self, group: RankGroup):
        self.group = group
        self.messages = 0

    def send(self, msg: StepMessage) -> None:
        raw = encode(msg)
        self.group.broadcast(torch.tensor([len(raw)], dtype=torch.int64, device=self.group.device))
        self.group.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.group.device))
        self.messages += 1


def receive(group: RankGroup) -> StepMessage:
    """A follower's side: waits (without the deadline: the worker may be idle) for the next message."""
    size = group.wait_for_step(torch.zeros(1, dtype=torch.int64, device=group.device))
    raw = group.broadcast(torch.empty(int(size.item()), dtype=torch.uint8, device=group.device))
    return decode(raw.cpu().numpy().tobytes(), group.device)
