"""Validation in one place: a proto GenerateRequest becomes a frozen GenerateRequest, or a
ValidationError naming the field and what to fix (the server answers INVALID_ARGUMENT with it)."""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from cluster.types import GenerateRequest, SamplingParams

MAX_REQUEST_ID_CHARS = 128


class ValidationError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    model_id: str
    vocab_size: int
    max_model_len: int
    max_tokens_limit: int        # the most a request may ask for
    default_max_tokens: int = 256
    spec_methods: tuple[str, ...] = ("off", "ngram")   # what the decode workers have loaded
    max_speculative_tokens: int = 8


_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                    "stop_token_ids", "stop", "prompt_logprobs", "logprobs", "speculative", "num_speculative_tokens")


def _sampling(msg, limits: Limits, tenant: str) -> SamplingParams:
    has = msg.HasField
    max_tokens = msg.max_tokens if has("max_tokens") else limits.default_max_tokens
    if max_tokens > limits.max_tokens_limit:
        raise ValidationError("sampling.max_tokens",
                              f"{max_tokens} exceeds the server's limit of {limits.max_tokens_limit}")
    speculative = msg.speculative or None
    if speculative is not None and speculative not in limits.spec_methods:
        raise ValidationError("sampling.speculative", f"{speculative!r} is not available on this server; choose "
                                                      f"one of {', '.join(limits.spec_methods)} or leave it unset")
    lookahead = msg.WhichOneof("lookahead")
    k = None if lookahead is None else ("auto" if lookahead == "auto_lookahead" else msg.num_speculative_tokens)
    if isinstance(k, int) and not 1 <= k <= limits.max_speculative_tokens:
        raise ValidationError("sampling.num_speculative_tokens",
                              f"must be in [1, {limits.max_speculative_tokens}] (or auto_lookahead), got {k}")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=msg.temperature, top_p=msg.top_p if has("top_p") else 1.0,
            top_k=msg.top_k, min_p=msg.min_p,
            repetition_penalty=msg.repetition_penalty if has("repetition_penalty") else 1.0,
            seed=msg.seed if has("seed") else None, stop_token_ids=tuple(msg.stop_token_ids),
            stop=tuple(msg.stop), ignore_eos=msg.ignore_eos,
            logprobs=msg.logprobs if has("logprobs") else None,
            prompt_logprobs=msg.prompt_logprobs if has("prompt_logprobs") else None,
            cache_salt=tenant_salt(tenant, msg.cache_salt),
            speculative=speculative, num_speculative_tokens=k)
    except ValueError as exc:
        text = str(exc)
        field = next((f for f in _SAMPLING_FIELDS if text.startswith(f) or f" {f}" in text[:30]), "sampling")
        raise ValidationError(f"sampling.{field}" if field != "sampling" else field, text) from exc


def tenant_salt(tenant: str, salt: str) -> str | None:
    """The prefix cache is partitioned per tenant: its name salts every block hash (with the
    client's own `cache_salt` inside it), so no tenant can hit, or time, another's cached prefix."""
    if not tenant:
        return salt or None
    return f"tenant:{tenant}/{salt}"


def validate(req, limits: Limits, tokenize: Callable[[str], list[int]], tenant: str = "") -> GenerateRequest:
    """`req` is a splitserve.v1.GenerateRequest; `tenant`: the caller's (see cluster/secrets.py)."""
    rid = req.request_id or uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise ValidationError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} printable characters")
    if req.model and req.model != limits.model_id:
        raise ValidationError("model", f"{req.model!r} is not served here; this server serves {limits.model_id!r}")
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt", "set either text or token_ids")
    if kind == "text":
        if not req.text:
            raise ValidationError("prompt.text", "is empty")
        ids = tokenize(req.text)
    else:
        ids = list(req.token_ids.ids)
        if not ids:
            raise ValidationError("prompt.token_ids", "is empty")
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise ValidationError("prompt.token_ids", f"ids must be in [0, {limits.vocab_size}); got {bad[:5]}")
    if len(ids) >= limits.max_model_len:
        raise ValidationError("prompt", f"has {len(ids)} tokens but the model's context is {limits.max_model_len} "
                                        "tokens (at least one must be left to generate)")
    sampling = _sampling(req.sampling, limits, tenant)
    return GenerateRequest(request_id=rid, prompt_token_ids=tuple(ids), sampling=sampling, model=limits.model_id,
                           tenant=tenant)
