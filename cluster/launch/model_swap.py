"""More models than memory (`--max-loaded-models K`, docs/models.md): the wiring of router/model_swap.py's
gate. Each model keeps its own colocated workers (cluster/launch/models.py); with K set, at most K
models' workers hold their weights at once (per worker slot: model i's worker j and model k's
worker j are the slot's models), the others released (`EngineWorker.unload_weights`), and a
request for a released model waits at the gate until its model is loaded again. What is not
built is refused here, by name, before anything starts.
"""
from __future__ import annotations

import asyncio

from cluster.errors import RequestError
from cluster.launch.cluster_config import ClusterConfig
from router.model_swap import ModelScheduling, ModelSwapGate
from router.workers import WorkerClient

_UNLOAD_TRIES = 50      # a request that just ended may still be leaving the engine: a few tries, 20 ms apart


def check_model_swap(cfg: ClusterConfig) -> None:
    """Refuse --max-loaded-models where it is not built (ValueError naming the flags)."""
    if not cfg.max_loaded_models:
        return
    if not cfg.models:
        raise ValueError("--max-loaded-models needs several models (--model given more than once)")
    if not cfg.colocated:
        raise ValueError("--max-loaded-models is built for colocated workers only: add --colocated "
                         "(prefill/decode disaggregation would release weights under a KV handoff)")
    if cfg.engine.speculative.method != "off":
        raise ValueError(f"--max-loaded-models does not release a speculator's weights: drop --speculative "
                         f"{cfg.engine.speculative.method}")
    if max(cfg.tensor_parallel_size("decode"), cfg.engine.tensor_parallel_size) > 1:
        raise ValueError("--max-loaded-models needs workers of one rank: drop --tensor-parallel-size")
    if cfg.engine.cuda_graphs == "on" or (cfg.engine.device.startswith("cuda") and cfg.engine.cuda_graphs != "off"):
        raise ValueError("--max-loaded-models with CUDA graphs (on by default on CUDA): graphs hold the weights' "
                         "addresses; give --cuda-graphs off")
    if cfg.switchable_roles:
        raise ValueError("--max-loaded-models with --switchable-roles: not built")


def make_gate(cfg: ClusterConfig) -> ModelSwapGate | None:
    if not cfg.max_loaded_models:
        return None
    return ModelSwapGate(cfg.max_loaded_models, ModelScheduling(cfg.model_scheduling),
                         cfg.model_switch_max_wait_ms / 1000)


class WorkersLoader:
    """One model's workers as the gate loads and releases them; each load counted in the metrics
    (`splitserve_model_loads_total{worker,model_name}`)."""

    def __init__(self, model_name: str, workers: dict[str, WorkerClient], metrics):
        self.model_name = model_name
        self.workers = workers
        self.metrics = metrics

    async def load(self) -> None:
        loaded = await asyncio.gather(*(c.load_weights() for c in self.workers.values()))
        for name, now in zip(self.workers, loaded):
            if now and self.metrics is not None:
                self.metrics.model_loads.labels(worker=name, model_name=self.model_name).inc()

    async def unload(self) -> None:
        await asyncio.gather(*(_unload(c) for c in self.workers.values()))


async def _unload(client: WorkerClient) -> None:
    for attempt in range(_UNLOAD_TRIES):
        try:
            await client.unload_weights()
            return
        except RequestError:      # still has a request leaving it
            if attempt == _UNLOAD_TRIES - 1:
                raise
            await asyncio.sleep(0.02)
