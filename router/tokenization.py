"""The served model's tokenizer, as both servers use it, and the gRPC Tokenize and Detokenize RPCs.

One `TokenCodec` per frontend makes every id the servers see: a text prompt's (Generate,
/v1/completions: special tokens added), a rendered chat's (/v1/chat/completions: none added, the
template writes them), and /tokenize's and Tokenize's, which go through the very same calls, so
that the ids they answer are the prompt the server would run. Every method is CPU work for the
validation pool (router/offload.py), never for the event loop; the batch calls release the GIL.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proto.splitserve.v1 import inference_pb2 as pb
from router.offload import batch_tokenize
from router.validation import Limits, ValidationError, check_model

MAX_IDS_QUOTED = 5       # out-of-vocabulary ids an error names


@dataclass(frozen=True)
class Tokenized:
    token_ids: tuple[int, ...]
    token_strs: tuple[str, ...] | None = None    # each id's vocabulary entry, when asked for


class TokenCodec:
    def __init__(self, tokenizer, vocab_size: int):
        """`vocab_size`: the model's (a prompt's ids are checked against it; it may exceed the
        tokenizer's, whose missing ids decode to nothing)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.prompt = batch_tokenize(tokenizer, add_special_tokens=True)      # a text prompt
        self.rendered = batch_tokenize(tokenizer, add_special_tokens=False)   # a rendered chat

    def tokenize(self, text: str, add_special_tokens: bool, with_strs: bool = False) -> Tokenized:
        ids = (self.prompt if add_special_tokens else self.rendered)(text)
        return Tokenized(tuple(ids), self.token_strs(ids) if with_strs else None)

    def token_strs(self, ids: Sequence[int]) -> tuple[str, ...]:
        """Each id's vocabulary entry as the tokenizer stores it (byte-level "Ġ" for a space), as
        vLLM's `return_token_strs` answers."""
        return tuple(self.tokenizer.id_to_token(i) or "" for i in ids)

    def check_ids(self, ids: Sequence[int], field: str) -> None:
        """ValidationError naming `field` and the first ids outside [0, vocab_size)."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size][:MAX_IDS_QUOTED]
        if bad:
            raise ValidationError(field, f"ids must be in [0, {self.vocab_size}); got {bad}")

    def detokenize(self, ids: Sequence[int]) -> str:
        """Special tokens kept, as a completion's echo and vLLM's /detokenize keep them."""
        return self.tokenizer.decode_batch([list(ids)], skip_special_tokens=False)[0]


def tokenize_message(msg: pb.TokenizeRequest, limits: Limits, codec: TokenCodec) -> pb.TokenizeResponse:
    """The Tokenize RPC's answer; `add_special_tokens` unset is true, as Generate tokenizes a text."""
    check_model(msg.model, limits)
    add = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
    out = codec.tokenize(msg.text, add, with_strs=msg.return_token_strs)
    return pb.TokenizeResponse(token_ids=out.token_ids, count=len(out.token_ids), max_model_len=limits.max_model_len,
                               token_strs=out.token_strs or ())


def detokenize_message(msg: pb.DetokenizeRequest, limits: Limits, codec: TokenCodec) -> pb.DetokenizeResponse:
    check_model(msg.model, limits)
    codec.check_ids(msg.token_ids, "token_ids")
    return pb.DetokenizeResponse(text=codec.detokenize(msg.token_ids))
