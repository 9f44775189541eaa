"""The gRPC front door: splitserve.v1.Inference, grpc.health.v1 and server reflection.

Each RPC decodes its message itself (a malformed one is INVALID_ARGUMENT, not a traceback), takes
an in-flight slot (router/admission.py: a fair, bounded wait, then RESOURCE_EXHAUSTED), validates
off the event loop (INVALID_ARGUMENT naming the field; router/offload.py), honours the client's deadline (DEADLINE_EXCEEDED, and the request stops on
every worker) and aborts everywhere when the client cancels. A worker's refusal of the request
itself (`RequestError`) keeps its own code; a server that cannot serve it (no worker, shutting
down) answers UNAVAILABLE. Request ids are scoped per tenant: two tenants may use the same one.
Error messages are cut to `MAX_MESSAGE_CHARS` characters (router/validation.py). gRPC health says NOT_SERVING until every worker has loaded and been
handshaken (`set_serving`); requests that arrive before then wait for it, within their deadline.
Tokenize and Detokenize (router/tokenization.py) take no slot: they run on no worker, only in the
validation pool, whose own bounds (pending jobs, one job per tenant at a time) hold them.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, fields, replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.errors import RequestError, error_message
from cluster.secrets import as_api_keys, authenticate
from cluster.types import TokenDelta
from proto.splitserve.v1 import inference_pb2 as pb
from router.admin_service import ADMIN_METHODS, ADMIN_SERVICE_NAME, AdminService, WorkerEntry, pool_workers
from router.admission import Admission, AdmissionConfig, Refused
from router.connections import ConnectionLimits, grpc_options
from router.finish_reasons import to_proto as reason_to_proto
from router.offload import Offload
from router.router import Router
from router.served_models import ServedModels, UnknownModel
from router.skills import AUTO
from router.test_time import TestTimeOutcome, run_test_time, sample_requests
from router.test_time_policy import TestTimeSpec, spec_from_proto
from router.tokenization import TokenCodec, detokenize_message, tokenize_message
from router.validation import Limits, ValidationError, client_id, cut_message, scoped_id, validate

log = logging.getLogger(__name__)

SERVICE_NAME = "splitserve.v1.Inference"


@dataclass(frozen=True)
class ServerInfo:
    """What the ServerInfo RPC answers (its fields are the proto's, one for one)."""
    version: str
    mode: str                       # "disaggregated" or "colocated"
    prefill_workers: int
    decode_workers: int
    kv_transport: str
    max_tokens_limit: int
    speculative: str                # the default proposer
    num_speculative_tokens: str     # the default lookahead: k, or "auto"
    deterministic: bool
    workers: tuple[WorkerEntry, ...] = ()   # as they are when asked (the admin operations change them)

    def to_proto(self) -> pb.ServerInfoResponse:
        scalars = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "workers"}
        return pb.ServerInfoResponse(**scalars, workers=[w.to_proto() for w in self.workers])


async def _abort(context, code: grpc.StatusCode, message: str):
    await context.abort(code, cut_message(message))


def to_proto(delta: TokenDelta, usage_tokens: int) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=delta.request_id, token_ids=list(delta.token_ids), text=delta.text)
    for lp in delta.logprobs:
        msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                         top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    for lp in delta.prompt_logprobs:
        msg.prompt_logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                                top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    if delta.finish_reason is not None:
        msg.finish_reason = reason_to_proto(delta.finish_reason)
        msg.usage.prompt_tokens = delta.num_prompt_tokens
        msg.usage.completion_tokens = usage_tokens
        msg.usage.cached_prompt_tokens = delta.num_cached_tokens
    return msg


def test_time_message(outcome: TestTimeOutcome, request_id: str, with_logprobs: bool) -> pb.GenerateResponse:
    """A test-time request's one message: the chosen sample as a whole response, usage counting
    every sample's tokens, the candidates under `test_time`."""
    best = outcome.best
    delta = TokenDelta(request_id, best.token_ids, best.text, best.finish_reason,
                       best.logprobs if with_logprobs else (), outcome.prompt_tokens, len(best.token_ids),
                       outcome.cached_tokens)
    msg = to_proto(delta, outcome.completion_tokens)
    for c in outcome.candidates:
        msg.test_time.candidates.add(text=c.text, answer=c.answer, tokens=len(c.token_ids), score=c.score,
                                     finish_reason=reason_to_proto(c.finish_reason))
    msg.test_time.chosen = outcome.chosen
    msg.test_time.stopped_early = outcome.stopped_early
    msg.test_time.samples_run = outcome.samples_run
    return msg


class InferenceService:
    def __init__(self, router: Router, limits: Limits, codec: TokenCodec, info: ServerInfo, api_keys: tuple = (),
                 metrics=None, siblings=None, admission: AdmissionConfig = AdmissionConfig(),
                 offload: Offload | None = None):
        """`siblings`: the frontend (router/frontend.py) that passes an `Abort` for a request this
        process does not own to the other frontends. `codec` (the tokenizer) runs in the `offload` pool."""
        self.router = router
        self.api_keys = as_api_keys(api_keys)
        # Tenants known in advance: the keys' ("" without keys: every request is anonymous).
        tenants = tuple(dict.fromkeys(k.tenant for k in self.api_keys)) or ("",)
        self.admission = Admission(admission, metrics, tenants)
        self.offload = offload or Offload()
        self.limits = limits
        self.codec = codec
        self.tokenize = codec.prompt        # a text prompt's ids, for both APIs
        self.info = info
        self.metrics = metrics
        self.siblings = siblings
        self.health = None          # the grpc.health.v1 servicer (start_grpc_server)
        self.served: ServedModels | None = None     # set when this port serves several models
        self.admin = AdminService(self._authorize)    # its actions are the driver's, given once it is up

    async def set_serving(self, serving: bool, alive: bool | None = None) -> None:
        """The Inference service's health (readiness: SERVING once it can take requests) and the
        server's own ("", liveness): `alive` as `serving` unless given (a drain is alive, not
        serving)."""
        if self.health is None:       # no gRPC server (only the HTTP API, whose /health reads the router)
            return
        alive = serving if alive is None else alive
        for name, up in ((SERVICE_NAME, serving), ("", alive)):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING if up
                                  else health_pb2.HealthCheckResponse.NOT_SERVING)

    def tenant_of(self, authorization: str) -> str | None:
        """The tenant of an `authorization: Bearer <key>` value ("" when no keys are set), or None."""
        if not self.api_keys:
            return ""
        token = authorization[len("Bearer "):].encode() if authorization.startswith("Bearer ") else b""
        return authenticate(self.api_keys, token)

    async def _authorize(self, context) -> str:
        tenant = self.tenant_of(dict(context.invocation_metadata()).get("authorization", ""))
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid 'authorization: Bearer <key>'")
        return tenant

    async def Generate(self, request, context):
        tenant = await self._authorize(context)
        service, request = await self._target(request, context)
        async for msg in service._admitted(request, context, tenant):
            yield msg

    async def _target(self, request, context):
        """The service of the model the request names, and the request (its `model` the chosen
        one for "auto"); this service when it serves one model."""
        if self.served is None:
            return self, request
        try:
            if request.model == AUTO:
                entry = self.served.route(request.text, chat=False)
                chosen = pb.GenerateRequest()
                chosen.CopyFrom(request)
                chosen.model = entry.name
                return entry.service, chosen
            return self.served.find(request.model).service, request
        except UnknownModel as exc:
            await _abort(context, grpc.StatusCode.NOT_FOUND, str(exc))

    async def _admitted(self, request, context, tenant: str):
        spec = None
        if request.HasField("test_time"):       # checked before admission: its samples are its slots
            try:
                spec = spec_from_proto(request.test_time, self.limits.bounds, (self.limits.model_id,))
            except ValidationError as exc:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            ticket = await self.admission.admit(tenant, spec.samples if spec else 1, self.router.closing)
        except Refused as exc:
            await _abort(context, grpc.StatusCode[exc.why.grpc_code], str(exc))
        try:
            first = self.served is not None or request.model == self.limits.model_id
            run = self._generate(request, context, tenant) if spec is None else \
                self._test_time(request, context, tenant, spec)
            async for msg in run:
                if first:           # the first message names the model that answers
                    msg.model, first = self.limits.model_id, False
                yield msg
        finally:
            self.admission.release(ticket)

    async def _validated(self, context, tenant: str, fn, *args):
        """`fn(*args)` in the validation pool; its ValidationError is INVALID_ARGUMENT, a full pool
        its refusal's code."""
        try:
            return await self.offload.run(tenant, fn, *args)
        except ValidationError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Refused as exc:
            await _abort(context, grpc.StatusCode[exc.why.grpc_code], str(exc))

    async def _generate(self, request, context, tenant: str):
        req = await self._validated(context, tenant, validate, request, self.limits, self.tokenize, tenant)
        if req.request_id in self.router.active:     # the same tenant's own id: ids are scoped per tenant
            await _abort(context, grpc.StatusCode.ALREADY_EXISTS, "request_id is already running")
        their_id = client_id(tenant, req.request_id)
        remaining = context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        stream = self.router.generate(req)
        produced = 0
        tracker = self.metrics.track(req) if self.metrics else None
        timed_out = False
        try:
            while True:
                # A timeout scope, not wait_for (which makes a task per message: this loop runs per
                # token); it covers only the wait for the next delta, never the yield.
                async with asyncio.timeout_at(deadline):
                    try:
                        delta = await anext(stream)
                    except StopAsyncIteration:
                        break
                produced += len(delta.token_ids)
                if tracker:
                    tracker.tokens(len(delta.token_ids), delta)
                msg = to_proto(delta, produced)
                msg.request_id = their_id
                yield msg
        except TimeoutError:
            timed_out = True
        except RequestError as exc:      # the request's fault, found by a worker
            if tracker:
                tracker.finish("error")
            await _abort(context, grpc.StatusCode[getattr(exc, "code", "INVALID_ARGUMENT")], error_message(exc))
        except Exception as exc:  # noqa: BLE001 - no worker could serve it, or the server is stopping
            if tracker:
                tracker.finish("error")
            await _abort(context, grpc.StatusCode.UNAVAILABLE, error_message(exc))
        finally:
            await stream.aclose()               # stops the request on every worker
            if tracker and not tracker.done:
                tracker.finish("deadline" if timed_out else "abort")
        if timed_out:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")

    async def _test_time(self, request, context, tenant: str, spec: TestTimeSpec):
        """Test-time compute (router/test_time.py): the samples run, then one message, the chosen
        sample's, with the candidates under `test_time` and every sample's tokens in its usage."""
        req = await self._validated(context, tenant, validate, request, self.limits, self.tokenize, tenant)
        samples = sample_requests(req, spec)
        if any(s.request_id in self.router.active for s in samples):
            await _abort(context, grpc.StatusCode.ALREADY_EXISTS, "request_id is already running")
        trackers = {s.request_id: self.metrics.track(s) for s in samples} if self.metrics else {}

        def observe(d: TokenDelta) -> None:
            if d.request_id in trackers:
                trackers[d.request_id].tokens(len(d.token_ids), d)
        ended = "abort"          # the client left (the task was cancelled)
        try:
            async with asyncio.timeout(context.time_remaining()):
                outcome = await run_test_time(self.router, samples, spec, observe)
        except TimeoutError:
            ended = "deadline"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        except RequestError as exc:
            ended = "error"
            await _abort(context, grpc.StatusCode[getattr(exc, "code", "INVALID_ARGUMENT")], error_message(exc))
        except Exception as exc:  # noqa: BLE001 - no worker could serve it, or the server is stopping
            ended = "error"
            await _abort(context, grpc.StatusCode.UNAVAILABLE, error_message(exc))
        finally:
            for t in trackers.values():      # cut short, or never started (no series: nothing streamed)
                if t.last is not None and not t.done:
                    t.finish(ended)
        yield test_time_message(outcome, client_id(tenant, req.request_id), req.sampling.logprobs is not None)

    async def Abort(self, request, context):
        """Only the owner's tenant may abort a request; another's is answered as an unknown id."""
        tenant = await self._authorize(context)
        rid = scoped_id(tenant, request.request_id)
        if self.served is not None:     # several models (one frontend): the request is on one model's router
            for entry in self.served.entries.values():
                if await entry.service.router.abort(rid, tenant):
                    return pb.AbortResponse(found=True)
            return pb.AbortResponse(found=False)
        if self.siblings is not None:
            return pb.AbortResponse(found=await self.siblings.abort_anywhere(rid, tenant))
        return pb.AbortResponse(found=await self.router.abort(rid, tenant))

    async def ListModels(self, request, context):
        await self._authorize(context)
        services = [e.service for e in self.served.entries.values()] if self.served is not None else [self]
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=s.limits.model_id, max_model_len=s.limits.max_model_len,
                                                          vocab_size=s.limits.vocab_size) for s in services])

    async def ServerInfo(self, request, context):
        await self._authorize(context)
        workers = pool_workers(self.router.workers)
        return replace(self.info, prefill_workers=sum(w.role == "prefill" for w in workers),
                       decode_workers=sum(w.role == "decode" for w in workers), workers=tuple(workers)).to_proto()

    async def Tokenize(self, request, context):
        tenant = await self._authorize(context)
        service = await self._named(request.model, context)
        return await service._validated(context, tenant, tokenize_message, request, service.limits, service.codec)

    async def Detokenize(self, request, context):
        tenant = await self._authorize(context)
        service = await self._named(request.model, context)
        return await service._validated(context, tenant, detokenize_message, request, service.limits, service.codec)

    async def _named(self, name: str, context):
        """The service of the model `name` names (several models; NOT_FOUND naming them otherwise)."""
        if self.served is None:
            return self
        try:
            return self.served.find(name).service
        except UnknownModel as exc:
            await _abort(context, grpc.StatusCode.NOT_FOUND, str(exc))


_METHODS = {"Generate": (pb.GenerateRequest, True), "Abort": (pb.AbortRequest, False),
            "ListModels": (pb.ListModelsRequest, False), "ServerInfo": (pb.ServerInfoRequest, False),
            "Tokenize": (pb.TokenizeRequest, False), "Detokenize": (pb.DetokenizeRequest, False)}


async def _decode(cls, raw: bytes, context):
    try:
        return cls.FromString(raw)
    except Exception:  # noqa: BLE001 - DecodeError, or invalid UTF-8 in a string field
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {cls.DESCRIPTOR.full_name}")


def _handler(method, cls, streaming: bool):
    """A method handler that takes the raw bytes, so that a malformed message is the client's
    INVALID_ARGUMENT (grpc's own deserializer turns it into UNKNOWN with a traceback)."""
    response = getattr(pb, cls.__name__.replace("Request", "Response")).SerializeToString
    if streaming:
        async def unary_stream(raw, context):
            async for msg in method(await _decode(cls, raw, context), context):
                yield msg
        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=response)

    async def unary_unary(raw, context):
        return await method(await _decode(cls, raw, context), context)
    return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=response)


async def start_grpc_server(service: InferenceService, host: str, port: int,
                            tls: tuple[bytes, bytes] | None = None, client_ca: bytes | None = None,
                            connections: ConnectionLimits = ConnectionLimits()) -> tuple[grpc.aio.Server, int]:
    """`tls`: (private key, certificate chain), PEM; `client_ca`: with it, mutual TLS (a client
    without a certificate signed by that CA fails the handshake)."""
    server = grpc.aio.server(options=grpc_options(connections, service.limits.bounds.max_message_bytes))
    handlers = {name: _handler(getattr(service, name), cls, streaming) for name, (cls, streaming) in _METHODS.items()}
    admin = {name: _handler(getattr(service.admin, name), cls, False) for name, cls in ADMIN_METHODS.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),
                                     grpc.method_handlers_generic_handler(ADMIN_SERVICE_NAME, admin)))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, ADMIN_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    if client_ca and not tls:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    if tls:
        creds = grpc.ssl_server_credentials([tls], root_certificates=client_ca, require_client_auth=bool(client_ca))
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    await server.start()
    service.health = health_servicer
    await service.set_serving(False)
    return server, bound
