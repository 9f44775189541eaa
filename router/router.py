"""Orchestrates one request: pick workers, prefill (or not), hand the KV to decode, stream tokens.

The first token is yielded as soon as the prefill worker returns it, before the decode worker has
pulled the KV. The decode worker's deltas arrive over the token stream (`TokenReceiver`, one frame
per engine step for all of this frontend's requests); the control call that started them returns
when the request ends, and raises if the worker dies. A prefill worker that fails is replaced by another (or by the decode worker
itself); a decode worker that fails mid-stream is replaced by another that recomputes from the
prompt plus every token already streamed, so the client loses nothing but time.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from cluster.kv.hashing import hash_prefix_blocks
from cluster.token_stream import StreamBroken, TokenReceiver
from cluster.types import GenerateRequest, TokenDelta, merge_deltas
from router.policy import WorkerView

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    block_size: int = 16
    colocated: bool = False
    local_prefill_max_tokens: int = 32       # prompts this short are prefilled on the decode worker
    local_prefill_cached_fraction: float = 0.9  # ... and so are prompts this cached there
    max_in_flight: int = 256
    final_delta_grace_s: float = 30.0        # after a stream's call returns, its last frame must arrive


class Router:
    def __init__(self, config: RouterConfig, policy, prefill: dict, decode: dict, receiver: TokenReceiver,
                 metrics=None):
        """`prefill`/`decode`: worker name -> client (see cluster/app.py)."""
        self.config = config
        self.receiver = receiver
        self.policy = policy
        self.clients = {**prefill, **decode}
        self.views = {n: WorkerView(n, "prefill") for n in prefill} | {n: WorkerView(n, "decode") for n in decode}
        self.in_flight = 0
        self.activity = asyncio.Event()          # set by each new request: wakes an idle stats poll
        self.metrics = metrics
        self.active: dict[str, list[str]] = {}   # request id -> workers holding it
        self.recoveries = 0                      # streams continued on another worker after a failure

    def _healthy(self, role: str) -> list[WorkerView]:
        return [v for v in self.views.values() if v.role == role and v.healthy]

    def worker_polled(self, name: str, stats: dict | None) -> None:
        """A stats poll's outcome for the routing view: None when the worker did not answer. A
        worker that answers again after that is a restart, whose prefix cache is empty."""
        view = self.views[name]
        if stats is None:
            view.healthy = False
            return
        if not view.healthy:
            view.cached.clear()
        self.update_stats(stats)
        view.healthy = True

    def update_stats(self, stats: dict) -> None:
        view = self.views.get(stats.get("name"))
        if view is not None:
            view.blocks_free = stats["blocks_free"]
            view.blocks_total = stats["blocks_total"]
            view.running = stats.get("running", 0)

    async def abort(self, request_id: str) -> bool:
        workers = self.active.get(request_id, [])
        await asyncio.gather(*(self.clients[w].abort(request_id) for w in workers), return_exceptions=True)
        return bool(workers)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if req.request_id in self.active:
            raise ValueError(f"request_id {req.request_id!r} is already running")
        self.in_flight += 1
        self.activity.set()
        self.active[req.request_id] = []
        streamed: list[int] = []
        try:
            async for delta in self._generate(req, streamed):
                streamed.extend(delta.token_ids)
                yield delta
            self.active[req.request_id] = []     # finished normally: nothing to abort
        finally:
            self.in_flight -= 1
            if self.active.get(req.request_id):
                await asyncio.shield(self.abort(req.request_id))
            self.active.pop(req.request_id, None)

    async def _generate(self, req: GenerateRequest, streamed: list[int]) -> AsyncIterator[TokenDelta]:
        hashes = hash_prefix_blocks(req.prompt_token_ids, self.config.block_size, req.sampling.cache_salt)
        decoders = self._healthy("decode")
        if not decoders:
            raise RuntimeError("no healthy decode worker")
        dec = self.policy.choose_decode(hashes, decoders)
        cached = dec.cached_prefix(hashes)
        local = (self.config.colocated or len(req.prompt_token_ids) <= self.config.local_prefill_max_tokens
                 or (hashes and cached >= self.config.local_prefill_cached_fraction * len(hashes))
                 or not self._healthy("prefill"))
        prefilled = None
        if not local:
            dec.in_flight += 1          # counted from the choice on, so requests arriving together spread
            try:
                prefilled = await self._prefill(req, hashes)
            finally:
                dec.in_flight -= 1
            if prefilled is None:
                local = True            # every prefill worker failed: the decode worker prefills
            else:
                result, first = prefilled
                yield first
                if first.finished:
                    return
        async for d in self._decode(req, dec, hashes, None if local else result, streamed):
            yield d

    async def _prefill(self, req: GenerateRequest, hashes):
        tried = set()
        while True:
            candidates = [v for v in self._healthy("prefill") if v.name not in tried]
            if not candidates:
                return None
            view = self.policy.choose_prefill(hashes, candidates)
            tried.add(view.name)
            self.active[req.request_id].append(view.name)
            view.in_flight += 1
            t0 = time.perf_counter()
            try:
                result = await self.clients[view.name].prefill(req.request_id, list(req.prompt_token_ids), req.sampling)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dead worker: try the next one
                log.warning("prefill worker %s failed (%s); trying another", view.name, exc)
                view.healthy = False
                continue
            finally:
                view.in_flight -= 1
            view.remember(hashes)
            if self.metrics:
                self.metrics.observe_prefill(time.perf_counter() - t0)
            first = TokenDelta(req.request_id, (result.first_token,) if result.first_token >= 0 else (),
                               result.text, result.finish_reason, result.logprobs, result.num_prompt_tokens, 1,
                               result.num_cached_tokens)
            if result.finish_reason is not None:
                self.active[req.request_id].remove(view.name)
            return result, first

    async def _decode(self, req: GenerateRequest, dec: WorkerView, hashes, prefill_result, streamed):
        attempt = 0
        while True:
            attempt += 1
            view = dec
            self.active[req.request_id].append(view.name)
            view.in_flight += 1
            client = self.clients[view.name]
            try:
                if prefill_result is not None and attempt == 1:
                    stream = self._stream(client, "decode", req.request_id, list(req.prompt_token_ids),
                                          req.sampling, prefill_result.handle, sent_at=time.time())
                elif not streamed:
                    stream = self._stream(client, "generate", req.request_id, list(req.prompt_token_ids),
                                          req.sampling)
                else:
                    # Recover on another worker from everything the client already has.
                    left = req.sampling.max_tokens - len(streamed)
                    stream = self._stream(client, "generate", req.request_id, [*req.prompt_token_ids, *streamed],
                                          replace(req.sampling, max_tokens=max(1, left)))
                async for d in stream:
                    yield d
                dec.remember(hashes)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dead worker: continue elsewhere
                log.warning("decode worker %s failed (%s)", dec.name, exc)
                dec.healthy = False
                self.recoveries += 1
                others = self._healthy("decode")
                if not others or attempt > 3:
                    raise
                dec = self.policy.choose_decode(hashes, others)
            finally:
                view.in_flight -= 1

    async def _stream(self, client, method: str, request_id: str, *args, **kwargs) -> AsyncIterator[TokenDelta]:
        """One attempt on one worker: start it with a control call, read its deltas from the token
        stream. Several deltas that arrived together leave as one (a lagging reader coalesces)."""
        key, queue = self.receiver.open(request_id)
        call = client.start(method, request_id, *args, self.receiver.address, key, **kwargs)
        watch = asyncio.ensure_future(self._watch(call, queue))
        try:
            while True:
                items = await queue.take()
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                delta = merge_deltas(items)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self.receiver.close_key(key)
            watch.cancel()

    async def _watch(self, call, queue) -> None:
        """The attempt's control call: it raises if the worker dies (Ray knows), and returns once the
        request has ended, by which time its last frame is on the wire."""
        try:
            await call
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            queue.push(exc)
            return
        await asyncio.sleep(self.config.final_delta_grace_s)
        queue.push(StreamBroken("the worker ended the request but its last delta never arrived"))

