"""What a speculator loads beside the target, before the engine's memory plan, and what it adds.

Checked first (compat.py: a draft or head that cannot work is refused before it loads), then:
 - eagle: the head (eagle_head.py), on every engine that serves the layout, proposing or not: a
   prefill worker computes the head's KV too, so a handed-off request speculates at once. Its KV
   is one more layer of the arena, named in the layout's model id;
 - draft: the draft model, only on an engine that proposes; its KV and weights are planned with
   the target's (memory.py);
 - block: the block drafter (block.py), on every engine, as the EAGLE head: a prefill worker
   computes the prompt's window of features, which the handoff carries; it adds no KV;
 - quantspec: the target's own checkpoint as its draft (no second model): its linears in 4 bits
   (a GGUF model's own blocks, else int4 quantized at load), drafting over the target's own KV
   cache (quantspec.py; `--quantspec-kv-view int4` reads an int8 cache through its int4 view);
   the full-precision target verifies. Only its weights are planned beside the target's;
 - mtp: DeepSeek-V3's multi-token-prediction layer from the target's own checkpoint (mtp.py), as
   the EAGLE head: the same features pass, the same one more KV layer (a latent one);
 - ngram and off: nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.config import EngineConfig
from cluster.engine.builder import Models
from cluster.engine.speculation import SpecFootprint
from cluster.model.kernel_choice import apply_kernel_plan
from cluster.model.loader import load_model
from cluster.model.model_config import ModelConfig
from cluster.model.quant_linear import QuantLinear
from cluster.model.quantize import Quantization, gguf_source, quantize_model
from decode.spec.block import load_drafter
from decode.spec.compat import check_speculative_models
from decode.spec.eagle_head import eagle_feature_layers, load_eagle_head
from decode.spec.memory import draft_footprint
from decode.spec.mtp import load_mtp_head
from kernels.cpu_quant import QuantFormat

log = logging.getLogger(__name__)


@dataclass
class SpecModels:
    """What was loaded beside the target."""
    footprint: SpecFootprint
    eagle: torch.nn.Module | None = None         # an EagleHead
    draft_config: ModelConfig | None = None      # a draft model (draft_model.py runs it)
    draft_model: torch.nn.Module | None = None   # quantspec: the target's checkpoint, 4-bit linears
    eagle_dir: Path | None = None                # the EAGLE head's directory
    build_eagle: Callable[[dict], torch.nn.Module] | None = None   # that head with some tensors replaced
    block: torch.nn.Module | None = None         # a BlockDrafter


def load_spec_models(config: EngineConfig, target: Models, device: torch.device, proposing: bool) -> SpecModels:
    check_speculative_models(config, disaggregated=False)
    spec = config.speculative
    widest = spec.max_speculative_tokens if proposing else 0
    if spec.method == "eagle":
        head_dir = spec.eagle_dir_for(config.model)
        def build(overrides: dict | None = None) -> torch.nn.Module:
            head = load_eagle_head(head_dir, target.config, target.model, target.dtype, device, overrides)
            apply_kernel_plan(head, target.kernel_plan)
            return head
        head = build()
        footprint = SpecFootprint(extra_kv_layers=1, model_id_suffix=f"+eagle:{head_dir.name}",
                                  hidden_states=True, hidden_layers=eagle_feature_layers(head_dir),
                                  extra_bytes=_unshared_bytes(head, target.model), max_draft_tokens=widest)
        return SpecModels(footprint, eagle=head, eagle_dir=head_dir, build_eagle=build)
    if spec.method == "mtp":
        head = load_mtp_head(Path(config.model), target.config, target.model, target.dtype, device)
        apply_kernel_plan(head, target.kernel_plan)
        footprint = SpecFootprint(extra_kv_layers=1, model_id_suffix="+mtp", hidden_states=True,
                                  extra_bytes=_unshared_bytes(head, target.model), max_draft_tokens=widest)
        return SpecModels(footprint, eagle=head)
    if spec.method == "block":
        drafter_dir = spec.block_dir_for()
        drafter = load_drafter(drafter_dir, config.model, target.model, target.dtype, device)
        footprint = SpecFootprint(model_id_suffix=f"+block:{drafter_dir.name}", hidden_states=True,
                                  hidden_layers=tuple(drafter.config.feature_layers),
                                  extra_bytes=_unshared_bytes(drafter, target.model),
                                  max_draft_tokens=widest)
        return SpecModels(footprint, block=drafter)
    if spec.method in ("draft", "quantspec") and proposing:
        source = spec.draft_dir if spec.method == "draft" else config.model
        draft_config, draft = load_model(source, dtype=target.dtype, device=device, max_positions=target.max_model_len)
        if spec.method == "quantspec":
            _four_bit_draft(draft, draft_config, config)
            if draft.embed_tokens.weight.dtype == target.model.embed_tokens.weight.dtype:
                draft.embed_tokens = target.model.embed_tokens    # a lookup of one row a token: share it
        apply_kernel_plan(draft, target.kernel_plan)
        if spec.method == "quantspec":    # drafts over the target's KV: its own weights are all it adds
            footprint = SpecFootprint(extra_bytes=_unshared_bytes(draft, target.model), max_draft_tokens=widest)
        else:
            per_block, extra = draft_footprint(draft, draft_config, config, target.layout.dtype)
            footprint = SpecFootprint(bytes_per_block=per_block, extra_bytes=extra, max_draft_tokens=widest)
        return SpecModels(footprint, draft_config=draft_config, draft_model=draft)
    return SpecModels(SpecFootprint(max_draft_tokens=widest))


def _four_bit_draft(draft: torch.nn.Module, draft_config: ModelConfig, config: EngineConfig) -> None:
    """QuantSpec's draft weights: a GGUF model's own 4-bit blocks where it has them, else int4, on
    int8 activations; the LM head in 8 bits (Q8_0: the GGUF's own, or quantized at load). Measured
    on the default model (docs/quantization.md): a 4-bit head took the draft's acceptance from 0.93
    to 0.81 and quantspec from 1.59x to 1.46x plain decoding; int8 activations cost 0.05 of the
    acceptance and made it 1.11x faster. The draft's precision only moves its acceptance, never the
    output: the target verifies."""
    scheme = Quantization.GGUF if gguf_source(config.model) is not None else Quantization.INT4
    if config.quantization != "none":
        log.warning("--speculative quantspec drafts with 4-bit weights, and the target already serves "
                    "--quantization %s: the draft saves little over the target", config.quantization)
    float_head = draft.lm_head
    try:
        quantize_model(draft, draft_config, scheme, config.model, act_int8=True)
    except ValueError as exc:   # a GGUF whose fused projections mix block types: quantize at load
        if scheme is not Quantization.GGUF:
            raise
        log.info("quantspec draft: %s; int4 at load instead", exc)
        quantize_model(draft, draft_config, Quantization.INT4, config.model, act_int8=True)
    if draft.lm_head.qweight.format is not QuantFormat.Q8_0:
        draft.lm_head = QuantLinear.from_linear(float_head, QuantFormat.Q8_0)


def _unshared_bytes(draft: torch.nn.Module, target: torch.nn.Module) -> int:
    """The draft's resident bytes less the tensors it shares with the target."""
    shared = {id(t) for t in [*target.parameters(), *target.buffers()]}
    return sum(t.numel() * t.element_size() for t in [*draft.parameters(), *draft.buffers()]
               if id(t) not in shared)
