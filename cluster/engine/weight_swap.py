"""A worker's model weights released and loaded again (`--max-loaded-models`, docs/models.md): more
models than memory. Releasing drops every tensor the model holds (parameters, buffers, and the
tensors its kernel plan laid out beside them) and the prefix cache (its blocks' KV would outlive
nothing useful: the next request finds its model loaded afresh, and the cache was never shared
with another model); loading reads the checkpoint again exactly as the engine first did
(`builder.load_models`) and moves the fresh tensors into the same modules, so the runner, the
KV pool and every reference to a module stay valid. The KV arena itself stays allocated: it is
registered with the transport for the worker's life.

Both run on the engine's thread between steps, only while no request runs (the caller checks).
"""
from __future__ import annotations

import torch

from cluster.engine import builder


def _tensor_slots(module: torch.nn.Module):
    """(holder dict, key, tensor) for each tensor a module holds directly."""
    for key, p in module._parameters.items():
        if p is not None:
            yield module._parameters, key, p
    for key, b in module._buffers.items():
        if b is not None:
            yield module._buffers, key, b
    for key, v in vars(module).items():
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            yield vars(module), key, v


def _forget_derived(model: torch.nn.Module) -> None:
    """What was built from the old tensors' addresses (the fused decode layers' pointers)."""
    for m in model.modules():
        if hasattr(m, "invalidate_fused_layers"):
            m.invalidate_fused_layers()


def release_weights(model: torch.nn.Module) -> int:
    """Drop the model's tensors (each replaced by an empty one of its dtype); the bytes released."""
    released, seen = 0, set()
    for m in model.modules():
        for holder, key, t in list(_tensor_slots(m)):
            if id(t) not in seen and t.numel():
                seen.add(id(t))
                released += t.numel() * t.element_size()
            empty = torch.empty(0, dtype=t.dtype, device=t.device)
            if isinstance(t, torch.nn.Parameter):
                t.data = empty           # the Parameter object stays (a tied head stays tied)
            else:
                holder[key] = empty
    _forget_derived(model)
    return released


def restore_weights(engine) -> None:
    """Load `engine`'s checkpoint again (its config, device and kernel plan) into its model's modules."""
    fresh = builder.load_models(engine.config, engine.device).model
    old_modules, new_modules = list(engine.model.modules()), list(fresh.modules())
    if len(old_modules) != len(new_modules):
        raise RuntimeError("the reloaded model has another structure than the released one")
    for old, new in zip(old_modules, new_modules):
        new_slots = {(_kind(new, holder), key): t for holder, key, t in _tensor_slots(new)}
        for holder, key, t in list(_tensor_slots(old)):
            loaded = new_slots.get((_kind(old, holder), key))
            if loaded is None:
                continue
            if isinstance(t, torch.nn.Parameter):
                t.data = loaded.data
            else:
                holder[key] = loaded
    _forget_derived(engine.model)


def _kind(module: torch.nn.Module, holder: dict) -> str:
    if holder is module._parameters:
        return "param"
    return "buffer" if holder is module._buffers else "attr"
