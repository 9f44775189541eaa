"""A worker whose role can change while it runs (`--switchable-roles`): one engine, one KV pool and
one set of weights with both roles' machinery beside them, a prefill worker's producer (hold hook,
leases, hand-on) and a decode worker's consumer (`DecodeHandoff`). Its `role` says which work the
router sends it; `set_role` changes it, with no reload: the KV pool is role-agnostic, and the
driver (cluster/launch/admin.py) has drained the worker's sequences to peers first. A drain
moves a running sequence's KV to a peer decode worker through the producer a prefill uses
(`export_running`): the peer pulls it as it would a prefill's.

It lives in the wiring layer because it joins the two roles, which never import each other. With
speculation off (the default) it serves each role as that role's own class does.
"""
from __future__ import annotations

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.sequence import SequenceStatus
from cluster.engine.speculation import SpeculatorFactory
from cluster.transfer.consumer import KVConsumer
from cluster.transfer.producer import KVProducer
from cluster.transfer.progress import KVProgress
from cluster.worker_base import EngineWorker
from decode.handoff import DecodeHandoff
from decode.spec.speculator import make_speculator
from decode.worker import DecodeWorker
from prefill.handoff import PrefillHandoff, PrefillLease
from prefill.worker import PrefillWorker

ROLES = ("prefill", "decode")


class SwitchableWorker(PrefillWorker, DecodeWorker):
    """Both roles' entry points on one engine (`prefill`, `hand_on_to`; `decode`, `generate`)."""

    def __init__(self, name: str, config: WorkerConfig, speculator_factory: SpeculatorFactory = make_speculator,
                 role: str = "decode"):
        EngineWorker.__init__(self, name, config, speculator_factory=speculator_factory,
                              hold_factory=PrefillHandoff)
        self.role = role
        self.hold: PrefillHandoff = self.engine.hold_hook
        self._start_loop(on_deltas=lambda deltas: self.handoff.observe(deltas))
        self.progress = KVProgress(self._poll_both, f"kv-{name}")
        self.producer = KVProducer(self.transport, self.engine.transfer_layout, self.engine.transfer_arena,
                                   self._lease_ended, lease_seconds=config.lease_seconds,
                                   checksums=config.checksums, mailbox=self.mailbox, on_work=self.progress.wake)
        consumer = KVConsumer(self.transport, self.engine.transfer_layout, self.engine.transfer_arena,
                              timeout_s=config.transfer_timeout_s, verify=config.checksums,
                              mailbox=self.mailbox, on_work=self.progress.wake)
        self.handoff = DecodeHandoff(name, self.loop, consumer, self.peer_blocks, self._start_generate)
        self._handing_on: dict[str, object | None] = {}
        self._aborted: set[str] = set()
        self._decode_workers: dict[str, object] = {}

    def _poll_both(self) -> float | None:
        """The one KV progress thread serves the producer's leases and the consumer's pulls."""
        waits = [w for w in (self._poll_producer(), self.handoff.poll()) if w is not None]
        return min(waits) if waits else None

    def set_role(self, role: str) -> str:
        """The work the router sends it from now on (its stats' `role`, the metrics' label)."""
        if role not in ROLES:
            raise ValueError(f"a worker's role is one of {ROLES}, got {role!r}")
        self.role = role
        return self.role

    async def abort(self, request_id: str) -> None:
        """Wherever the request is here: a prefill or its lease, a pull, or a running decode."""
        await PrefillWorker.abort(self, request_id)
        await DecodeWorker.abort(self, request_id)

    def _role_stats(self) -> dict:
        return {**PrefillWorker._role_stats(self), **DecodeWorker._role_stats(self)}

    async def export_running(self, request_id: str, streamed: int) -> bytes | None:
        """Hand a running sequence to a peer decode worker (a drain): stop it here keeping its
        blocks, and publish the KV of its prompt and first `streamed - 1` output tokens under a
        lease, the `streamed`-th (the last its client received) as the handle's first token. The
        peer's `decode` continues from there; its call here ends (ABORT, which no one reads). None
        when it cannot move (unknown, not running, forked, or not that far): it is recomputed."""
        def export(e: LLMEngine) -> bytes | None:
            seq = e.requests.seqs.get(request_id)
            keep_tokens = seq.num_prompt_tokens + streamed - 1 if seq is not None else 0
            if (seq is None or seq.forks or seq.status is not SequenceStatus.RUNNING or streamed < 1
                    or seq.num_output_tokens < streamed or seq.num_computed_tokens < keep_tokens):
                return None
            first = seq.output_token_ids[streamed - 1]
            keep = -(-keep_tokens // e.layout.block_size)
            blocks, seq.block_ids = list(seq.block_ids), []
            e.abort(request_id)                              # frees nothing: the blocks are ours now
            e.pool.free(reversed(blocks[keep:]))
            self.hold.leases[request_id] = PrefillLease(request_id, blocks[:keep], keep_tokens, seq)
            return self.hold.publish(self.producer, request_id, first)
        return await self.loop.acall(export)
