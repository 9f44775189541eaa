"""Mixture-of-experts layers: the stacked experts (`MoEExperts`), the routers, and the sparse MLP
block of Qwen2-MoE, Qwen3-MoE and Mixtral (`SparseMoeBlock`).

`MoEExperts` is the expert compute every MoE family calls (DeepSeek's layers too, with their own
router): forward(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H], SiLU-gated
experts stacked as gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I]. How it
computes is its `path` (MoEPath), set from the kernel plan (`apply_moe_path`): the torch reference
grouped by expert, the same with a batch-invariant GEMM (deterministic mode), the C kernel
(kernels/cpu_moe.py) or the Triton fused kernel (kernels/fused_moe.py, CUDA). It also counts the
tokens each expert received (`tokens`), which the worker exports as expert load.
"""
from __future__ import annotations

import enum
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.kernel_plan import KernelPlan
from cluster.model.moe_config import MoEConfig, Routing
from kernels import cpu_moe, cpu_ops
from kernels.moe_reference import fused_moe_reference


class MoEPath(str, enum.Enum):
    REFERENCE = "reference"     # torch, grouped by expert (F.linear per expert)
    INVARIANT = "invariant"     # the same, each GEMM batch-invariant (deterministic mode)
    FUSED_C = "fused_c"         # one C call per layer (kernels/cpu_moe.py)
    TRITON = "triton"           # one fused Triton kernel per projection (kernels/fused_moe.py, CUDA)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's routing: softmax over all experts in float32, the top k, renormalized to sum to 1
    where `renormalize` (norm_topk_prob); weights in the logits' dtype. Returns (ids, weights)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


def mixtral_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's routing: softmax in float32, the top k renormalized, weights kept in float32."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights /= weights.sum(dim=-1, keepdim=True)
    return ids, weights


def route(cfg: MoEConfig, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.routing is Routing.MIXTRAL:
        return mixtral_topk(router_logits, cfg.top_k)
    return softmax_topk(router_logits, cfg.top_k, cfg.norm_topk_prob)


class MoEExperts(nn.Module):
    """E SiLU-gated experts of hidden size H and intermediate size I, stacked."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, layer: int = 0):
        super().__init__()
        self.num_experts = num_experts
        self.layer = layer   # the decoder layer it belongs to (expert-load labels)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Tokens routed to each expert since the last read (a token counts once per chosen expert),
        # on the device of the ids (made at the first pass: the model is built on the meta device).
        self.tokens: torch.Tensor | None = None
        self.path = MoEPath.REFERENCE

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        flat = topk_ids.reshape(-1)
        if self.tokens is None or self.tokens.device != flat.device:
            self.tokens = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        # index_add_, not bincount: no host sync (bincount sizes its output from the data), so a
        # CUDA graph can hold it.
        self.tokens.index_add_(0, flat, torch.ones_like(flat))
        if hidden.shape[0] == 0:
            return torch.zeros_like(hidden)
        return moe_compute(self.path, hidden.device)(hidden, self.gate_up, self.down, topk_ids, topk_weights)

    def token_counts(self) -> list[int]:
        """Tokens routed to each expert since the model was built (a counter: never reset)."""
        return [0] * self.num_experts if self.tokens is None else self.tokens.tolist()


def moe_compute(path: MoEPath, device: torch.device):
    """The function of the fused-MoE signature (kernels/moe_reference.py) that `path` names."""
    if path is MoEPath.FUSED_C:
        return cpu_moe.fused_moe
    if path is MoEPath.INVARIANT and device.type == "cpu":   # the one-call C kernel is batch-invariant too
        return cpu_moe.fused_moe_invariant if cpu_ops.has_moe_experts() else _invariant_cpu
    if path in (MoEPath.TRITON, MoEPath.INVARIANT):   # the Triton kernel is batch-invariant as it stands
        from kernels.fused_moe import fused_moe  # noqa: PLC0415 - Triton is optional: CUDA only
        return fused_moe
    return fused_moe_reference


def _invariant_cpu(hidden, gate_up, down, topk_ids, topk_weights):
    return fused_moe_reference(hidden, gate_up, down, topk_ids, topk_weights, linear=cpu_ops.linear)


class DenseExpert(nn.Module):
    """An always-on SiLU-gated MLP beside the routed experts (Qwen2-MoE's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fp) -> torch.Tensor:
        return self.down_proj.forward(fp.silu_mul(self.gate_up_proj.forward(x)))


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: router, routed experts, and (Qwen2-MoE) the gated shared expert.
    Called as the dense MLP is: forward(x [T, H], fp) -> [T, H]."""

    geglu = False   # what fused_layer reads of an MLP: the experts are SiLU-gated

    def __init__(self, moe: MoEConfig, hidden_size: int, layer: int):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)   # the router
        self.experts = MoEExperts(moe.num_experts, hidden_size, moe.expert_intermediate_size, layer)
        self.shared_expert = None
        self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = DenseExpert(hidden_size, moe.shared_expert_intermediate_size)
        if moe.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, fp) -> torch.Tensor:
        ids, weights = route(self.moe, self.gate.forward(x))
        out = self.experts.forward(x, ids, weights)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert.forward(x, fp)
        if self.shared_expert_gate is not None:
            shared = F.sigmoid(self.shared_expert_gate.forward(x)) * shared
        return out + shared


def expert_modules(model: nn.Module) -> list[MoEExperts]:
    return [m for m in model.modules() if isinstance(m, MoEExperts)]


def expert_token_counts(model: nn.Module) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(layer, tokens per expert) for each expert stack of the model; () for a dense model."""
    return tuple((m.layer, tuple(m.token_counts())) for m in expert_modules(model))


def moe_path_for(plan: KernelPlan, device_type: str) -> MoEPath:
    """The expert compute that goes with a kernel plan: batch-invariant GEMMs in the deterministic
    mode; Triton on CUDA where it is installed; the C kernel where the plan runs the C ops."""
    if plan.batch_invariant:
        return MoEPath.INVARIANT
    if device_type == "cuda":
        return MoEPath.TRITON if importlib.util.find_spec("triton") is not None else MoEPath.REFERENCE
    return MoEPath.FUSED_C if plan.uses_c_ops() else MoEPath.REFERENCE


def apply_moe_path(model: nn.Module, path: MoEPath) -> int:
    """Set every expert stack's compute path; returns how many were set."""
    stacks = expert_modules(model)
    for m in stacks:
        m.path = path
    return len(stacks)
