"""The OpenAI-compatible HTTP API, beside gRPC on the same frontend: same router, same limits,
same keys, same metrics. Starlette on uvicorn, in the frontend's own event loop.

  POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events, `data: [DONE]`)
  GET  /v1/models, /v1/models/{id}                  GET /health (503 until every worker is ready)
  GET  /metrics                                     (the cluster's, where this frontend holds them)
  POST /tokenize, POST /detokenize, GET /version    (vLLM's; router/openai/tokenization.py)

Statuses: 400 naming the bad field (router/openai/protocol.py runs the gRPC validation), 401
without a valid `Authorization: Bearer` key when keys are set (hmac.compare_digest; `/metrics`
too), 404 for an unknown model, 408 for a body not received within its timeout, 413 for a body
over the limit (counted while it is read, whatever Content-Length says), 429 when no in-flight slot
frees up in time (router/admission.py), 503 while no worker can serve (not ready, shutting down).
A client that disconnects, mid-stream or while waiting for a whole response, aborts its requests
on every worker.

A request's order of work, cheapest first: key, body (bounded in size and time), JSON (parsed off
the loop), its sample count against the bounds, admission (a slot for every sample), and only then
tokenization and template rendering (off the loop, router/offload.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
import tempfile
from dataclasses import replace

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.admission import SHUTTING_DOWN, Admission, Refused, RefusedWhy, Ticket
from router.connections import ConnectionLimits, guarded_h11
from router.offload import Offload
from router.openai.protocol import ApiError, Endpoint, Job, LogprobFormatter, check_body, parse_chat, \
    parse_completion, samples_needed
from router.openai.responses import JobResponse
from router.openai.test_time import parse_test_time
from router.openai.tokenization import TokenizationRoutes
from router.served_models import ServedModels, UnknownModel
from router.skills import AUTO
from router.validation import clip

log = logging.getLogger(__name__)

class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling (the process's owner, the CLI, stops it) and with a
    tick of 1 s instead of 0.1 s: the tick refreshes the Date header (once a second anyway) and
    looks for `should_exit`, which `exit_now` also signals at once. An idle driver's main thread
    went from 5.0 to 2.0 ms of CPU a second (Zen 3)."""

    TICK_S = 1.0

    def capture_signals(self):
        return contextlib.nullcontext()

    async def main_loop(self) -> None:
        self._exit = asyncio.Event()
        ticks = 0
        while not await self.on_tick(ticks):
            ticks = (ticks + 10) % 864000        # uvicorn's counter: a multiple of 10 is "a second passed"
            try:
                await asyncio.wait_for(self._exit.wait(), self.TICK_S)
            except asyncio.TimeoutError:
                pass

    def exit_now(self) -> None:
        self.should_exit = True
        if getattr(self, "_exit", None) is not None:
            self._exit.set()


class OpenAIServer:
    def __init__(self, service, tokenizer, chat_template, metrics_registry=None,
                 connections: ConnectionLimits = ConnectionLimits()):
        """`service`: the frontend's gRPC InferenceService (router, limits, keys, metrics, admission
        and the validation pool, shared by both APIs)."""
        self.service = service
        self.router = service.router
        self.limits = service.limits
        self.admission: Admission = service.admission
        self.offload: Offload = service.offload
        self.tokenizer = tokenizer
        self.tokenize_rendered = service.codec.rendered
        self.chat_template = chat_template
        self.max_body_bytes = service.limits.bounds.max_body_bytes
        self.connections = connections
        self.metrics_registry = metrics_registry
        self.served: ServedModels | None = None     # set when this port serves several models
        self._token_text: dict[int, str] = {}
        self.logprobs = LogprobFormatter(self.token_text)
        self.server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.port = 0
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            *TokenizationRoutes(self, service.codec, chat_template, service.info.version).routes(),
        ], exception_handlers={ApiError: self._api_error, 404: self._not_found, 405: self._not_allowed})

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self, host: str, port: int, reuse_port: bool = False, tls: tuple[bytes, bytes] | None = None,
                    client_ca: bytes | None = None) -> int:
        """Listen on host:port (port 0 picks one). `reuse_port`: several frontend processes share it.
        `tls` (key, certificate chain; PEM) serves HTTPS; `client_ca` also requires client
        certificates signed by it (mutual TLS), as the gRPC port does."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        if client_ca and not tls:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        context = _ssl_context(tls, client_ca) if tls else None
        limits = self.connections
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2, http=guarded_h11(limits),
                                timeout_keep_alive=limits.http_idle_timeout_s,
                                limit_concurrency=limits.http_max_connections,
                                ssl_context_factory=(lambda _config, _default: context) if context else None)
        self.server = _QuietServer(config)
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.exit_now()
            await asyncio.gather(self._task, return_exceptions=True)

    # --- plumbing -----------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or for a piece of a UTF-8 character OpenAI's
        "bytes:\\xNN" form (so two such tokens never share a name in top_logprobs)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = _raw_bytes(self.tokenizer.id_to_token(token_id)) if "\ufffd" in text else None
            if raw is not None:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_text[token_id] = text
        return text

    async def _api_error(self, request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def _not_found(self, request, exc) -> JSONResponse:
        return JSONResponse(ApiError(404, f"no route {clip(request.url.path)}").body(), status_code=404)

    async def _not_allowed(self, request, exc) -> JSONResponse:
        return JSONResponse(ApiError(405, f"{request.method} is not allowed on {clip(request.url.path)}",
                                     type_="invalid_request_error").body(), status_code=405)

    def _authorize(self, request: Request) -> str:
        """The caller's tenant ("" when the server has no keys)."""
        tenant = self.service.tenant_of(request.headers.get("authorization", ""))
        if tenant is None:
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        return tenant

    async def _body(self, request: Request, tenant: str):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"the body has {declared} bytes; the limit is {self.max_body_bytes}")
        data = bytearray()
        try:
            async with asyncio.timeout(self.connections.http_body_timeout_s):
                async for chunk in request.stream():
                    data += chunk
                    if len(data) > self.max_body_bytes:
                        raise ApiError(413, f"the body is over the limit of {self.max_body_bytes} bytes")
        except ClientDisconnect:
            raise ApiError(400, "the client disconnected before sending the whole body") from None
        except TimeoutError:
            raise ApiError(408, f"the body did not arrive within {self.connections.http_body_timeout_s:g}s",
                           code="request_timeout") from None
        return await self._offload(tenant, _parse_json, bytes(data), self.limits.bounds.max_json_depth)

    async def _offload(self, tenant: str, fn, *args):
        try:
            return await self.offload.run(tenant, fn, *args)
        except Refused as exc:
            raise _refusal(exc) from None

    async def _admit(self, tenant: str, slots: int) -> Ticket:
        try:
            return await self.admission.admit(tenant, slots, self.router.closing)
        except Refused as exc:
            raise _refusal(exc) from None

    # --- routes ---------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.router.closing or self.admission.closed:
            return JSONResponse(ApiError(503, SHUTTING_DOWN).body(), status_code=503)
        if self.router.ready:
            return Response(status_code=200)
        return JSONResponse(ApiError(503, "not ready: workers are still loading or restarting").body(),
                            status_code=503)

    async def metrics(self, request: Request) -> Response:
        self._authorize(request)      # tenant names and their counts: not for anyone who can reach the port
        if self.metrics_registry is None:
            raise ApiError(404, "metrics are served on the --metrics-port of the driver")
        return Response(generate_latest(self.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self) -> dict:
        return {"id": self.limits.model_id, "object": "model", "created": 0, "owned_by": "splitserve",
                "max_model_len": self.limits.max_model_len}

    def _servers(self) -> list:
        """This model's server, or every served model's (several models on this port)."""
        if self.served is None:
            return [self]
        return [e.http for e in self.served.entries.values()]

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [s._model_card() for s in self._servers()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        for server in self._servers():
            if request.path_params["model"] == server.limits.model_id:
                return JSONResponse(server._model_card())
        raise ApiError(404, f"The model {clip(request.path_params['model'])} does not exist", param="model",
                       code="model_not_found")

    def _target(self, body, endpoint: Endpoint):
        """The server of the model the body names, and the body (its `model` the chosen one for
        "auto"); this server when it serves one model."""
        if self.served is None or not isinstance(body, dict) or not isinstance(body.get("model", ""), str):
            return self, body
        name = body.get("model", "")
        try:
            if name == AUTO:
                entry = self.served.route(prompt_text(body, endpoint), chat=endpoint is Endpoint.CHAT)
                return entry.http, {**body, "model": entry.name}
            return self.served.find(name).http, body
        except UnknownModel as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None

    async def completions(self, request: Request) -> Response:
        tenant = self._authorize(request)
        server, body = self._target(await self._body(request, tenant), Endpoint.COMPLETIONS)
        return await server._complete(tenant, request, body)

    async def _complete(self, tenant: str, request: Request, body) -> Response:
        ticket = await self._admit(tenant, self._slots(body, Endpoint.COMPLETIONS))
        return await self._parse_and_serve(tenant, ticket, request, parse_completion, body, self.limits,
                                           self.service.tokenize, self._detokenize, tenant)

    async def chat(self, request: Request) -> Response:
        tenant = self._authorize(request)
        server, body = self._target(await self._body(request, tenant), Endpoint.CHAT)
        return await server._chat(tenant, request, body)

    async def _chat(self, tenant: str, request: Request, body) -> Response:
        ticket = await self._admit(tenant, self._slots(body, Endpoint.CHAT))
        return await self._parse_and_serve(tenant, ticket, request, parse_chat, body, self.limits,
                                           self.chat_template, self.tokenize_rendered, tenant)

    def _slots(self, body, endpoint: Endpoint) -> int:
        """The in-flight slots a body asks for: its samples (prompts x n, or test_time's)."""
        spec = parse_test_time(body, self.limits, endpoint) if isinstance(body, dict) else None
        return spec.samples if spec is not None else samples_needed(body, self.limits, endpoint)

    async def _parse_and_serve(self, tenant: str, ticket: Ticket, request: Request, parse, *args) -> Response:
        """Tokenize and render off the loop, then serve; the ticket's slots go back when the last
        sample's stream ends (or at once, if it never starts)."""
        handed_over = False
        try:
            job = await self._offload(tenant, parse, *args)
            if (spec := parse_test_time(args[0], self.limits, job.endpoint)) is not None:
                job = replace(job, test_time=spec)
            response = await self._serve(job, request, ticket)
            handed_over = isinstance(response, _StreamWithSlots)
            return response
        finally:
            if not handed_over:
                self.admission.release(ticket)

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # --- generation -----------------------------------------------------------------------------
    async def _serve(self, job: Job, request: Request, ticket: Ticket) -> Response:
        """Stream the job's events, or wait for its whole response while watching for the client
        to leave (then its requests stop everywhere)."""
        out = JobResponse(job, self.router, self.logprobs, self.service.metrics)
        if job.stream:
            return _StreamWithSlots(lambda: self.admission.release(ticket), out.events(),
                                    media_type="text/event-stream",
                                    headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        run = asyncio.ensure_future(out.collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not run.done():          # the client left (or the server stops): stop its requests everywhere
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                out.finish_trackers("abort")
        if run.cancelled():
            return Response(status_code=499)    # nobody is there to read it
        return JSONResponse(run.result())


class _StreamWithSlots(StreamingResponse):
    """A streamed response that gives its request's in-flight slots back however it ends: done,
    failed, cancelled by a client that left, or never started."""

    def __init__(self, release, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def prompt_text(body: dict, endpoint: Endpoint) -> str:
    """What skill routing reads of a body: a completion's (first) prompt, a chat's last user message."""
    if endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt", "")
        prompt = prompt[0] if isinstance(prompt, list) and prompt else prompt
        return prompt if isinstance(prompt, str) else ""
    messages = body.get("messages")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"] if isinstance(messages, list) else []
    content = users[-1].get("content", "") if users else ""
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def _parse_json(data: bytes, max_depth: int):
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, f"the body nests deeper than {max_depth} levels") from None
    check_body(body, max_depth)
    return body


_REFUSAL_CODE = {RefusedWhy.TOO_LARGE: "too_many_samples", RefusedWhy.SHUTTING_DOWN: "unavailable"}


def _refusal(exc: Refused) -> ApiError:
    return ApiError(exc.why.http_status, str(exc), param="n" if exc.why is RefusedWhy.TOO_LARGE else None,
                    code=_REFUSAL_CODE.get(exc.why, "overloaded"))


def _ssl_context(tls: tuple[bytes, bytes], client_ca: bytes | None):
    """A server TLS context from PEM bytes (written to private temporary files only for the
    moment `load_cert_chain` needs a path)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    key, chain = tls
    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, n) for n in ("key.pem", "chain.pem")]
        for path, data in zip(paths, (key, chain)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(paths[1], paths[0])
    if client_ca:
        ctx.load_verify_locations(cadata=client_ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet (byte -> printable character), reversed."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_table()


def _raw_bytes(piece: str | None) -> bytes | None:
    """A vocabulary entry's bytes: byte-level BPE ("Ġ" is a space) or SentencePiece byte tokens
    ("<0xE2>"); None when the entry is neither."""
    if not piece:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    if all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (its body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
