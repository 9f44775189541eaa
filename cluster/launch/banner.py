"""What `splitserve serve` prints once it serves: what is served, how, and how to reach it.

One block on stderr, readable by a person and parsed by nothing but the tests' harness (which
reads the `gRPC:`, `OpenAI API:` and `metrics:` lines) and bench/worker_memory.py (the `KV cache:`
lines, each worker's pool as its first stats gave it). Every address is the one actually bound
(a port of 0 was picked by the server). The curl line works as printed: it names the served
model, and carries the key header when keys are set.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.config import format_size
from cluster.launch.cluster_config import ClusterConfig
from cluster.model.kernel_choice import plan_dtype
from cluster.model.mla_engine import latent_kv_line
from cluster.model.model_config import load_model_config
from cluster.worker_messages import WorkerStats

QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class Endpoints:
    """Where the cluster listens, as bound: gRPC's host:port, the HTTP API's and the metrics' URLs."""
    grpc: str | None
    http: str | None
    metrics: str | None


def topology(cfg: ClusterConfig) -> str:
    if cfg.colocated:
        return f"{cfg.num_decode} colocated worker{'s' if cfg.num_decode > 1 else ''} (both phases)"
    return f"{cfg.num_prefill} prefill + {cfg.num_decode} decode workers, KV over {cfg.data_plane.transport}"


def local_prefill_rule(cfg: ClusterConfig) -> str | None:
    """When a disaggregated cluster prefills on the decode worker after all (no KV transfer): said at
    start, so that a fresh cluster's `splitserve_kv_transfers_total 0` surprises no one."""
    if cfg.colocated:
        return None
    r = cfg.router
    cached = f"at least {r.local_prefill_cached_fraction:.0%} cached on the decode worker"
    if r.local_prefill_max_tokens == 0:
        return f"on a prefill worker, KV moved to the decode worker; prompts {cached} are prefilled there"
    return (f"prompts of at most {r.local_prefill_max_tokens} tokens (or {cached}) are prefilled on the decode "
            f"worker without a KV transfer, longer ones on a prefill worker (--local-prefill-max-tokens 0 sends "
            f"every prompt not cached there through a prefill worker)")


def tensor_parallel_line(cfg: ClusterConfig) -> str | None:
    """Each role's tensor-parallel size, when one is above 1 (docs/parallel.md)."""
    sizes = {"prefill": cfg.tensor_parallel_size("prefill"), "decode": cfg.tensor_parallel_size("decode")}
    if max(sizes.values()) == 1:
        return None
    roles = [f"{'colocated' if cfg.colocated else r} TP {n}" for r, n in sizes.items() if not (cfg.colocated and
                                                                                                 r == "prefill")]
    return (", ".join(roles) + " (rank processes in one placement group; each rank holds its share of the weights "
            "and KV heads, the per-rank figures are in the worker's log; docs/parallel.md)")


def speculation(cfg: ClusterConfig) -> str:
    spec = cfg.engine.speculative
    if spec.method == "off":
        return "off (a request may ask for ngram)"
    return f"{spec.method}, {spec.num_speculative_tokens} tokens per step"


def kv_pool(stats: WorkerStats, max_model_len: int | None) -> str:
    """One worker's KV pool as planned: its size, what it holds, and what set it (the flag that
    raises it), so a pool smaller than a user expects explains itself."""
    tokens = stats.blocks_total * stats.block_size
    fits = f", {tokens // max_model_len:,} sequences of {max_model_len:,}" if max_model_len else ""
    return (f"{format_size(stats.kv_bytes)} = {stats.blocks_total:,} blocks of {stats.block_size} tokens "
            f"({tokens:,} tokens{fits}); set by {stats.kv_limit or 'the memory plan'}")


def kv_lines(workers: Sequence[WorkerStats], max_model_len: int | None) -> list[str]:
    """A line per role (per distinct pool within a role: workers on different nodes may differ),
    naming its workers."""
    groups: dict[tuple, list[WorkerStats]] = {}
    for s in workers:
        if s.blocks_total:
            groups.setdefault((s.role, s.blocks_total, s.block_size, s.kv_bytes, s.kv_limit), []).append(s)
    lines = []
    for alike in groups.values():
        names = [s.name for s in alike]
        who = ", ".join(names) if len(names) <= 3 else f"{names[0]} and {len(names) - 1} more"
        lines.append(f"  KV cache: {who} {kv_pool(alike[0], max_model_len)}")
    return lines


def curl_line(cfg: ClusterConfig, http: str, model_name: str, chat: bool) -> str:
    """A request to paste: the chat route for a model with a chat template, completions otherwise."""
    if chat:
        route, prompt = "chat/completions", '"messages": [{"role": "user", "content": "%s"}]' % QUESTION
    else:
        route, prompt = "completions", '"prompt": "def fibonacci(n):"'
    body = '{"model": "%s", %s, "max_tokens": 64}' % (model_name, prompt)
    key = " -H \"Authorization: Bearer $KEY\"" if cfg.api_keys else ""
    tls = " --cacert CA.pem" if cfg.tls else ""
    return f"curl{tls} -s {http}/v1/{route} -H 'Content-Type: application/json'{key} -d '{body}'"


def dtype_line(cfg: ClusterConfig) -> str:
    """What the workers compute in, and why when `--dtype auto` chose it."""
    dtype = str(plan_dtype(cfg.engine)).removeprefix("torch.")
    if cfg.engine.dtype != "auto":
        return dtype
    why = ("this CPU computes bf16 natively" if dtype == "bfloat16" else "no native bf16 on this CPU")
    return f"{dtype} (--dtype auto: {why})" if cfg.engine.device.startswith("cpu") else f"{dtype} (the checkpoint's)"


def _latent_line(cfg: ClusterConfig) -> str | None:
    if not (cfg.engine.model / "config.json").is_file():   # a GGUF file or a built-in name: no latent models
        return None
    return latent_kv_line(load_model_config(cfg.engine.model), plan_dtype(cfg.engine), cfg.engine.cache.block_size)


def banner(cfg: ClusterConfig, model_name: str, version: str, at: Endpoints, chat: bool,
           workers: Sequence[WorkerStats] = (), max_model_len: int | None = None) -> list[str]:
    """The lines to print, in order: what, how, where, then a request to try (`chat`: the model
    has a chat template). `workers`: their first stats (the KV pools as planned); `max_model_len`:
    the served one (default: the configured one, when set)."""
    source = cfg.engine.model.name
    named = model_name if model_name == source else f"{model_name} (from {source})"
    lines = [f"splitserve {version}: serving {named} on {topology(cfg)}"]
    if (rule := local_prefill_rule(cfg)) is not None:
        lines.append(f"  prefill: {rule}")
    lines.append(f"  speculative decoding: {speculation(cfg)}; deterministic (batch-invariant): "
                 f"{'on' if cfg.engine.deterministic else 'off'}")
    lines.append(f"  compute dtype: {dtype_line(cfg)}")
    if cfg.engine.quantization_choice is not None:   # --quantization auto: what it chose and why
        lines.append(f"  weights: --quantization {cfg.engine.quantization_choice} (docs/quantization.md)")
    elif cfg.engine.quantization != "none":
        lines.append(f"  weights: --quantization {cfg.engine.quantization} (docs/quantization.md)")
    if cfg.engine.cache.kv_cache_dtype != "auto":
        lines.append(f"  KV cache: --kv-cache-dtype {cfg.engine.cache.kv_cache_dtype}, one byte a value and an fp16 "
                     "scale per token and head (docs/quantization.md)")
    if (tp := tensor_parallel_line(cfg)) is not None:
        lines.append(f"  tensor parallel: {tp}")
    lines += kv_lines(workers, max_model_len or cfg.engine.max_model_len)
    if (latent := _latent_line(cfg)) is not None:
        lines.append(latent)
    if at.grpc:
        lines.append(f"  gRPC: {at.grpc} (splitserve.v1; sampling greedy unless a request sets temperature)")
    if at.http:
        lines.append(f"  OpenAI API: {at.http}/v1 (OpenAI's defaults: temperature 1, completions' max_tokens 16)")
    if at.metrics:
        lines.append(f"  metrics: {at.metrics}")
    if at.http:
        lines.append(f"  try: {curl_line(cfg, at.http, model_name, chat)}")
    if at.grpc:
        question = QUESTION if chat else "def fibonacci(n):"
        lines.append(f"  try: splitserve generate --server {at.grpc} \"{question}\"")
    return lines


def models_lines(models: Sequence[tuple[ClusterConfig, str]], skill_routes: str | None) -> list[str]:
    """Several models (cluster/launch/models.py): each other model, what it is, where it runs; how
    "auto" chooses. `models`: each one's config and served name."""
    lines = []
    for cfg, name in models:
        source = cfg.engine.model.name
        named = name if name == source else f"{name} (from {source})"
        lines.append(f"  also serving: {named} on {topology(cfg)}; compute dtype {dtype_line(cfg)}")
    if models:
        lines.append("  model \"auto\": " + (f"skill routing by {skill_routes} (docs/models.md)" if skill_routes
                                              else "off (give --skill-routes FILE)"))
    return lines
