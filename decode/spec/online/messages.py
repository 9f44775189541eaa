"""What crosses between the decode workers and the online trainer (Ray calls; head weights as
safetensors bytes, parsed without pickle).

Only the head's parts after its attention's K/V projections are trained (`TRAINABLE`): the head's
KV of every position the target computes (in shared and prefix-cached blocks, and what a prefill
worker computes for a handoff) depends only on the frozen parts, so it is the same for every
version and every tenant's variant. A swap needs no recompute, and tenants still share blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load, save

from cluster.worker_messages import SpecHeadStats

LAYER = "model.layers.0."
# Checkpoint names of the tensors an online round trains (EAGLE-3's norm and LM head where present).
TRAINABLE = tuple(LAYER + n for n in ("self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))
TRAINABLE_EAGLE3 = TRAINABLE + ("norm.weight", "lm_head.weight")
BASE_VERSION = 0    # the head shipped beside the model (or --eagle-head): every tenant starts on it


@dataclass(frozen=True)
class ServedSample:
    """One served request's stretch of positions: tokens x_j and the head's input features f_j (the
    target's hidden state, fused for EAGLE-3) at positions `first_pos`.. in order."""
    tenant: str
    tokens: tuple[int, ...]
    features: torch.Tensor      # [len(tokens), H], CPU, the KV layout's dtype
    first_pos: int


@dataclass(frozen=True)
class AcceptanceCount:
    """A decode worker's EAGLE verifications with one head version since the trainer's last take."""
    tenant: str
    version: int
    steps: int
    accepted: int       # draft tokens accepted, over `steps` verifications


@dataclass(frozen=True)
class OnlineReport:
    """What `DecodeWorker.spec_online_take` answers: the samples finished since the last take,
    acceptance per (tenant, version), and the versions live there (a restarted worker: its own
    incarnation, every tenant on the base head)."""
    worker: str
    incarnation: str
    samples: tuple[ServedSample, ...]
    acceptance: tuple[AcceptanceCount, ...]
    live: tuple[SpecHeadStats, ...]


@dataclass(frozen=True)
class HeadUpdate:
    """A tenant's head version: the trained tensors (safetensors bytes, `TRAINABLE` names) over the
    base head, for the target whose weights have `target_fingerprint`."""
    tenant: str
    version: int
    target_fingerprint: str
    base_head: str              # the base head directory's name (the worker checks it serves that one)
    tensors: bytes

    def __post_init__(self):
        if not isinstance(self.tensors, bytes) or self.version <= BASE_VERSION:
            raise ValueError("HeadUpdate: safetensors bytes and a version above the base head's")


def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.detach().to(torch.float32).contiguous().cpu() for k, v in tensors.items()})


def unpack_tensors(data: bytes, allowed: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of a `HeadUpdate`: exactly `allowed` names (safetensors: no code runs)."""
    tensors = load(data)
    if sorted(tensors) != sorted(allowed):
        raise ValueError(f"a head update must carry exactly {', '.join(allowed)}; got {', '.join(sorted(tensors))}")
    return tensors
