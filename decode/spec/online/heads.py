"""A decode worker's EAGLE heads per tenant: the base head for every tenant until the trainer
activates another version for it.

A version arrives in two phases, so that every worker swaps to the same one: `stage` checks the
update (the target's weight fingerprint, the base head, exactly the trainable tensors) and builds the
head off the engine thread; `activate` (on the engine thread, between steps) makes a staged version,
or the base, the tenant's live head. Only the parts after the head's KV projections differ between
versions (messages.py), so the KV already in the blocks stays right and a running request simply
drafts with the new head from its next step on.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.worker_messages import SpecHeadStats
from decode.spec.online.messages import BASE_VERSION, HeadUpdate, unpack_tensors


@dataclass
class _Live:
    version: int
    head: torch.nn.Module
    swaps: int = 0
    rollbacks: int = 0


class HeadVariants:
    def __init__(self, base: torch.nn.Module, build: Callable[[dict], torch.nn.Module], trainable: tuple[str, ...],
                 target_fingerprint: str, base_head: str):
        """`build(tensors)`: the base head with these checkpoint tensors replaced."""
        self.base = base
        self.build = build
        self.trainable = trainable
        self.target_fingerprint = target_fingerprint
        self.base_head = base_head
        self.live: dict[str, _Live] = {}
        self._staged: dict[tuple[str, int], torch.nn.Module] = {}

    def head_for(self, tenant: str) -> torch.nn.Module:
        live = self.live.get(tenant)
        return self.base if live is None else live.head

    def version_of(self, tenant: str) -> int:
        live = self.live.get(tenant)
        return BASE_VERSION if live is None else live.version

    def build_update(self, update: HeadUpdate) -> torch.nn.Module:
        """The head of `update`, checked (any thread: touches no engine state)."""
        if update.target_fingerprint != self.target_fingerprint:
            raise ValueError(f"head version {update.version} for tenant {update.tenant!r} was trained for other "
                             f"target weights ({update.target_fingerprint}) than this worker serves "
                             f"({self.target_fingerprint}): refused")
        if update.base_head != self.base_head:
            raise ValueError(f"head version {update.version} adapts the head {update.base_head!r}, but this worker "
                             f"serves {self.base_head!r}: refused")
        return self.build(unpack_tensors(update.tensors, self.trainable))

    def stage(self, update: HeadUpdate, head: torch.nn.Module) -> None:
        for key in [k for k in self._staged if k[0] == update.tenant and k[1] < update.version - 1]:
            del self._staged[key]     # a tenant keeps its last staged versions only
        self._staged[(update.tenant, update.version)] = head

    def activate(self, tenant: str, version: int, rollback: bool = False) -> None:
        """Engine thread, between steps: `version` (staged, or the base) becomes the tenant's head."""
        live = self.live.get(tenant)
        if live is not None and live.version == version:
            return
        if version == BASE_VERSION:
            head = self.base
        elif (tenant, version) in self._staged:
            head = self._staged[(tenant, version)]
        elif live is not None and live.version == version:
            head = live.head
        else:
            raise KeyError(f"head version {version} of tenant {tenant!r} was not staged on this worker")
        swaps = live.swaps + 1 if live else 1
        rollbacks = (live.rollbacks if live else 0) + int(rollback)
        # Copied, not changed in place: stats polls read `live` from another thread.
        self.live = {**self.live, tenant: _Live(version, head, swaps, rollbacks)}

    def versions(self) -> tuple[SpecHeadStats, ...]:
        return tuple(SpecHeadStats(t, v.version, v.swaps, v.rollbacks) for t, v in sorted(self.live.items()))
