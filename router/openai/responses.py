"""One OpenAI job's output: its samples' deltas, as they come from the router, turned into a whole
response body (`JobResponse.collect`) or into server-sent events (`JobResponse.events`), with each
sample's request metrics tracked on the way. `router/openai/http_server.py` decides which, and what a
client that leaves costs; `router/openai/protocol.py` holds the pieces (choices, usage, logprobs).

A router failure becomes an OpenAI error: a status and body before any byte is sent (a whole
response), or one error event in a stream whose headers are already out.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from cluster.errors import RequestError, error_message
from cluster.types import TokenDelta
from router.merging import merge_streams
from router.openai.protocol import ApiError, Choice, Endpoint, Job, LogprobFormatter, PromptGroup, usage
from router.openai.test_time import test_time_body, test_time_usage
from router.openai.tool_calls import ToolCallParser, parse_text
from router.test_time import run_test_time, sample_requests

_STATUS = {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 429, "NOT_FOUND": 404, "ALREADY_EXISTS": 400,
           "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400}


class JobResponse:
    def __init__(self, job: Job, router, logprobs: LogprobFormatter, metrics=None):
        """`router`: where the samples run (one `Router.generate` per prompt, its n samples a
        group); `metrics`: the frontend's `ClusterMetrics`, each sample tracked from now on."""
        self.job = job
        self.router = router
        self.logprobs = logprobs
        # Internal to this job: request id -> its choice's index, and -> its tracker.
        self._index = {r.request_id: g.first_index + j for g in job.groups for j, r in enumerate(g.requests)}
        self._groups = {g.first_index + j: g for g in job.groups for j in range(len(g.requests))}
        self._metrics = metrics
        self._trackers = {r.request_id: metrics.track(r) if metrics else None for g in job.groups for r in g.requests}
        self._choices = {i: Choice(i) for i in self._index.values()}
        # With tools: each streamed choice's text is taken apart into content and calls as it comes.
        self._parsers = {i: ToolCallParser() for i in self._choices} if job.tools is not None else {}

    def _deltas(self) -> AsyncIterator[TokenDelta]:
        """Every sample's deltas, as they come: one router stream per prompt (its n samples a group)."""
        streams = [self.router.generate(g.requests[0], g.requests[1:]) for g in self.job.groups]
        return streams[0] if len(streams) == 1 else merge_streams(streams)

    def _add(self, d: TokenDelta) -> Choice:
        t = self._trackers.get(d.request_id)
        if t is not None:
            t.tokens(len(d.token_ids), d)
        c = self._choices[self._index[d.request_id]]
        c.add(d)
        return c

    def finish_trackers(self, reason: str) -> None:
        """The job ended early (`abort`: the client left; `error`): every sample not yet finished."""
        for t in self._trackers.values():
            if t is not None and not t.done:
                t.finish(reason)

    # --- a whole response ---------------------------------------------------------------------
    async def collect(self) -> dict:
        if self.job.test_time is not None:
            return await self._test_time()
        stream = self._deltas()
        try:
            async for d in stream:
                self._add(d)
        except Exception as exc:  # noqa: BLE001 - the router's refusal or failure, as an HTTP status
            self.finish_trackers("error")
            raise as_api_error(exc) from None
        finally:
            await stream.aclose()
        return self._response()

    async def _test_time(self) -> dict:
        """The job's one prompt's samples (router/test_time.py); the chosen one is the one choice."""
        lead = self.job.groups[0].requests[0]
        samples = sample_requests(lead, self.job.test_time)
        trackers = {r.request_id: self._trackers[lead.request_id] if j == 0 else
                    (self._metrics.track(r) if self._metrics else None) for j, r in enumerate(samples)}
        self._trackers = trackers

        def observe(d: TokenDelta) -> None:
            if (t := trackers[d.request_id]) is not None:
                t.tokens(len(d.token_ids), d)
        try:
            outcome = await run_test_time(self.router, samples, self.job.test_time, observe)
        except Exception as exc:  # noqa: BLE001 - the router's refusal or failure, as an HTTP status
            self.finish_trackers("error")
            raise as_api_error(exc) from None
        for t in trackers.values():       # cut short by early stop (those never started made no series)
            if t is not None and t.last is not None and not t.done:
                t.finish("abort")
        best = outcome.best
        self._choices[0].add(TokenDelta(lead.request_id, best.token_ids, best.text, best.finish_reason,
                                        best.logprobs, outcome.prompt_tokens, len(best.token_ids),
                                        outcome.cached_tokens))
        return {**self._response(), "usage": test_time_usage(outcome), "test_time": test_time_body(outcome)}

    def _response(self) -> dict:
        job, choices, out = self.job, self._choices, []
        for g in job.groups:
            for j in range(len(g.requests)):
                c = choices[g.first_index + j]
                if job.endpoint is Endpoint.CHAT:
                    message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
                    if job.tools is not None:
                        content, calls = parse_text(c.text)
                        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                        reason = "tool_calls" if calls and reason == "stop" else reason
                    item = {"index": c.index, "message": message,
                            "logprobs": self.logprobs.chat(c.logprobs) if job.logprobs is not None else None,
                            "finish_reason": reason}
                else:
                    prompt_lps = choices[g.first_index].prompt_logprobs
                    item = {"index": c.index, "text": g.echo_text + c.text, "finish_reason": c.finish_reason,
                            "logprobs": self._completion_logprobs(g, c, c.logprobs, c.token_ids, prompt_lps)}
                if job.return_token_ids:
                    item["token_ids"] = c.token_ids
                out.append(item)
        return {"id": job.id, "object": job.endpoint.value, "created": job.created, "model": job.model,
                "choices": out, "usage": usage(job, choices)}

    def _completion_logprobs(self, group: PromptGroup, c: Choice, entries, ids, prompt_lps=None) -> dict | None:
        """`prompt_lps`: given on a choice's first chunk when echoing (the prompt's first token has none)."""
        if self.job.logprobs is None:
            return None
        if prompt_lps is not None and self.job.echo:
            lead = group.requests[0].prompt_token_ids
            entries, ids = [None, *prompt_lps, *entries], [*lead, *ids]
        lp, c.offset = self.logprobs.completion(list(entries), list(ids), c.offset)
        return lp

    # --- server-sent events -------------------------------------------------------------------
    async def events(self) -> AsyncIterator[bytes]:
        job, choices = self.job, self._choices
        stream = self._deltas()
        head = {"id": job.id, "object": f"{job.endpoint.value}.chunk" if job.endpoint is Endpoint.CHAT
                else job.endpoint.value, "created": job.created, "model": job.model}
        try:
            async for d in stream:
                c = self._add(d)
                group = self._groups[c.index]
                # A group's lead streams first, and its first delta carries the prompt's logprobs.
                prompt_lps = choices[group.first_index].prompt_logprobs
                for chunk in self._chunks(group, c, d, prompt_lps):
                    yield _event({**head, "choices": [chunk]})
            if job.include_usage:
                yield _event({**head, "choices": [], "usage": usage(job, choices)})
        except asyncio.CancelledError:
            self.finish_trackers("abort")
            raise
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream
            self.finish_trackers("error")
            yield _event(as_api_error(exc).body())
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"

    def _chunks(self, group: PromptGroup, c: Choice, d: TokenDelta, prompt_lps) -> list[dict]:
        job = self.job
        first = not c.started
        c.started = True
        reason = c.finish_reason if d.finish_reason is not None else None
        if job.endpoint is Endpoint.CHAT:
            return self._chat_chunks(c, d, first, reason)
        text = (group.echo_text if first else "") + d.text
        chunk = {"index": c.index, "text": text, "finish_reason": reason,
                 "logprobs": self._completion_logprobs(group, c, d.logprobs, d.token_ids,
                                                       prompt_lps if first else None)}
        if job.return_token_ids:
            chunk["token_ids"] = list(d.token_ids)
        return [chunk]

    def _chat_chunks(self, c: Choice, d: TokenDelta, first: bool, reason: str | None) -> list[dict]:
        """A chat choice's chunks for one delta: its role first, its content, its finish reason last."""
        out = []
        if first:
            out.append({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
        text, calls = d.text, []
        parser = self._parsers.get(c.index)
        if parser is not None:
            text, calls = parser.feed(d.text)
            if reason is not None:
                text += parser.finish()
                reason = "tool_calls" if parser.calls and reason == "stop" else reason
        if text or (d.token_ids and parser is None):
            chunk = {"index": c.index, "delta": {"content": text}, "finish_reason": None,
                     "logprobs": self.logprobs.chat(list(d.logprobs)) if self.job.logprobs is not None else None}
            if self.job.return_token_ids:
                chunk["token_ids"] = list(d.token_ids)
            out.append(chunk)
        out += [{"index": c.index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}
                for call in calls]
        if reason is not None:
            out.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return out


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def as_api_error(exc: BaseException) -> ApiError:
    """A router failure as OpenAI's error: the request's own fault keeps its status; no worker to
    serve it (or the server stopping) is 503."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        status = _STATUS.get(getattr(exc, "code", "INVALID_ARGUMENT"), 400)
        return ApiError(status, error_message(exc), param="prompt" if "prompt" in str(exc)[:20] else None)
    return ApiError(503, error_message(exc), code="unavailable")
