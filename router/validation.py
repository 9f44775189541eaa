"""Validation in one place: a proto GenerateRequest becomes a frozen GenerateRequest, or a
ValidationError naming the field and what to fix (the server answers INVALID_ARGUMENT with it)."""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from cluster.config import require, setting
from cluster.types import GenerateRequest, KVCompaction, SamplingParams
from router.errors import ValidationError
from router.structured import from_proto as structured_from_proto

MAX_REQUEST_ID_CHARS = 128
MAX_ECHO_CHARS = 64      # a client's value quoted in an error message is cut to this
MAX_MESSAGE_CHARS = 1024  # and the whole message to this (gRPC sends it in the trailers)


def cut_message(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."


def clip(value, limit: int = MAX_ECHO_CHARS) -> str:
    """`repr(value)`, cut: an error message never echoes a client's value at any length."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class RequestBounds:
    """What one request may cost: every bound is a setting (`splitserve serve --help`), and a
    request past one gets 400 / INVALID_ARGUMENT naming it."""
    max_stop_strings: int = setting(32, "stop strings per request (OpenAI allows 4)")
    max_stop_string_chars: int = setting(256, "characters of one stop string")
    max_stop_token_ids: int = setting(64, "stop token ids per request")
    max_n: int = setting(64, "samples per prompt (n)")
    max_samples_per_request: int = setting(64, "prompts x n: the in-flight slots one request takes")
    max_test_time_samples: int = setting(16, "samples of one test_time request (majority or best_of)")
    max_logprobs: int = setting(20, "top logprobs per token (OpenAI's limit, and the engine's)")
    max_body_bytes: int = setting(4 << 20, "bytes of an HTTP body")
    max_message_bytes: int = setting(4 << 20, "bytes of a gRPC message")
    max_json_depth: int = setting(32, "nesting of a JSON body (chat content parts, tool schemas)")

    def __post_init__(self) -> None:
        for f in fields(self):
            require(getattr(self, f.name) >= 1, f.name, f"must be >= 1, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class Limits:
    model_id: str
    vocab_size: int
    max_model_len: int
    max_tokens_limit: int        # the most a request may ask for
    default_max_tokens: int = 256
    spec_methods: tuple[str, ...] = ("off", "ngram", "jacobi")   # what the decode workers have loaded
    max_speculative_tokens: int = 8
    bounds: RequestBounds = field(default_factory=RequestBounds)
    max_token_bytes: int = 0     # the vocabulary's longest token in UTF-8 bytes (0: unknown)

    def surely_too_long(self, text: str) -> bool:
        """A text that must tokenize past the context, known without tokenizing it (each token
        covers at most `max_token_bytes` bytes): refused before it costs a tokenizer pass."""
        return self.max_token_bytes > 0 and len(text) > self.max_token_bytes * self.max_model_len


_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                    "stop_token_ids", "stop", "prompt_logprobs", "logprobs", "speculative", "num_speculative_tokens", "ignore_eos",
                    "kv_window", "kv_sink_tokens", "kv_compaction")


def _sampling(msg, limits: Limits, tenant: str) -> SamplingParams:
    has = msg.HasField
    _check_bounds(msg, limits)
    max_tokens = msg.max_tokens if has("max_tokens") else limits.default_max_tokens
    if max_tokens > limits.max_tokens_limit:
        raise ValidationError("sampling.max_tokens",
                              f"{max_tokens} exceeds the server's limit of {limits.max_tokens_limit}")
    speculative = msg.speculative or None
    if speculative is not None and speculative not in limits.spec_methods:
        raise ValidationError("sampling.speculative", f"{clip(speculative)} is not available on this server; choose "
                                                      f"one of {', '.join(limits.spec_methods)} or leave it unset")
    lookahead = msg.WhichOneof("lookahead")
    k = None if lookahead is None else ("auto" if lookahead == "auto_lookahead" else msg.num_speculative_tokens)
    if isinstance(k, int) and not 1 <= k <= limits.max_speculative_tokens:
        raise ValidationError("sampling.num_speculative_tokens",
                              f"must be in [1, {limits.max_speculative_tokens}] (or auto_lookahead), got {k}")
    structured = None
    if has("structured"):
        structured = structured_from_proto(msg.structured)
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=msg.temperature, top_p=msg.top_p if has("top_p") else 1.0,
            top_k=msg.top_k, min_p=msg.min_p,
            repetition_penalty=msg.repetition_penalty if has("repetition_penalty") else 1.0,
            penalize_prompt=msg.penalize_prompt if has("penalize_prompt") else True,
            seed=msg.seed if has("seed") else None, stop_token_ids=tuple(msg.stop_token_ids),
            stop=tuple(msg.stop), ignore_eos=msg.ignore_eos,
            logprobs=msg.logprobs if has("logprobs") else None,
            prompt_logprobs=msg.prompt_logprobs if has("prompt_logprobs") else None,
            cache_salt=tenant_salt(tenant, msg.cache_salt),
            speculative=speculative, num_speculative_tokens=k, structured=structured,
            kv_window=msg.kv_window if has("kv_window") else None,
            kv_sink_tokens=msg.kv_sink_tokens if has("kv_sink_tokens") else None,
            kv_compaction=_kv_compaction(msg.kv_compaction) if has("kv_compaction") else None)
    except ValueError as exc:
        text = str(exc)
        field = next((f for f in _SAMPLING_FIELDS if text.startswith(f) or f" {f}" in text[:30]), "sampling")
        raise ValidationError(f"sampling.{field}" if field != "sampling" else field, text) from exc


def _kv_compaction(msg) -> KVCompaction:
    """The proto's KVCompaction (docs/kv_compress.md): unset numbers take the defaults; "off" needs no ratio."""
    method = msg.method or "select"
    ratio = msg.ratio if msg.ratio or method != "off" else 1.0
    return KVCompaction(ratio=ratio, method=method,
                        **{n: getattr(msg, n) for n in ("recent", "observe", "sinks") if msg.HasField(n)})


def _check_bounds(msg, limits: Limits) -> None:
    b = limits.bounds
    for name in ("logprobs", "prompt_logprobs"):
        if msg.HasField(name) and not 0 <= getattr(msg, name) <= b.max_logprobs:
            raise ValidationError(f"sampling.{name}", f"must be in [0, {b.max_logprobs}] (--max-logprobs), "
                                                      f"got {getattr(msg, name)}")
    if len(msg.stop) > b.max_stop_strings:
        raise ValidationError("sampling.stop", f"at most {b.max_stop_strings} stop strings (--max-stop-strings), "
                                               f"got {len(msg.stop)}")
    long = next((s for s in msg.stop if len(s) > b.max_stop_string_chars), None)
    if long is not None:
        raise ValidationError("sampling.stop", f"a stop string may have at most {b.max_stop_string_chars} characters "
                                               f"(--max-stop-string-chars), got one of {len(long)}")
    if len(msg.stop_token_ids) > b.max_stop_token_ids:
        raise ValidationError("sampling.stop_token_ids", f"at most {b.max_stop_token_ids} ids, "
                                                         f"got {len(msg.stop_token_ids)}")
    bad = [t for t in msg.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValidationError("sampling.stop_token_ids", f"ids must be in [0, {limits.vocab_size}); got {bad[:5]}")


def scoped_id(tenant: str, request_id: str) -> str:
    """The id a request runs under: the client's, within its tenant's own namespace, so that
    two tenants may use one id and neither learns of, or blocks, the other's."""
    return f"{len(tenant)}:{tenant}/{request_id}" if tenant else request_id


def client_id(tenant: str, scoped: str) -> str:
    """The id the client knows a request by (`scoped_id` undone)."""
    return scoped[len(scoped_id(tenant, "")):]


def tenant_salt(tenant: str, salt: str) -> str | None:
    """The prefix cache is partitioned per tenant: its name salts every block hash (with the
    client's own `cache_salt` inside it), so no tenant can hit, or time, another's cached prefix."""
    if not tenant:
        return salt or None
    return f"tenant:{tenant}/{salt}"


def check_model(model: str, limits: Limits) -> None:
    """A message's `model`: empty (the served one) or the served one's name."""
    if model and model != limits.model_id:
        raise ValidationError("model", f"{clip(model)} is not served here; this server serves {limits.model_id!r}")


def validate(req, limits: Limits, tokenize: Callable[[str], list[int]], tenant: str = "") -> GenerateRequest:
    """`req` is a splitserve.v1.GenerateRequest; `tenant`: the caller's (see cluster/secrets.py)."""
    rid = req.request_id or uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise ValidationError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} printable characters")
    check_model(req.model, limits)
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt", "set either text or token_ids")
    if kind == "text":
        if not req.text:
            raise ValidationError("prompt.text", "is empty")
        if limits.surely_too_long(req.text):
            raise ValidationError("prompt", f"has {len(req.text)} characters, more than the model's context of "
                                            f"{limits.max_model_len} tokens can hold")
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
    return GenerateRequest(request_id=scoped_id(tenant, rid), prompt_token_ids=tuple(ids), sampling=sampling, model=limits.model_id,
                           tenant=tenant)
