"""Types that cross component boundaries: sampling parameters, finish reasons, token deltas.

All are frozen dataclasses; each validates itself on construction so that a bad field is
reported (as a ValueError naming the field) before anything is scheduled.
"""
from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass, field, replace

import msgpack

from cluster.spec_config import MAX_SPECULATIVE_TOKENS, SPEC_METHODS


class FinishReason(str, enum.Enum):
    STOP = "stop"        # an eos id, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the model's context reached
    ABORT = "abort"      # aborted by the caller


class StructuredKind(str, enum.Enum):
    """What a structured-output constraint is written in (cluster/engine/grammar.py compiles it)."""
    JSON_SCHEMA = "json_schema"    # spec: a JSON schema (JSON text)
    JSON_OBJECT = "json_object"    # any JSON object; spec empty
    REGEX = "regex"
    CHOICE = "choice"              # spec: a JSON array of the allowed strings
    GRAMMAR = "grammar"            # an EBNF grammar (GBNF, a `root` rule)
    LARK = "lark"                  # a Lark grammar
    TOOL_CALL = "tool_call"        # spec: a JSON array of {"name", "parameters"}: one Hermes-format call


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output: every sampled token keeps the output a prefix of a
    string the constraint accepts, and the output ends only where it is complete."""
    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        _check(isinstance(self.kind, StructuredKind), f"structured kind must be a StructuredKind, got {self.kind!r}")
        _check(isinstance(self.spec, str), "a structured constraint's spec must be a string")
        _check(bool(self.spec) or self.kind is StructuredKind.JSON_OBJECT,
               f"a {self.kind.value} constraint needs its spec")


COMPACTION_METHODS = ("select", "fit", "off")   # KV compaction of long prompts ("off": not this request)


@dataclass(frozen=True)
class KVCompaction:
    """KV compaction of a long prompt (docs/kv_compress.md): after its prefill, each layer and KV
    head keeps `prompt / ratio` entries, the last `recent` prompt tokens exact, the rest chosen by
    `method` ("select": SnapKV, the attention of the prompt's last `observe` queries, pooled over
    `pool` keys; the first `sinks` tokens always kept; "fit": select's keys with values fitted by
    ridge least squares so that the prompt's last `recent` queries' attention outputs over them
    match the older part's; "off" turns a server's default off). Ratio 1 keeps every entry."""
    ratio: float = 4.0
    method: str = "select"
    recent: int = 128
    observe: int = 32
    sinks: int = 4
    pool: int = 7

    def __post_init__(self) -> None:
        _check(_finite(self.ratio) and self.ratio >= 1, f"kv_compaction.ratio must be >= 1, got {self.ratio!r}")
        _check(self.method in COMPACTION_METHODS,
               f"kv_compaction.method must be one of {', '.join(COMPACTION_METHODS)}, got {self.method!r}")
        for name in ("recent", "observe", "sinks", "pool"):
            value = getattr(self, name)
            low = 0 if name == "sinks" else 1
            _check(isinstance(value, int) and not isinstance(value, bool) and low <= value <= 1 << 20,
                   f"kv_compaction.{name} must be an integer >= {low}, got {value!r}")
        _check(self.pool % 2 == 1, f"kv_compaction.pool must be odd (a centred window), got {self.pool!r}")

    @property
    def observed(self) -> int:
        """The prompt's last queries the method reads (selection's, and fitting's samples)."""
        return max(self.observe, self.recent) if self.method == "fit" else self.observe

    def kept(self, num_prompt: int) -> int:
        """Entries kept per layer and KV head of a prompt of `num_prompt` tokens."""
        return max(1, min(num_prompt, int(num_prompt // self.ratio)))


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. Defaults are greedy decoding of 16 tokens."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0              # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # The penalty counts the prompt's tokens too (transformers' and vLLM's rule); False: the output's
    # only, as OpenAI's presence and frequency penalties count (what `chat` asks: a short question's
    # own words stay usable in its answer).
    penalize_prompt: bool = True
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's logprob and the top N
    prompt_logprobs: int | None = None  # None: none; N >= 0: each prompt token's logprob (from the 2nd) and the top N
    cache_salt: str | None = None  # isolates prefix-cache entries per tenant
    speculative: str | None = None  # None: the engine's default; "off", or a method the engine has loaded
    num_speculative_tokens: int | str | None = None  # None: the engine's default; k >= 1, or "auto"
    structured: StructuredOutput | None = None   # constrained decoding (cluster/engine/grammar.py)
    # Attention sinks with a window (cluster/kv/window.py): keep the first kv_sink_tokens and the last
    # kv_window tokens' KV. None: the server's default; kv_window 0 turns the server's window off.
    kv_window: int | None = None
    kv_sink_tokens: int | None = None
    # KV compaction of a long prompt after its prefill (KVCompaction); None: the server's default.
    kv_compaction: KVCompaction | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable/frozen.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0,
               f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k!r}")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be a non-negative 63-bit integer, got {self.seed!r}")
        _check(all(t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative, got {list(self.stop_token_ids)!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop strings must be non-empty strings")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               f"logprobs must be between 0 and 20, got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs!r}")
        _check(self.speculative is None or self.speculative in SPEC_METHODS,
               f"speculative must be one of {', '.join(SPEC_METHODS)}, got {self.speculative!r}")
        k = self.num_speculative_tokens
        _check(k is None or k == "auto" or (isinstance(k, int) and not isinstance(k, bool)
                                                     and 1 <= k <= MAX_SPECULATIVE_TOKENS),
               f"num_speculative_tokens must be 'auto' or an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        _check(self.kv_window is None or (isinstance(self.kv_window, int) and self.kv_window >= 0),
               f"kv_window must be a number of tokens >= 0 (0: off), got {self.kv_window!r}")
        _check(self.kv_sink_tokens is None or (isinstance(self.kv_sink_tokens, int) and self.kv_sink_tokens >= 0),
               f"kv_sink_tokens must be a number of tokens >= 0, got {self.kv_sink_tokens!r}")
        _check(self.kv_compaction is None or isinstance(self.kv_compaction, KVCompaction),
               "kv_compaction must be a KVCompaction")
        _check(self.structured is None or isinstance(self.structured, StructuredOutput),
               "structured must be a StructuredOutput")
        _check(self.structured is None or not self.ignore_eos,
               "ignore_eos cannot be combined with a structured output constraint (the output ends where it is complete)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class Fork:
    """One more sample of a request's prompt (OpenAI's `n`): computed once with the request, drawn
    with its own sampling, streamed under its own id. The one shape forks take everywhere: the
    engine, the worker calls and the engine loop each set the fields they know. A handed-off
    fork's first token travels in the `KVHandle` (`KVHandle.forks`), not here."""
    request_id: str
    sampling: SamplingParams
    stream_key: int | None = None    # its stream at the frontend that owns it (worker calls)

    def __post_init__(self):
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError("a fork's sampling must be a SamplingParams")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class TokenDelta:
    """One step's new output of one request, as the engine streams it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # With `prompt_logprobs`: once, on the request's first delta; the prompt's tokens from its second on.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def merge_deltas(deltas: "list[TokenDelta]") -> TokenDelta:
    """Consecutive deltas of one request as one: tokens, text and logprobs joined; counts and the
    finish reason of the last."""
    if len(deltas) == 1:
        return deltas[0]
    return replace(deltas[-1], token_ids=tuple(t for d in deltas for t in d.token_ids),
                   text="".join(d.text for d in deltas), logprobs=tuple(lp for d in deltas for lp in d.logprobs),
                   prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), ()))


@dataclass(frozen=True)
class Completion:
    """A whole finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprob, ...] = field(default=())
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = field(default=())   # with SamplingParams.prompt_logprobs


_TP_FIELDS = ("tp_size", "tp_rank", "kv_head_start", "total_kv_heads")


@dataclass(frozen=True)
class KVLayout:
    """What two KV caches must agree on to exchange blocks. Its hash is checked at handshake
    and on every handle, so a mismatch is refused instead of silently corrupting output."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    version: int = 1
    kv_dtype: str = "auto"   # cluster/kv/kv_quant.py's KVCacheDType: int8/fp8_e4m3 rows of D bytes + an fp16 scale
    # Latent attention (MLA): one cached vector of this width per token and layer, no per-head K/V.
    # Its two halves sit in the arena's K and V planes (num_kv_heads 1, head_dim ceil(latent_dim / 2)),
    # so blocks, transports, tiers and checksums move it as they move K/V. 0: per-head K and V.
    latent_dim: int = 0
    # A tensor-parallel rank's share (cluster/parallel/): `num_kv_heads` heads from `kv_head_start`
    # of the model's `total_kv_heads`, on rank `tp_rank` of `tp_size`.
    tp_size: int = 1
    tp_rank: int = 0
    kv_head_start: int = 0
    total_kv_heads: int = 0   # 0: num_kv_heads (a single-rank layout)

    def layout_hash(self) -> str:
        # kv_dtype, latent_dim and the TP fields joined the layout later: left out at their defaults
        # (single-rank values), so those layouts hash as before.
        fields = {k: v for k, v in self.__dict__.items()
                  if not (k == "kv_dtype" and v == "auto") and not (k == "latent_dim" and v == 0)
                  and not (k in _TP_FIELDS and self.tp_size == 1)}
        text = "|".join(f"{k}={v}" for k, v in sorted(fields.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_bytes()

    def bytes_per_token(self) -> int:
        """KV bytes one token takes over every layer (what the banner reports and a handoff moves)."""
        return self.bytes_per_block() // self.block_size

    @classmethod
    def latent(cls, model_id: str, num_layers: int, latent_dim: int, block_size: int, dtype: str) -> KVLayout:
        """An MLA layout: the latent vector split over the K and V planes (one element of padding
        where its width is odd)."""
        return cls(model_id=model_id, num_layers=num_layers, num_kv_heads=1, head_dim=-(-latent_dim // 2),
                   block_size=block_size, dtype=dtype, latent_dim=latent_dim)

    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) for one KV head."""
        if self.kv_dtype != "auto":
            return self.head_dim + 2          # one byte a value, then the fp16 scale
        import torch  # noqa: PLC0415 - torch is heavy: the router imports these types without it
        return self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class ForkFirst:
    """A fork's first token, drawn by the prefill worker from the prompt's logits beside the
    request's own: what a decode worker continues that fork from."""
    request_id: str
    token: int


@dataclass(frozen=True)
class KVHandle:
    """The one object that crosses from prefill to decode: where a request's prompt KV lies, how
    to check it, and the lease that keeps it pinned. Encoded as msgpack when it crosses processes.
    The one place a handoff's first tokens live: the request's (`first_token`) and its forks'."""

    request_id: str
    producer: str                   # the producer's transport agent name
    lease_id: str
    block_ids: tuple[int, ...]      # producer's blocks, in token order
    num_tokens: int                 # prompt tokens whose KV the blocks hold
    first_token: int
    layout_hash: str
    checksums: tuple[int, ...] = ()  # one per block; empty when integrity checks are off
    lease_seconds: float = 30.0
    version: int = 1
    feature: bytes = b""            # EAGLE: the prompt's last hidden state (raw, the layout's dtype)
    forks: tuple[ForkFirst, ...] = ()   # the forks' first tokens (more samples continued on these blocks)
    # Prompt positions whose KV the blocks do not hold (a compacted prompt, cluster/kv/compaction.py):
    # the consumer lays every later position p out at cache index p - cache_offset.
    cache_offset: int = 0

    def first_tokens(self) -> dict[str, int]:
        """Each sample's first token by request id: the request's and its forks'."""
        return {self.request_id: self.first_token, **{f.request_id: f.token for f in self.forks}}

    def encode(self) -> bytes:
        raw = {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}
        raw["forks"] = [[f.request_id, f.token] for f in self.forks]
        return msgpack.packb(raw)

    @classmethod
    def decode(cls, data: bytes) -> "KVHandle":
        """Strict: every field present with its type and within its range (a handle crosses processes);
        anything else is a ValueError naming the field."""
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_HANDLE_BYTES:
            raise ValueError("not a KVHandle: not bytes, or over the size limit")
        try:
            raw = msgpack.unpackb(data, max_map_len=16, max_array_len=MAX_HANDLE_BLOCKS, max_str_len=256,
                                  max_bin_len=1 << 20)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds on garbage
            raise ValueError(f"not a KVHandle: {type(exc).__name__}") from None
        if not isinstance(raw, dict) or raw.get("version") != 1:
            raise ValueError("not a version-1 KVHandle")
        expected = {f for f in cls.__dataclass_fields__}
        if set(raw) != expected:
            raise ValueError(f"KVHandle fields: missing {sorted(expected - set(raw))}, unknown {sorted(set(raw) - expected)}")
        for name in ("request_id", "producer", "lease_id", "layout_hash"):
            if not isinstance(raw[name], str) or not 0 < len(raw[name]) <= 256:
                raise ValueError(f"KVHandle.{name}: a non-empty string of at most 256 characters")
        blocks, sums = raw["block_ids"], raw["checksums"]
        if not isinstance(blocks, list) or not blocks or not all(_int_in(b, 0, 1 << 31) for b in blocks):
            raise ValueError("KVHandle.block_ids: a non-empty list of block ids in [0, 2^31)")
        if len(set(blocks)) != len(blocks):
            raise ValueError("KVHandle.block_ids: a block appears twice")
        if not isinstance(sums, list) or len(sums) not in (0, len(blocks)) or not all(
                _int_in(c, -(1 << 63), 1 << 64) for c in sums):
            raise ValueError("KVHandle.checksums: none, or one 64-bit integer per block")
        n = raw["num_tokens"]
        if not _int_in(n, 1, 1 << 31) or len(blocks) > n:
            raise ValueError("KVHandle.num_tokens: at least one token per block")
        if not _int_in(raw["first_token"], 0, 1 << 31):
            raise ValueError("KVHandle.first_token: a token id")
        secs = raw["lease_seconds"]
        if not isinstance(secs, (int, float)) or isinstance(secs, bool) or not 0 < secs <= 3600:
            raise ValueError("KVHandle.lease_seconds: in (0, 3600]")
        if not _int_in(raw["cache_offset"], 0, n):
            raise ValueError("KVHandle.cache_offset: in [0, num_tokens)")
        if not isinstance(raw["feature"], bytes):
            raise ValueError("KVHandle.feature: bytes")
        raw["forks"] = _fork_firsts(raw["forks"])
        raw["block_ids"], raw["checksums"] = tuple(blocks), tuple(sums)
        return cls(**raw)


def _fork_firsts(raw) -> tuple[ForkFirst, ...]:
    """A handle's `forks` as msgpack carries them: [request id, first token] pairs, strictly."""
    if not isinstance(raw, list) or len(raw) > MAX_HANDLE_FORKS or not all(
            isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and 0 < len(f[0]) <= 256
            and _int_in(f[1], 0, 1 << 31) for f in raw):
        raise ValueError("KVHandle.forks: a list of [request id, first token id] pairs")
    return tuple(ForkFirst(rid, token) for rid, token in raw)


MAX_HANDLE_BYTES = 4 << 20
MAX_HANDLE_BLOCKS = 1 << 18
MAX_HANDLE_FORKS = 1 << 10


def _int_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


@dataclass(frozen=True)
class GenerateRequest:
    """A validated request, as the router hands it on: tokenized, limits checked."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    model: str = ""
    tenant: str = ""      # the API key's tenant (cluster/secrets.py): it owns the request
