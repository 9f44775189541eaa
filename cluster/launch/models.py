"""Several models in one cluster (docs/models.md): each model gets its own workers, router, worker
pool and roster, as a cluster of one model would; the first model's frontend owns the ports and
hands each request to the stack of the model it names (router/served_models.py). Nothing is
shared between the models' workers: prefix caches, KV handoffs and layouts never mix models.

`--model` given more than once (with `--served-model-name` repeated in the same order), or the
YAML's `models:` list, makes `ClusterConfig.models`: the models beside the first, each a
`ModelSpec` whose unset fields take the cluster's own (shared settings stay top-level).
`--max-loaded-models K` puts every model's requests through one gate that keeps at most K models'
weights loaded (cluster/launch/model_swap.py, router/model_swap.py).
"""
from __future__ import annotations

from dataclasses import replace

from cluster.launch.app import RunningCluster, start_cluster
from cluster.launch.cluster_config import ClusterConfig, ModelSpec
from cluster.launch.model_swap import WorkersLoader, check_model_swap, make_gate
from router.model_swap import ModelSwapGate


def model_config(cfg: ClusterConfig, spec: ModelSpec) -> ClusterConfig:
    """The single-model cluster config of one more model: the cluster's settings, the spec's own over them."""
    engine = cfg.engine
    quantization = spec.quantization or ("auto" if engine.quantization_choice is not None else engine.quantization)
    engine = replace(engine, model=spec.model, dtype=spec.dtype or engine.dtype, quantization=quantization,
                     quantization_choice=None)
    return replace(cfg, engine=engine, served_model_name=spec.served_model_name,
                   num_prefill=spec.num_prefill if spec.num_prefill is not None else cfg.num_prefill,
                   num_decode=spec.num_decode if spec.num_decode is not None else cfg.num_decode,
                   models=(), metrics_port=None)


async def start_models(cfg: ClusterConfig) -> RunningCluster:
    """A cluster of `cfg`'s models: the others first (no ports of their own), then the first, whose
    ports serve them all. One model: `start_cluster` itself."""
    check_model_swap(cfg)
    if not cfg.models:
        return await start_cluster(cfg)
    if cfg.frontends > 1:
        raise ValueError("several models are served by one frontend for now: drop --frontends")
    gate = make_gate(cfg)
    others = []
    try:
        for i, spec in enumerate(cfg.models, start=1):
            others.append(await start_cluster(model_config(cfg, spec), attached=True, model_slot=_slot(gate, i)))
            await _register(gate, i, others[-1])
        peers = {c.model_name: c.frontend for c in others}
        main = await start_cluster(replace(cfg, models=()), peers=peers, model_slot=_slot(gate, 0))
        await _register(gate, 0, main)
    except BaseException:
        for c in others:
            await c.stop()
        raise
    if main.model_name in peers or len(peers) < len(others):
        await main.stop()
        for c in others:
            await c.stop()
        raise ValueError("two models have the same served name: give each its own --served-model-name")
    main.models = tuple(others)
    main.started_ray = any(c.started_ray for c in (main, *others))    # Ray ends last, with the main cluster
    for c in others:
        c.started_ray = False
    return main


def _slot(gate: ModelSwapGate | None, index: int):
    """The model's place at the gate (by its index: the served names are known once it started)."""
    return None if gate is None else (lambda: gate.serving(str(index)))


async def _register(gate: ModelSwapGate | None, index: int, cluster: RunningCluster) -> None:
    """--max-loaded-models: the model's workers join the gate, and the gate releases what is beyond
    its capacity at once, so start-up holds at most K models and the one starting. The first model
    registers last and is kept: its place is taken from the model registered last before it."""
    if gate is None:
        return
    gate.register(str(index), WorkersLoader(cluster.model_name, cluster.workers, cluster.metrics),
                  first=index == 0)
    await gate.trim()
