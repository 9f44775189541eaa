"""A finish reason in every form it leaves the cluster in, in one place: the engine's
`FinishReason`, the v1 proto's enum (gRPC responses, and the clients that read them) and the
OpenAI API's `finish_reason` string (which has no "abort": an aborted sample reads "length")."""
from __future__ import annotations

from cluster.types import FinishReason
from proto.splitserve.v1 import inference_pb2 as pb

_TO_PROTO = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
             FinishReason.ABORT: pb.FINISH_REASON_ABORT}
_FROM_PROTO = {number: reason for reason, number in _TO_PROTO.items()}
_TO_OPENAI = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "length"}


def to_proto(reason: FinishReason) -> int:
    return _TO_PROTO[reason]


def from_proto(number: int) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED (not finished) or a number this release does not know."""
    return _FROM_PROTO.get(number)


def to_openai(reason: FinishReason) -> str:
    return _TO_OPENAI[reason]
