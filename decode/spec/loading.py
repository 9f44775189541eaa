"""What a speculator loads beside the target, before the engine's memory plan, and what it adds.

Checked first (compat.py: a draft or head that cannot work is refused before it loads), then:
 - eagle: the head (eagle_head.py), on every engine that serves the layout, proposing or not: a
   prefill worker computes the head's KV too, so a handed-off request speculates at once. Its KV
   is one more layer of the arena, named in the layout's model id;
 - draft: the draft model, only on an engine that proposes; its KV and weights are planned with
   the target's (memory.py);
 - ngram and off: nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.config import EngineConfig
from cluster.engine.builder import Models
from cluster.engine.speculation import SpecFootprint
from cluster.model.kernel_choice import apply_kernel_plan
from cluster.model.loader import load_model
from cluster.model.model_config import ModelConfig
from decode.spec.compat import check_speculative_models
from decode.spec.memory import draft_footprint


@dataclass
class SpecModels:
    """What was loaded beside the target."""
    footprint: SpecFootprint
    eagle: torch.nn.Module | None = None         # an EagleHead
    draft_config: ModelConfig | None = None      # a draft model (draft_model.py runs it)
    draft_model: torch.nn.Module | None = None


def load_spec_models(config: EngineConfig, target: Models, device: torch.device, proposing: bool) -> SpecModels:
    check_speculative_models(config, disaggregated=False)
    spec = config.speculative
    widest = spec.max_speculative_tokens if proposing else 0
    if spec.method == "eagle":
        from decode.spec.eagle_head import load_eagle_head  # noqa: PLC0415
        head = load_eagle_head(spec.eagle_dir, target.config, target.model, target.dtype, device)
        apply_kernel_plan(head, target.kernel_plan)
        footprint = SpecFootprint(extra_kv_layers=1, model_id_suffix=f"+eagle:{spec.eagle_dir.name}",
                                  hidden_states=True, max_draft_tokens=widest)
        return SpecModels(footprint, eagle=head)
    if spec.method == "draft" and proposing:
        draft_config, draft = load_model(spec.draft_dir, dtype=target.dtype, device=device,
                                         max_positions=target.max_model_len)
        apply_kernel_plan(draft, target.kernel_plan)
        per_block, extra = draft_footprint(draft, draft_config, config, target.layout.dtype)
        footprint = SpecFootprint(bytes_per_block=per_block, extra_bytes=extra, max_draft_tokens=widest)
        return SpecModels(footprint, draft_config=draft_config, draft_model=draft)
    return SpecModels(SpecFootprint(max_draft_tokens=widest))
