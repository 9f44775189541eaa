"""The prefill worker: computes a prompt's KV (chunked, prefix cache first), samples the first
token and publishes the blocks under a lease for a decode worker to pull.

A plain class; `cluster/launch/app.py` runs it as a Ray actor in its own process, with a
speculator factory that never proposes (`decode.spec.speculator.make_kv_only_speculator`: with an
EAGLE head it computes the head's KV and the hidden state the handle carries). The factory comes
as an argument: this role does not import the decode role.

A handed-off request costs its frontend one Ray call: with `PrefillCall.hand_on` this worker
streams the first deltas to the frontend in the engine turn that ends the prefill, starts the
named decode worker's `decode` itself, and answers when that call ends, with its error if it
raised (the lease released by then), so the frontend's failover reads it as its own call's.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import time
from dataclasses import replace

from cluster.config import WorkerConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.speculation import SpeculatorFactory
from cluster.errors import error_message
from cluster.token_stream import KeyedDelta, StreamBroken, encode_step
from cluster.transfer.producer import KVProducer, LeaseState
from cluster.transfer.progress import KVProgress
from cluster.types import Fork, SamplingParams, TokenDelta
from cluster.worker_base import EngineWorker
from cluster.worker_messages import (
    CONTROL,
    DecodeCall,
    HandOn,
    PrefillCall,
    PrefillResult,
    PrefillStats,
)
from prefill.handoff import PrefillHandoff, publish_first

log = logging.getLogger(__name__)
PEER_CALL_S = 10.0     # how long a decode worker's first call at a handshake may take


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, name: str, config: WorkerConfig, speculator_factory: SpeculatorFactory | None = None):
        super().__init__(name, config, speculator_factory=speculator_factory, hold_factory=PrefillHandoff)
        self.hold: PrefillHandoff = self.engine.hold_hook
        self._start_loop()
        self.progress = KVProgress(self._poll_producer, f"kv-{name}")
        self.producer = KVProducer(self.transport, self.engine.transfer_layout, self.engine.transfer_arena,
                                   self._lease_ended, lease_seconds=config.lease_seconds,
                                   checksums=config.checksums, mailbox=self.mailbox, on_work=self.progress.wake)
        # Requests with a hand-on until their decode call ends: request id -> the decode worker's
        # handle once called (None before), so an abort reaches it, or stops it being called.
        self._handing_on: dict[str, object | None] = {}
        self._aborted: set[str] = set()
        self._decode_workers: dict[str, object] = {}    # name -> Ray actor handle (the wiring's)

    async def hand_on_to(self, decode_workers: dict) -> None:
        """The decode workers this worker hands requests on to, by name (their Ray actor handles,
        given at each handshake: a handle stays valid across its actor's restarts). Each is
        called once here first: a handle's first call from this process, made from a request's
        event loop instead, could wait forever (seen with Ray 2.60 just after the cluster started)."""
        async def reach(name: str, handle) -> None:
            try:
                await asyncio.wait_for(handle.metadata.options(concurrency_group=CONTROL).remote(), PEER_CALL_S)
            except Exception as exc:  # noqa: BLE001 - a restarting peer: its first hand-on is the first call
                log.info("decode worker %s did not answer %s (%s)", name, self.name, error_message(exc))
        await asyncio.gather(*(reach(n, h) for n, h in decode_workers.items()))
        self._decode_workers.update(decode_workers)

    def _poll_producer(self) -> float | None:
        """On the KV progress thread: DONE is acknowledged and leases expire while a step runs."""
        self.producer.poll()
        return self.producer.poll_interval()

    def _lease_ended(self, request_id: str, state: LeaseState) -> None:
        """A lease ended: its blocks go back to the pool on the engine thread, which owns it."""
        self.loop.soon(lambda e: self.hold.lease_ended(request_id, state))

    async def prefill(self, call: PrefillCall) -> PrefillResult:
        """The prompt's KV and first token (and each fork's first token, from the same logits),
        published under one handle for a decode worker to continue."""
        await self._compile(call.sampling)
        first_only = [Fork(f.request_id, replace(f.sampling, max_tokens=1)) for f in call.forks]
        forks = {f.request_id: f.sampling for f in call.forks}
        prompt_ids = list(call.prompt_ids)

        def publish(e: LLMEngine, last: TokenDelta) -> PrefillResult:
            result = self._publish(e, call.request_id, prompt_ids, call.sampling, last, forks, call.export)
            return result if call.hand_on is None else self._stream_first(call, result)
        if call.hand_on is not None:
            self._handing_on[call.request_id] = None
        try:
            result = await self.loop.run(
                call.request_id, lambda e: self._add_request(e, prompt_ids, replace(call.sampling, max_tokens=1),
                                                             call.request_id, hold_kv=True, forks=first_only),
                on_end=publish, stats_sink=call.stats_sink)
            if call.hand_on is None or result.handle is None:
                return result
            return await self._hand_on(call, result)
        finally:
            self._handing_on.pop(call.request_id, None)
            self._aborted.discard(call.request_id)

    def _stream_first(self, call: PrefillCall, result: PrefillResult) -> PrefillResult:
        """On the engine thread, in the turn the prefill ended: every member's first delta to the
        frontend at once (the call answers only when the decode ends). A frontend that cannot be
        reached ends the request: its lease is released."""
        keys = {f.request_id: f.stream_key for f in call.forks} | {call.request_id: call.hand_on.key}
        firsts = result.first_deltas(tuple(keys))
        records = [KeyedDelta(keys[rid], d) for rid, d in firsts.items()]
        if not self.loop.sender.send(call.hand_on.sink, encode_step(records)):
            if result.handle is not None:
                self.producer.abort(call.request_id)
            raise StreamBroken(f"frontend {call.hand_on.sink.frontend} unreachable")
        return replace(result, streamed=True)

    async def _hand_on(self, call: PrefillCall, result: PrefillResult) -> PrefillResult:
        """Start the decode worker's `decode` on the published handle and wait for its end; its
        error, if any, goes back to the frontend in the result, the lease released first."""
        to: HandOn = call.hand_on
        worker = self._decode_workers.get(to.decode_name)
        if call.request_id in self._aborted or worker is None:    # aborted after its prefill, or nowhere to go
            await self._release(call.request_id)
            error = None if worker is None else RuntimeError(f"{self.name} knows no decode worker {to.decode_name}")
            return replace(result, decode_error=error)
        decode = DecodeCall(call.request_id, call.prompt_ids, call.sampling, result.handle, to.sink, to.key,
                            sent_at=to.sent_at or time.time(), forks=call.forks, tenant=to.tenant)
        ref = worker.decode.remote(decode)
        self._handing_on[call.request_id] = worker
        if call.request_id in self._aborted:      # aborted while it was being called
            self._abort_decode(call.request_id, worker)
        try:
            await ref
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - busy, failed or refused: the frontend's ladder decides
            log.info("decode worker %s did not end %s (%s)", to.decode_name, call.request_id, error_message(exc))
            await self._release(call.request_id)
            return replace(result, handle=None, handed_on=True, decode_error=_portable(exc))
        return replace(result, handle=None, handed_on=True)     # the handle was for the decode worker only

    async def _release(self, request_id: str) -> None:
        """The lease of a handoff that will not be pulled (its pins go at once, not at expiry)."""
        await self.loop.acall(lambda e: self.producer.abort(request_id))

    def _abort_decode(self, request_id: str, decode) -> None:
        decode.abort.options(concurrency_group=CONTROL).remote(request_id)

    def _publish(self, e: LLMEngine, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 last: TokenDelta, forks: dict[str, SamplingParams] | None = None,
                 export: bool = False) -> PrefillResult:
        """On the engine thread, in the turn that finished the prefill (prefill/handoff.py)."""
        first = publish_first(self.hold, self.producer, request_id, prompt_ids, sampling, last, forks or {}, export)
        delta = replace(last, token_ids=last.token_ids[:1], finish_reason=first.reason, num_output_tokens=1)
        return PrefillResult(request_id, delta, first.handle, first.forks)

    async def abort(self, request_id: str) -> None:
        """The request's prefill and lease here; a handed-on request's decode too, or, not yet
        handed on, it never will be."""
        if request_id in self._handing_on:
            self._aborted.add(request_id)
            decode = self._handing_on.get(request_id)
            if decode is not None:
                self._abort_decode(request_id, decode)

        def go(e: LLMEngine):
            e.abort(request_id)
            self.producer.abort(request_id)
        await self.loop.acall(go)

    def _role_stats(self) -> dict:
        return {"prefill": PrefillStats(leases=self.producer.num_active())}


def _portable(exc: Exception) -> BaseException:
    """A decode call's error as it can travel on to the frontend: the task's own exception (Ray's
    wrapper class of it does not pickle), or Ray's own error (a dead actor) as is."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an error that does not pickle travels as its message
        return RuntimeError(error_message(exc))
    return exc
