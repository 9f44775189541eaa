"""The messages of the worker calls: what the router sends a worker (Ray control and data calls)
and what comes back. Frozen, typed and checked on construction, so a wrong shape fails where it is
built, not three processes later; each result carries a version its reader checks.

Reading order: the calls (`PrefillCall` with its `HandOn`, `GenerateCall`, `DecodeCall`, their
`forks` being `cluster.types.Fork`), the prefill outcome (`PrefillResult`), the stats a worker answers a poll
with (`WorkerStats`, with its role's parts as typed sub-records). Deltas do not travel here: they
go over the token stream (`cluster/token_stream.py`).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from cluster.token_stream import SinkAddress
from cluster.types import FinishReason, Fork, SamplingParams, TokenDelta

WORKER_STATS_VERSION = 1
CONTROL = "control"     # the workers' Ray concurrency group for control calls (cluster/launch/app.py)
# 2: the first delta as a TokenDelta (its token no longer a field of its own); 3: a handoff's outcome
PREFILL_RESULT_VERSION = 3


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_call(call) -> None:
    """What every call shares: a request id, token ids as a tuple, sampling and typed forks."""
    _need(isinstance(call.request_id, str) and call.request_id != "", f"{type(call).__name__}.request_id: a string")
    object.__setattr__(call, "prompt_ids", tuple(call.prompt_ids))
    _need(isinstance(call.sampling, SamplingParams), f"{type(call).__name__}.sampling: a SamplingParams")
    object.__setattr__(call, "forks", tuple(call.forks))
    _need(all(isinstance(f, Fork) for f in call.forks), f"{type(call).__name__}.forks: Fork records")


@dataclass(frozen=True)
class HandOn:
    """Where a prefill worker hands its request on, so that a handed-off request costs its
    frontend one Ray call: the decode worker (by name: the wiring gave each prefill worker the
    decode workers' actor handles at its handshake) and the frontend's stream (`sink`, `key`; the
    forks' keys are in `PrefillCall.forks`) that the first deltas go to at once, and the decode
    worker's after them."""
    decode_name: str
    sink: SinkAddress
    key: int
    sent_at: float = 0.0         # when the frontend sent the call (handoff timings)
    tenant: str = ""

    def __post_init__(self):
        _need(isinstance(self.sink, SinkAddress), "HandOn.sink: a SinkAddress")


@dataclass(frozen=True)
class PrefillCall:
    """Prefill a prompt and publish its KV. `forks` (request id, sampling): more samples of this
    prompt, computed once, each with its own first token, all continued from one handle. With
    `hand_on` the worker streams the first deltas and starts the decode itself (`DecodeCall`), and
    answers once the decode worker has ended the request; without it, it answers with the handle."""
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    forks: tuple[Fork, ...] = ()
    stats_sink: SinkAddress | None = None     # the caller's token stream: the worker's stats go there
    # Publish the KV even when the request ends with its first token: a prefix exported for another
    # worker to read (router: PrefillPlace.FETCHED), not a request of its own.
    export: bool = False
    hand_on: HandOn | None = None

    def __post_init__(self):
        _check_call(self)
        _need(self.stats_sink is None or isinstance(self.stats_sink, SinkAddress),
              "PrefillCall.stats_sink: a SinkAddress or None")
        _need(self.hand_on is None or isinstance(self.hand_on, HandOn), "PrefillCall.hand_on: a HandOn or None")
        _need(self.hand_on is None or all(f.stream_key is not None for f in self.forks),
              "PrefillCall.forks: each with its stream key when handed on")
        _need(self.hand_on is None or not self.export, "PrefillCall: an export is not handed on")


@dataclass(frozen=True)
class GenerateCall:
    """Both phases on a decode worker (colocated, or a prompt not worth a handoff); deltas go to
    `sink` under `key`. `resume_samples`: the request continues one that already sampled this many
    tokens elsewhere (a failover). `forks` (request id, sampling, stream key): more samples."""
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    sink: SinkAddress
    key: int
    resume_samples: int = 0
    forks: tuple[Fork, ...] = ()
    tenant: str = ""     # the API key's: the request's per-tenant state on the worker (decode/spec/online/)
    # An encoded KVHandle of the prompt's leading blocks, exported by another worker that holds them
    # (in its pool or tiers): pulled and cached here first, so only the rest is computed.
    prefix_handle: bytes | None = None

    def __post_init__(self):
        _check_call(self)
        _need(isinstance(self.sink, SinkAddress), "GenerateCall.sink: a SinkAddress")
        _need(all(f.stream_key is not None for f in self.forks), "GenerateCall.forks: each with its stream key")


@dataclass(frozen=True)
class DecodeCall:
    """Continue a request prefilled elsewhere from its KV `handle` (a msgpack `KVHandle`, which
    carries every sample's first token); `forks` (request id, sampling, stream key): more samples
    continued on the same pulled blocks. `sent_at`: for handoff timings."""
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    handle: bytes
    sink: SinkAddress
    key: int
    sent_at: float = 0.0
    forks: tuple[Fork, ...] = ()
    tenant: str = ""

    def __post_init__(self):
        _check_call(self)
        _need(isinstance(self.handle, bytes), "DecodeCall.handle: bytes (an encoded KVHandle)")
        _need(isinstance(self.sink, SinkAddress), "DecodeCall.sink: a SinkAddress")
        _need(all(f.stream_key is not None for f in self.forks), "DecodeCall.forks: each with its stream key")


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill answers: the first delta as the client sees it (its token, text, logprobs,
    counts; its finish reason set when the request ends with its first token; no token when it
    ended before one), and the KV handle a decode worker continues from otherwise (the first
    tokens a decode worker continues from are the handle's)."""
    request_id: str
    first: TokenDelta
    handle: bytes | None                   # KVHandle (msgpack) when a decode worker must continue
    # n > 1: the other samples' first tokens, drawn from the same prompt logits (finish_reason
    # None: it continues on the decode worker, on the same handle).
    forks: tuple[TokenDelta, ...] = ()
    # With `PrefillCall.hand_on`: the first deltas went over the caller's token stream
    # (`streamed`), and `handed_on` when the decode worker was started; its call's error, if it
    # raised (WorkerBusy, the worker's death, the request's fault), as the caller would have seen
    # it: the lease is released by then. A handed-on answer carries no handle (the decode worker had it).
    streamed: bool = False
    handed_on: bool = False
    decode_error: BaseException | None = None
    version: int = PREFILL_RESULT_VERSION

    def first_deltas(self, fork_ids: tuple[str, ...] = ()) -> dict[str, TokenDelta]:
        """The first delta of the request and of each fork, by request id, as the client sees them."""
        firsts = {self.request_id: self.first} | {d.request_id: d for d in self.forks}
        for rid in fork_ids:       # ended with the request before its first token (an abort)
            firsts.setdefault(rid, TokenDelta(rid, (), "", self.first.finish_reason or FinishReason.ABORT, (),
                                              self.first.num_prompt_tokens))
        return firsts


@dataclass(frozen=True)
class SpecStats:
    """One speculative method's counts on one worker."""
    method: str
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    emitted: int = 0
    drafted_at: tuple[int, ...] = ()    # [i]: drafts with a token at position i + 1
    accepted_at: tuple[int, ...] = ()   # [i]: of those, verifications that accepted it
    tree_drafted: int = 0               # token-tree leaves verified (beside the chains, counted in drafted)
    tree_accepted: int = 0              # of those, accepted (each a token the chain alone would have missed)


@dataclass(frozen=True)
class SpecHeadStats:
    """Online adaptation (decode/spec/online/): a tenant's live EAGLE head version on one worker,
    and how often it changed there (each swap, and the swaps that were rollbacks)."""
    tenant: str
    version: int = 0
    swaps: int = 0
    rollbacks: int = 0


@dataclass(frozen=True)
class PrefillStats:
    leases: int = 0                 # published handles not yet pulled (their blocks pinned)


@dataclass(frozen=True)
class HandoffStats:
    """A decode worker's handoffs: pulled, failed (recomputed here), declined (no room)."""
    done: int = 0
    failed: int = 0
    declined: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fetched: int = 0          # prompts whose leading blocks were pulled from the worker holding them
    fetched_blocks: int = 0
    fetch_failed: int = 0     # such pulls that failed (those blocks were computed here)


@dataclass(frozen=True)
class TierStats:
    """A worker's KV tiers (cluster/kv/tiers.py), in blocks (one slot of a tier holds one block)."""
    host_blocks: int = 0
    host_capacity: int = 0
    disk_blocks: int = 0
    disk_capacity: int = 0
    offloaded: int = 0            # blocks copied down from the pool
    loaded_host: int = 0          # blocks loaded back into the pool for a prefix hit, by the tier they came from
    loaded_disk: int = 0
    corrupt: int = 0              # blocks that failed their checksum (recomputed instead)
    recovered: int = 0            # disk blocks found at start-up (a restarted worker's)
    parked: int = 0               # requests waiting for their blocks to load
    load_seconds: float = 0.0     # the tier thread's time loading blocks (with loaded_*: its speed)


@dataclass(frozen=True)
class WorkerStats:
    """A worker's answer to a stats poll: its health (incarnation, readiness, step counter), its
    load (KV blocks, queues) and counters for the metrics. Role-specific parts are None elsewhere."""
    name: str
    role: str                       # "prefill" | "decode"
    incarnation: str
    ready: bool
    pid: int = 0
    steps: int = 0                  # engine steps that did work (the progress watchdog reads it)
    has_work: bool = False
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    block_size: int = 0
    kv_bytes: int = 0               # the KV pool's bytes as planned (MemoryPlan.kv_bytes)
    kv_limit: str = ""              # what set the pool's size, as the flag that raises it (MemoryPlan.limit)
    waiting: int = 0
    running: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens_computed: int = 0
    prompt_seconds: float = 0.0     # engine time of the steps that computed prompt tokens (its prefill speed)
    kv_refused: int = 0
    kv_discarded: int = 0
    queue_seconds: float = 0.0
    queue_count: int = 0
    # The queue-time histogram: (upper bound in seconds, requests that waited at most that long),
    # cumulative; its +Inf bucket is `queue_count`. The bounds travel with the counts: the reader
    # needs no table that a worker of another release could disagree with.
    queue_time_buckets: tuple[tuple[float, int], ...] = ()
    preemptions: int = 0            # requests preempted (blocks freed, recomputed later)
    spec: tuple[SpecStats, ...] = ()
    spec_heads: tuple[SpecHeadStats, ...] = ()    # --spec-online: tenants' live head versions
    prefill: PrefillStats | None = None
    handoff: HandoffStats | None = None
    tiers: TierStats | None = None   # KV tiers below the pool, when configured
    # A mixture-of-experts model's load: (layer, tokens routed to each expert) per sparse layer,
    # counted since the worker started (cluster/model/moe.py); () for a dense model.
    expert_tokens: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # With --enable-expert-parallel: (layer, (token, expert) pairs run on each rank) per sparse
    # layer, and the expert balancer's applied placements (--enable-eplb).
    expert_rank_tokens: tuple[tuple[int, tuple[int, ...]], ...] = ()
    expert_rebalances: int = 0
    # The worker's time.monotonic() when these were read: a push and a poll of one incarnation can
    # arrive out of order (a poll answered before a push is read after it); this orders them.
    taken_at: float = 0.0
    leaving: bool = False           # it got SIGTERM: the driver drains and removes it (cluster/launch/admin.py)
    # --max-loaded-models (cluster/engine/weight_swap.py): whether its model's weights are loaded,
    # and how many times they were loaded again after a release.
    weights_loaded: bool = True
    model_loads: int = 0
    version: int = WORKER_STATS_VERSION

    def supersedes(self, other: "WorkerStats | None") -> bool:
        """Newer than `other`: none yet, another incarnation's, or read earlier by this one."""
        return other is None or other.incarnation != self.incarnation or self.taken_at >= other.taken_at

    @property
    def kv_usage(self) -> float:
        """Blocks held by requests over the pool, 0..1 (vLLM's `kv_cache_usage_perc`)."""
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    @property
    def leases(self) -> int:
        return self.prefill.leases if self.prefill is not None else 0

    def spec_of(self, method: str) -> SpecStats:
        """One speculative method's counts here (zeros when it never ran here)."""
        return next((c for c in self.spec if c.method == method), SpecStats(method))

    @property
    def busy(self) -> bool:
        """Anything in flight: queued, running, blocks held or leases out."""
        return bool(self.running or self.waiting or self.blocks_used or self.leases)


class StatsSource(enum.Enum):
    """How a `WorkerStats` reached the router (router/worker_pool.py `WorkerPool.observe`; the
    `source` label of `splitserve_worker_stats_reports_total`)."""
    POLL = "poll"    # a Ray call (router/stats_poll.py)
    PUSH = "push"    # over the worker's token stream, while it steps (cluster/token_stream.py)


class MessageRefused(ValueError):
    """A worker's answer of the wrong type or version (a worker of another release in the cluster)."""


def expect(message, cls):
    """`message` if it is a `cls` of the version this side reads; else `MessageRefused`, never a
    read of fields that may mean something else."""
    if not isinstance(message, cls):
        raise MessageRefused(f"expected a {cls.__name__}, got {type(message).__name__}")
    want = cls.__dataclass_fields__["version"].default
    if message.version != want:
        raise MessageRefused(f"a {cls.__name__} of version {message.version!r}; this side reads version {want}")
    return message


# --- WorkerStats over the token stream ------------------------------------------------------------
# A busy worker pushes its stats to its frontends over the token stream (a "stats" frame), so the
# router's load view stays fresh without a Ray call per worker several times a second (each costs
# the driver ~2 ms of CPU). The body is a msgpack map of the dataclass's fields, read back strictly.
_STATS_PARTS = {"prefill": PrefillStats, "handoff": HandoffStats, "tiers": TierStats}


def stats_to_wire(stats: WorkerStats) -> dict:
    return dataclasses.asdict(stats)


def stats_from_wire(body) -> WorkerStats:
    """The strict inverse of `stats_to_wire`: ValueError naming the first field that is not what
    this version sends (a missing field takes its default; an unknown one is refused)."""
    _need(type(body) is dict, "stats: a map of WorkerStats fields")
    fields = {f.name for f in dataclasses.fields(WorkerStats)}
    unknown = set(body) - fields
    _need(not unknown, f"stats: unknown field(s) {sorted(map(str, unknown))}")
    _need(body.get("version") == WORKER_STATS_VERSION, f"stats: version {body.get('version')!r}; "
          f"this side reads version {WORKER_STATS_VERSION}")
    out = {}
    for name, value in body.items():
        if name in _STATS_PARTS:
            out[name] = None if value is None else _record(_STATS_PARTS[name], value)
        elif name == "spec":
            _need(type(value) is list, "WorkerStats.spec: a list")
            out[name] = tuple(_record(SpecStats, v) for v in value)
        elif name == "spec_heads":
            _need(type(value) is list, "WorkerStats.spec_heads: a list")
            out[name] = tuple(_record(SpecHeadStats, v) for v in value)
        elif name in ("expert_tokens", "expert_rank_tokens"):
            _need(type(value) is list and all(type(e) is list and len(e) == 2 and type(e[0]) is int
                                              and type(e[1]) is list and all(type(c) is int for c in e[1])
                                              for e in value),
                  f"WorkerStats.{name}: [layer, [counts]] pairs")
            out[name] = tuple((layer, tuple(counts)) for layer, counts in value)
        elif name == "queue_time_buckets":
            _need(type(value) is list and all(type(b) is list and len(b) == 2 and type(b[0]) in (int, float)
                                              and type(b[1]) is int for b in value),
                  "WorkerStats.queue_time_buckets: [bound, count] pairs")
            out[name] = tuple((float(b), c) for b, c in value)
        else:
            out[name] = _scalar(WorkerStats, name, value)
    _need("name" in out and "role" in out and "incarnation" in out and "ready" in out,
          "stats: name, role, incarnation and ready are required")
    return WorkerStats(**out)


def _record(cls, value):
    _need(type(value) is dict, f"{cls.__name__}: a map")
    names = {f.name for f in dataclasses.fields(cls)}
    _need(set(value) <= names, f"{cls.__name__}: unknown field(s) {sorted(map(str, set(value) - names))}")
    return cls(**{k: _scalar(cls, k, v) for k, v in value.items()})


_SCALAR_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _scalar(cls, name: str, value):
    if cls.__dataclass_fields__[name].type == "tuple[int, ...]":
        _need(type(value) in (list, tuple) and all(type(v) is int for v in value), f"{cls.__name__}.{name}: ints")
        return tuple(value)
    want = _SCALAR_TYPES[cls.__dataclass_fields__[name].type]
    ok = type(value) is want or (want is float and type(value) is int)
    _need(ok, f"{cls.__name__}.{name}: a {want.__name__}")
    return float(value) if want is float else value
