"""A small Python client for the splitserve.v1 gRPC API: generate (streamed or collected), the
server's info, and its tokenizer (tokenize, detokenize)."""
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


@dataclass(frozen=True)
class Tokens:
    """What Tokenize answers: the ids Generate would run for the text."""
    token_ids: tuple[int, ...]
    max_model_len: int
    token_strs: tuple[str, ...] | None = None    # with return_token_strs: each id's vocabulary entry

    @classmethod
    def from_proto(cls, msg: pb.TokenizeResponse, with_strs: bool) -> Tokens:
        return cls(tuple(msg.token_ids), msg.max_model_len, tuple(msg.token_strs) if with_strs else None)


def tokenize_request(text: str, add_special_tokens: bool = True, return_token_strs: bool = False) -> pb.TokenizeRequest:
    return pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens, return_token_strs=return_token_strs)


def build_request(prompt: str | Sequence[int], request_id: str = "", model: str = "", **sampling) -> pb.GenerateRequest:
    """`model`: a served model's name ("": the server's default; "auto": skill routing)."""
    req = pb.GenerateRequest(request_id=request_id, model=model, sampling=pb.SamplingParams(**sampling))
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

    def list_models(self):
        """The served models' `ModelInfo`s."""
        return list(self.stub.ListModels(pb.ListModelsRequest(), metadata=_metadata(self.api_key)).models)

    def tokenize(self, text: str, add_special_tokens: bool = True, return_token_strs: bool = False,
                 timeout: float | None = None) -> Tokens:
        msg = self.stub.Tokenize(tokenize_request(text, add_special_tokens, return_token_strs), timeout=timeout,
                                 metadata=_metadata(self.api_key))
        return Tokens.from_proto(msg, return_token_strs)

    def detokenize(self, token_ids: Sequence[int], timeout: float | None = None) -> str:
        return self.stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids), timeout=timeout,
                                    metadata=_metadata(self.api_key)).text

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

    async def tokenize(self, text: str, add_special_tokens: bool = True, return_token_strs: bool = False,
                       timeout: float | None = None) -> Tokens:
        msg = await self.stub.Tokenize(tokenize_request(text, add_special_tokens, return_token_strs),
                                       timeout=timeout, metadata=_metadata(self.api_key))
        return Tokens.from_proto(msg, return_token_strs)

    async def detokenize(self, token_ids: Sequence[int], timeout: float | None = None) -> str:
        msg = await self.stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids), timeout=timeout,
                                         metadata=_metadata(self.api_key))
        return msg.text

    async def close(self) -> None:
        await self.channel.close()
