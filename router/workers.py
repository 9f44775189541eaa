"""The router's side of the worker actors: one typed client per worker, and which worker plays
which role. The stats poll over these clients is `router/stats_poll.py`.

Every call is a typed method taking and returning the frozen messages of
`cluster/worker_messages.py`: no method names as strings, no positional argument lists. Data calls
(`prefill`, `generate`, `decode`) run in the actor's default concurrency group; control calls
(`abort`, `stats`, the handshake) in its "control" group, so that they never queue behind the
streams. What comes back is checked for its type and version (`expect`) before it is read.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.kv.kv_events import KVEventBatch
from cluster.worker_messages import CONTROL, DecodeCall, GenerateCall, PrefillCall, PrefillResult, WorkerStats, expect


@dataclass(frozen=True)
class WorkerRoster:
    """Which worker plays which role, by name: what the wiring started, as the frontends are told."""
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    def role_of(self, name: str) -> str:
        if name in self.prefill:
            return "prefill"
        if name in self.decode:
            return "decode"
        raise KeyError(f"no worker {name!r} in the roster")

    @property
    def disaggregated(self) -> bool:
        """Both roles have workers: each prefill worker is handshaken with each decode worker."""
        return bool(self.prefill and self.decode)


class WorkerClient:
    """One worker actor (a prefill or decode worker) as the router and the driver call it."""

    def __init__(self, name: str, handle):
        self.name = name
        self.handle = handle

    def _control(self, method):
        return method.options(concurrency_group=CONTROL)

    # --- data calls ------------------------------------------------------------------------------
    async def prefill(self, call: PrefillCall) -> PrefillResult:
        return expect(await self.handle.prefill.remote(call), PrefillResult)

    def generate(self, call: GenerateCall):
        """Start a streamed request; its deltas come over the token stream. The returned ref
        resolves when it ends (with its `FinishReason`), or raises if the worker dies."""
        return self.handle.generate.remote(call)

    def decode(self, call: DecodeCall):
        """Start the decode of a handed-off request (as `generate`)."""
        return self.handle.decode.remote(call)

    # --- control calls ---------------------------------------------------------------------------
    async def abort(self, request_id: str) -> None:
        await self._control(self.handle.abort).remote(request_id)

    async def stats(self) -> WorkerStats:
        return expect(await self._control(self.handle.stats).remote(), WorkerStats)

    async def kv_events(self, epoch: str, cursor: int) -> KVEventBatch:
        return expect(await self._control(self.handle.kv_events).remote(epoch, cursor), KVEventBatch)

    async def metadata(self) -> bytes:
        return await self._control(self.handle.metadata).remote()

    async def add_peer(self, metadata: bytes) -> str:
        return await self._control(self.handle.add_peer).remote(metadata)

    async def hand_on_to(self, decode_workers: dict) -> None:
        """A prefill worker's decode peers, by name: the Ray actor handles it hands requests on to."""
        await self._control(self.handle.hand_on_to).remote(decode_workers)

    async def set_role(self, role: str) -> str:
        """A switchable worker's new role (cluster/launch/switchable.py; the admin drained it first)."""
        return await self._control(self.handle.set_role).remote(role)

    async def export_running(self, request_id: str, streamed: int) -> bytes | None:
        """A drained switchable worker's running request as a KV handle for a peer (None: recompute it)."""
        return await self._control(self.handle.export_running).remote(request_id, streamed)

    async def set_ready(self, incarnation: str) -> bool:
        return await self._control(self.handle.set_ready).remote(incarnation)

    async def unload_weights(self) -> int:
        """--max-loaded-models: release the model's weights and prefix cache (idle only); the bytes released."""
        return await self._control(self.handle.unload_weights).remote()

    async def load_weights(self) -> bool:
        """Load the released weights again (True: loaded now; False: they were loaded)."""
        return await self._control(self.handle.load_weights).remote()
