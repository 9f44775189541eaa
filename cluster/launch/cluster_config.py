"""The root of the config tree: one cluster, its engines, data plane, router and front doors.

`splitserve serve` builds one from its flags and YAML (cluster/launch/settings.py); tests and
benchmarks build one directly. Each setting is declared once, in the dataclass that uses it
(cluster/config.py, router/): this class nests them and adds what only the cluster has.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from cluster.config import DataPlaneConfig, EngineConfig, check_port, derived, require, setting
from cluster.planner.planner_config import PlannerConfig
from router.admission import AdmissionConfig
from router.connections import ConnectionLimits
from router.policy import POLICIES
from router.router import RouterConfig
from router.validation import RequestBounds


_POLICIES = tuple(POLICIES)   # --policy's choices


def parse_resources(value) -> dict:
    """A JSON object of Ray resource name to amount (YAML gives the mapping itself)."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in parsed.values()):
        raise ValueError(f"expected a JSON object of resource amounts, e.g. '{{\"prefill\": 1}}', got {value!r}")
    return parsed


@dataclass(frozen=True)
class ClusterConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    data_plane: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    # What a request may cost, who gets an in-flight slot, how long a connection may idle or trickle
    # (router/validation.py, router/admission.py, router/connections.py).
    bounds: RequestBounds = RequestBounds()
    admission: AdmissionConfig = AdmissionConfig()
    connections: ConnectionLimits = ConnectionLimits()
    planner: PlannerConfig = PlannerConfig()     # sizes the pools (cluster/planner/, docs/planner.md)

    num_prefill: int = setting(1, "number of prefill workers", flag="--prefill")
    num_decode: int = setting(1, "number of decode workers", flag="--decode")
    colocated: bool = setting(False, "serve from engines that run both phases (the aggregated baseline; --prefill "
                                     "is then unused)")
    host: str = setting("127.0.0.1", "address the gRPC and HTTP servers bind to")
    # `--port` is gRPC's, as it always was here; vLLM's users know it as the HTTP port, hence the
    # primary name `--grpc-port` and the clear refusal when `--port 8000` meets the HTTP default.
    port: int | None = setting(50051, "the gRPC API's port (splitserve.v1, grpc.health.v1; 0 picks a free one, "
                                      "none: no gRPC server)", flag="--grpc-port", aliases=("--port",),
                                 metavar="PORT")
    http_port: int | None = setting(8000, "the OpenAI-compatible HTTP API's port, as vLLM's (/v1/completions, "
                                          "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /version, "
                                          "/health, /metrics; 0 picks a free one, none: no HTTP server)",
                                    metavar="PORT")
    metrics_port: int | None = setting(None, "serve Prometheus metrics of the whole cluster on "
                                             "http://METRICS_HOST:PORT/metrics", default_text="off")
    metrics_host: str | None = setting(None, "address the --metrics-port binds to", default_text="--host")
    frontends: int = setting(1, "gRPC frontend processes sharing the port (SO_REUSEPORT) and the workers (scale "
                                "the router out)")
    policy: str = setting("prefix_aware", "how the router picks a worker", choices=_POLICIES)
    ray_address: str | None = setting(None, "join an existing Ray cluster instead of starting one",
                                      default_text="a local Ray of its own")
    ray_token_file: str | None = setting(None, "the token of the Ray cluster --ray-address joins (Ray's token "
                                               "authentication; a local cluster gets a random one of its own)",
                                         metavar="FILE")
    worker_cpus: float = setting(1.0, "Ray CPUs each worker actor takes")
    # Ray GPUs per worker actor (Ray refuses "GPU" among custom resources). None: one GPU each
    # when the engine runs on CUDA (Ray then sets each actor's CUDA_VISIBLE_DEVICES), none on CPU;
    # a fraction shares a GPU between workers on purpose.
    worker_gpus: float | None = setting(None, "Ray GPUs each worker actor takes (a fraction shares one between "
                                              "workers)", default_text="1 with --device cuda, 0 on CPU")
    prefill_resources: dict = setting(help="Ray custom resources each prefill worker needs, e.g. '{\"prefill\": 1}' "
                                           "(places them on the nodes that advertise it)", factory=dict,
                                      parse=parse_resources, metavar="JSON")
    decode_resources: dict = setting(help="Ray custom resources each decode worker needs, e.g. '{\"decode\": 1}'",
                                     factory=dict, parse=parse_resources, metavar="JSON")
    # A worker of tensor-parallel size N: N rank processes in one Ray placement group (docs/parallel.md).
    prefill_tensor_parallel_size: int | None = setting(None, "the prefill workers' tensor-parallel size",
                                                       default_text="--tensor-parallel-size")
    decode_tensor_parallel_size: int | None = setting(None, "the decode (or colocated) workers' tensor-parallel size",
                                                      default_text="--tensor-parallel-size")
    tp_placement: str = setting("STRICT_PACK", "Ray placement strategy of a tensor-parallel worker's bundles (one "
                                               "per rank)", choices=("STRICT_PACK", "PACK"))
    switchable_roles: bool = setting(False, "start every worker with both roles' machinery (one engine, one set "
                                            "of weights), so that `splitserve scale --switch` changes its role "
                                            "without a reload (speculation off)")
    drain_timeout_s: float = setting(30.0, "how long a drain (scale-down, role switch, SIGTERM) waits for a "
                                           "worker's sequences to move or end; past it they fail over. "
                                           "`serve` on SIGTERM waits as long for the requests in flight to "
                                           "end, refusing new ones, then stops (keep Kubernetes' "
                                           "terminationGracePeriodSeconds above it)",
                                     flag="--drain-timeout")
    max_tokens_limit: int = setting(4096, "the most tokens a request may ask for")
    default_max_tokens: int = setting(256, "a request's max_tokens when it gives none (at most --max-tokens-limit)")
    poll_timeout_s: float = setting(5.0, "a worker stats poll slower than this is skipped (slow is not dead)")
    chat_template: str | None = setting(None, "Jinja chat template for /v1/chat/completions and chat", metavar="FILE",
                                        default_text="the model's own, from its tokenizer_config.json or "
                                                     "chat_template.jinja")
    served_model_name: str | None = setting(None, "the model's name in both APIs",
                                            default_text="the model directory's name")
    # Several models in one cluster (cluster/launch/models.py, docs/models.md): the models served
    # beside `engine.model`, each with its own workers; `model: "auto"` picks one by skill.
    models: tuple = derived((), "--model and --served-model-name given again, or the YAML's `models:` list: the "
                                "models served beside the first (ModelSpec)")
    skill_routes: str | None = setting(None, "YAML file of skill routes (`routes: [{model, skills, examples}]`): a "
                                             "request for model \"auto\" goes to the served model whose skills fit "
                                             "(docs/models.md)", metavar="FILE", default_text="off")
    # More models than memory (cluster/launch/model_swap.py): at most K models' weights loaded at once.
    max_loaded_models: int = setting(0, "with several models (--colocated): each worker slot holds at most this many "
                                        "models' weights; a request for another model waits while the least "
                                        "recently used idle one is released and its own loaded (docs/models.md)",
                                     default_text="0: off, every model loaded")
    model_scheduling: str = setting("grouped", "with --max-loaded-models, which waiting request goes next: grouped "
                                               "(a loaded model's requests first, one load serving a batch) or fcfs "
                                               "(arrival order)", choices=("grouped", "fcfs"))
    model_switch_max_wait_ms: float = setting(2000.0, "grouped: a request of an unloaded model that has waited this "
                                                      "long stops the loaded models letting more in, so its model "
                                                      "loads next (the fairness bound)")
    api_keys: tuple = derived((), "--api-key and --api-key-file: cluster.secrets.ApiKey, or plain key strings "
                                  "(each its own tenant)")
    # Seals the KV plane's handshakes and control messages (cluster/transfer/auth.py). None: a random
    # one per cluster, handed to every worker inside Ray's control plane.
    cluster_secret: object = derived(None, "--cluster-secret-file")
    tls_client_ca: bytes | None = derived(None, "--tls-client-ca: PEM; clients must present a certificate it signed")
    tls: tuple[bytes, bytes] | None = derived(None, "--tls-cert, --tls-key: (private key, certificate chain), PEM",
                                              repr=False)

    def __post_init__(self) -> None:
        require(self.num_decode >= 1, "num_decode", f"must be >= 1 (a cluster needs a decode worker), got "
                                                    f"{self.num_decode}")
        require(self.num_prefill >= (0 if self.colocated else 1), "num_prefill",
                f"must be >= 1 (or give --colocated), got {self.num_prefill}")
        require(self.frontends >= 1, "frontends", f"must be >= 1, got {self.frontends}")
        check_port("port", self.port, optional=True)
        require(self.port is not None or self.http_port is not None, "port",
                "is none and so is --http-port: nothing would be served (keep at least one API)")
        check_port("http_port", self.http_port, optional=True)
        check_port("metrics_port", self.metrics_port, optional=True)
        require(self.worker_cpus > 0, "worker_cpus", f"must be > 0, got {self.worker_cpus}")
        require(self.worker_gpus is None or self.worker_gpus >= 0, "worker_gpus",
                f"must be >= 0, got {self.worker_gpus}")
        require(self.policy in _POLICIES, "policy", f"must be one of {', '.join(_POLICIES)}, got {self.policy!r}")
        require(self.max_tokens_limit >= 1, "max_tokens_limit", f"must be >= 1, got {self.max_tokens_limit}")
        require(self.default_max_tokens >= 1, "default_max_tokens", f"must be >= 1, got {self.default_max_tokens}")
        require(self.poll_timeout_s > 0, "poll_timeout_s", f"must be > 0, got {self.poll_timeout_s}")
        require(self.drain_timeout_s > 0, "drain_timeout_s", f"must be > 0, got {self.drain_timeout_s}")
        require(not self.switchable_roles or self.engine.speculative.method == "off", "switchable_roles",
                f"needs --speculative off (a prefill worker's speculation differs), got {self.engine.speculative.method}")
        require(self.max_loaded_models >= 0, "max_loaded_models", f"must be >= 0, got {self.max_loaded_models}")
        require(self.model_switch_max_wait_ms > 0, "model_switch_max_wait_ms",
                f"must be > 0, got {self.model_switch_max_wait_ms}")
        for name in ("prefill_resources", "decode_resources"):
            parse_resources(getattr(self, name))
        self._check_tensor_parallel()
        if self.switchable_roles:    # both roles on one engine: one rank, and roles to switch between
            require(max(self.tensor_parallel_size("prefill"), self.tensor_parallel_size("decode")) == 1,
                    "switchable_roles", "needs workers of one rank (--tensor-parallel-size 1)")
            require(not self.colocated, "switchable_roles", "has no roles to switch with --colocated")

    def tensor_parallel_size(self, role: str) -> int:
        """The tensor-parallel size of `role`'s workers (prefill, decode; colocated workers: decode's)."""
        own = self.prefill_tensor_parallel_size if role == "prefill" else self.decode_tensor_parallel_size
        return own or self.engine.tensor_parallel_size

    def _check_tensor_parallel(self) -> None:
        for name in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            size = getattr(self, name)
            require(size is None or (isinstance(size, int) and size >= 1), name, f"must be >= 1, got {size!r}")
        prefill, decode = self.tensor_parallel_size("prefill"), self.tensor_parallel_size("decode")
        if max(prefill, decode) > 1:
            require(self.engine.quantization == "none", "tensor_parallel_size",
                    f"shards weights in --dtype: add --quantization none (got {self.engine.quantization})")
            # Ray shows an actor its own bundle's GPU only: the ranks' GPUs need rank actors (not built).
            require(not self.engine.device.startswith("cuda"), "tensor_parallel_size",
                    "above 1 in a cluster runs on CPU for now (a CUDA worker's ranks would not see their GPUs); "
                    "generate -tp N runs on N GPUs of one machine")



@dataclass(frozen=True)
class ModelSpec:
    """One more model a cluster serves: its own engine settings (None: the cluster's) and workers."""
    model: str
    served_model_name: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    num_prefill: int | None = None
    num_decode: int | None = None


def gpus_per_worker(cfg: ClusterConfig) -> float:
    """The Ray GPUs each worker asks for. A CUDA engine without any would see every GPU of its
    node and run on cuda:0, every worker on the same one."""
    cuda = cfg.engine.device.startswith("cuda")
    if cuda and ":" in cfg.engine.device:
        raise ValueError(f"--device {cfg.engine.device}: give --device cuda; Ray gives each worker its own GPU "
                         "(--worker-gpus)")
    if cfg.worker_gpus is None:
        return 1.0 if cuda else 0.0
    if cuda and cfg.worker_gpus <= 0:
        raise ValueError("--device cuda needs --worker-gpus above 0: 1 gives each worker its own GPU, a fraction "
                         "(0.5) shares one between workers")
    if cfg.worker_gpus < 0:
        raise ValueError(f"worker_gpus must be >= 0, got {cfg.worker_gpus}")
    return cfg.worker_gpus
