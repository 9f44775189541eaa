"""A small Python client for the splitserve.v1 gRPC API."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc

from proto.splitserve.v1 import inference_pb2 as pb
from proto.splitserve.v1 import inference_pb2_grpc as pb_grpc
from router.finish_reasons import from_proto



@dataclass(frozen=True)
class Completion:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str


def build_request(prompt: str | Sequence[int], request_id: str = "", **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


class _Collector:
    """Accumulates a stream's messages into one Completion."""

    def __init__(self, request_id: str):
        self.ids: list[int] = []
        self.text: list[str] = []
        self.reason = ""
        self.request_id = request_id

    def add(self, msg) -> None:
        self.ids.extend(msg.token_ids)
        self.text.append(msg.text)
        self.request_id = msg.request_id
        if msg.finish_reason:
            self.reason = from_proto(msg.finish_reason).value

    def result(self) -> Completion:
        return Completion(self.request_id, tuple(self.ids), "".join(self.text), self.reason)


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class Client:
    """Blocking client: `stream` yields responses; `generate` collects one completion."""

    def __init__(self, target: str, api_key: str | None = None, credentials: grpc.ChannelCredentials | None = None):
        self.channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.api_key = api_key

    def stream(self, prompt, request_id: str = "", timeout: float | None = None, **sampling) -> Iterator:
        return self.stub.Generate(build_request(prompt, request_id, **sampling), timeout=timeout,
                                  metadata=_metadata(self.api_key))

    def generate(self, prompt, request_id: str = "", timeout: float | None = None, **sampling) -> Completion:
        acc = _Collector(request_id)
        for msg in self.stream(prompt, request_id, timeout, **sampling):
            acc.add(msg)
        return acc.result()

    def server_info(self):
        return self.stub.ServerInfo(pb.ServerInfoRequest(), metadata=_metadata(self.api_key))

    def close(self) -> None:
        self.channel.close()


class AsyncClient:
    def __init__(self, target: str, api_key: str | None = None):
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.api_key = api_key

    async def stream(self, prompt, request_id: str = "", timeout: float | None = None,
                     **sampling) -> AsyncIterator:
        call = self.stub.Generate(build_request(prompt, request_id, **sampling), timeout=timeout,
                                  metadata=_metadata(self.api_key))
        async for msg in call:
            yield msg

    async def generate(self, prompt, request_id: str = "", timeout: float | None = None, **sampling) -> Completion:
        acc = _Collector(request_id)
        async for msg in self.stream(prompt, request_id, timeout, **sampling):
            acc.add(msg)
        return acc.result()

    async def close(self) -> None:
        await self.channel.close()
