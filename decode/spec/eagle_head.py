"""The EAGLE head at serving time, over the paged KV cache, and the features it reads.

Contract (the plain-torch head is decode/spec/heads/eagle.py): for position j the head reads
u_j = fc(cat(E(x_j), f_{j-1})), where f is the target's last decoder layer output before the final
norm (f_{-1} = 0) and E the target's embedding; one Llama decoder layer turns u into g_j, the
head's estimate of f_j, and the target's own norm and lm_head turn g_j into next-token logits.

The head's KV is one more layer of the target's KV arena (same blocks, same slots). The engine
runs the head over every token the target computes, with the true features, so the head's KV
is right wherever the target's is: in prefix-cached blocks and in blocks handed off from a
prefill worker. Drafting then only adds positions past the verified ones (eagle.py).

`EagleFeatures` is that pass (the speculator's `after_forward`) and what it keeps: each
sequence's feature at its last computed position (`Sequence.spec_state`, a `Feature`) and the
feature at every block's last slot, for prefix-cache hits (valid only for blocks this engine
computed since the block was allocated: blocks filled by a KV transfer have none).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from cluster.engine.draft_tree import accepted_nodes
from cluster.engine.scheduler import StepPlan
from cluster.engine.sequence import Sequence
from cluster.model.llama import CausalLM, DecoderLayer, RMSNorm
from cluster.model.loader import LazyCheckpoint, TensorTaker, layer_state_dict
from cluster.model.model_config import ModelConfig
from decode.spec.compat import is_eagle3, read_eagle_config


class EagleHead(nn.Module):
    """EAGLE (`draft_vocab` 0): f is the last layer's output, logits the target's own norm and LM
    head. EAGLE-3 (decode/spec/heads/eagle3.py): f = fuse(three depths of the target's outputs),
    and the head's own norm and LM head over a draft vocabulary (`d2t`: draft id -> target id)."""

    def __init__(self, layer_cfg: ModelConfig, target: CausalLM, draft_vocab: int = 0):
        super().__init__()
        h = layer_cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(layer_cfg, None)
        self.target = [target]   # not a submodule: its weights are the target's, not the head's
        self.fuse = nn.Linear(3 * h, h, bias=False) if draft_vocab else None
        self.norm = RMSNorm(h, layer_cfg.rms_norm_eps) if draft_vocab else None
        self.lm_head = nn.Linear(h, draft_vocab, bias=False) if draft_vocab else None
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))

    @torch.inference_mode()       # like `forward`: the target's rows are inference tensors, and the
    def features(self, hidden: torch.Tensor) -> torch.Tensor:   # fused linear must not record autograd
        """f from what the target's forward returned (the hidden hook's rows)."""
        return hidden if self.fuse is None else self.fuse.forward(hidden)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, prev_features: torch.Tensor, positions: torch.Tensor,
                kv_layer: torch.Tensor, backend, meta, logits_indices: torch.Tensor | None = None):
        """Returns (g [T, H], fp32 logits of `logits_indices` rows or None); stores the head's KV."""
        target = self.target[0]
        u = self.fc.forward(torch.cat((target.embed(input_ids), prev_features), dim=-1))
        fp = target.new_pass(positions, u.dtype, backend, meta)
        g = self.layer.forward(u, fp, kv_layer[0], kv_layer[1])
        if logits_indices is None:
            return g, None
        rows = g.index_select(0, logits_indices)
        if self.lm_head is None:
            return g, target.logits(rows, fp)
        # Over the target's vocabulary, -inf outside the draft's: a draft token is a target id,
        # and a sampled draft's q is 0 where the head cannot propose.
        draft = self.lm_head.forward(fp.norm(rows, self.norm.weight, self.norm.eps)).float()
        logits = draft.new_full((len(rows), target.cfg.vocab_size), float("-inf"))
        return g, logits.index_copy_(1, self.d2t, draft)


class _Overlay:
    """A checkpoint with some tensors replaced (an online-adapted head: decode/spec/online/)."""

    def __init__(self, base: LazyCheckpoint, overrides: Mapping[str, torch.Tensor]):
        self.base, self.overrides = base, overrides

    def __contains__(self, name: str) -> bool:
        return name in self.overrides or name in self.base

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.overrides[name] if name in self.overrides else self.base[name]


def load_eagle_head(head_dir: Path, target_cfg: ModelConfig, target: CausalLM, dtype: torch.dtype,
                    device: torch.device, overrides: Mapping[str, torch.Tensor] | None = None) -> EagleHead:
    """The head of `head_dir`; `overrides`: tensors (checkpoint names) that replace the directory's."""
    raw = read_eagle_config(head_dir)
    if target_cfg.attention_scale != target_cfg.head_dim ** -0.5:
        # The head attends through the target's backend, whose softmax scale is the target's.
        raise ValueError("an EAGLE head over a target with query_pre_attn_scalar (a softmax scale other "
                         "than head_dim ** -0.5) is not supported")
    # The head's layer is a plain Llama layer, whatever the target's family.
    layer_cfg = replace(target_cfg, architecture="LlamaForCausalLM", num_layers=1,
                        intermediate_size=int(raw["intermediate_size"]), qkv_bias=False, o_bias=False,
                        mlp_bias=False, layer_windows=(None,), hidden_act="silu", qk_norm=False, norm_offset=0.0,
                        sandwich_norm=False, local_rope=None, local_layers=(), v_norm=False, layer_scalar=False,
                        kv_source_layer=(), double_wide_shared_mlp=False, per_layer_input_size=0)
    checkpoint = LazyCheckpoint(Path(head_dir))
    take = TensorTaker(_Overlay(checkpoint, overrides) if overrides else checkpoint)
    state = {"fc.weight": take("fc.weight"), **layer_state_dict(layer_cfg, take, "model.layers.0.", "layer.")}
    draft_vocab = int(raw["draft_vocab_size"]) if is_eagle3(raw) else 0
    if draft_vocab:
        state.update({name: take(name) for name in ("fuse.weight", "norm.weight", "lm_head.weight", "d2t")})
    if take.missing:
        raise ValueError(f"EAGLE head {head_dir} is missing tensors: {', '.join(take.missing)}")
    d2t = state.pop("d2t", None)
    if d2t is not None and (d2t.shape != (draft_vocab,) or int(d2t.min()) < 0 or int(d2t.max()) >= target_cfg.vocab_size):
        raise ValueError(f"EAGLE head {head_dir}: d2t must map {draft_vocab} draft ids to target ids "
                         f"(0..{target_cfg.vocab_size - 1})")
    head = EagleHead(layer_cfg, target, draft_vocab)
    state = {k: v.to(dtype) for k, v in state.items()}
    head.load_state_dict({**state, "d2t": head.d2t if d2t is None else d2t.long()}, strict=True)
    return head.to(device=device, dtype=dtype).eval()


def eagle_feature_layers(head_dir: Path) -> tuple[int, ...]:
    """The target layers whose outputs the head reads, side by side (): the last layer's alone."""
    raw = read_eagle_config(head_dir)
    return tuple(int(i) for i in raw["feature_layers"]) if is_eagle3(raw) else ()


@dataclass(frozen=True)
class Feature:
    """The target's pre-norm hidden state at position `pos` (a sequence's last computed one)."""
    hidden: torch.Tensor
    pos: int


def feature_of(seq: Sequence) -> Feature | None:
    state = seq.spec_state
    return state if isinstance(state, Feature) else None


class EagleFeatures:
    """The head's pass over every token the target computes, and the features it keeps."""

    def __init__(self, head: EagleHead, engine):
        self.head = head
        self.kv_layer = engine.kv_cache.arena[-1]      # the head's KV: the arena's last layer
        self.backend = engine.backend
        self.block_size = engine.layout.block_size
        self.device = engine.device
        self.hidden_size, self.dtype = engine.model_config.hidden_size, engine.dtype
        num_blocks = engine.pool.num_blocks
        self.block_features = torch.zeros((num_blocks, self.hidden_size), dtype=self.dtype, device=self.device)
        self.feature_valid = [False] * num_blocks   # per block: written here since the block was allocated
        self.last_rows: dict[Sequence, tuple[int, int]] = {}   # seq -> (first row, first position) of last step
        self.last_trees: dict[Sequence, tuple[tuple[int, ...], tuple[int, ...]]] = {}   # seq -> (draft, parents)
        self.last_hidden: torch.Tensor | None = None
        self.capture = None     # online adaptation's buffer (decode/spec/online/capture.py), when on

    def after_forward(self, plan: StepPlan, ids_t, pos_t, hidden: torch.Tensor, meta) -> None:
        """The head over the step's tokens with the true features: input j pairs x_j with f_{j-1}."""
        hidden = self.head.features(hidden)
        bs = self.block_size
        total = hidden.shape[0]
        carry, src, ends_rows, ends_blocks = [], [], [], []
        self.last_rows, self.last_trees = {}, {}
        offset = 0
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            self.last_rows[seq] = (offset, start)
            if start == 0:
                src.append(-1)                          # f_{-1} = 0
            else:
                src.append(total + len(carry))
                carry.append(self._feature_before(seq, start))
            if chunk.tree:
                # A token tree: each draft pairs with its parent's feature (the root's row for -1);
                # the accepted path's block-end features are kept once it is known (`keep`).
                src.extend(offset + 1 + p for p in chunk.tree)
                self.last_trees[seq] = (chunk.draft, chunk.tree)
                n = 1
            else:
                src.extend(range(offset, offset + n - 1))
            for p in range(start, start + n):
                if p % bs == bs - 1:
                    ends_rows.append(offset + p - start)
                    ends_blocks.append(seq.block_ids[p // bs])
            offset += chunk.num_tokens
        zero = hidden.new_zeros((1, hidden.shape[1]))
        table = torch.cat([hidden, *([torch.stack(carry)] if carry else []), zero])
        index = torch.tensor([len(table) - 1 if i < 0 else i for i in src], dtype=torch.long, device=self.device)
        self.head(ids_t, table.index_select(0, index), pos_t, self.kv_layer, self.backend, meta)
        for b in ends_blocks:
            self.feature_valid[b] = True
        if ends_rows:
            self.block_features.index_copy_(0, torch.tensor(ends_blocks, device=self.device),
                                            hidden.index_select(0, torch.tensor(ends_rows, device=self.device)))
        self.last_hidden = hidden

    def _feature_before(self, seq: Sequence, start: int) -> torch.Tensor:
        feature = feature_of(seq)
        if feature is not None and feature.pos == start - 1:
            return feature.hidden
        # A chunk that starts after a prefix-cache hit: the feature kept for the hit's last block.
        block = seq.block_ids[start // self.block_size - 1]
        assert start % self.block_size == 0 and self.feature_valid[block], (seq.request_id, start)
        return self.block_features[block]

    def keep(self, forks: dict[Sequence, list[Sequence]]) -> None:
        """After the scheduler's update: each sequence's feature at its last computed position;
        a prompt's last feature is its forks' too."""
        if self.last_hidden is not None:
            for seq, (row, start) in self.last_rows.items():
                # A request that ended this step gave its blocks back (its count is 0 now): every
                # position but its last token's was computed.
                computed = (seq.num_tokens - 1 if seq.is_finished else seq.num_computed_tokens) - start
                if computed <= 0:
                    continue
                rows = list(range(row, row + computed))
                if seq in self.last_trees:
                    draft, parents = self.last_trees[seq]
                    nodes = accepted_nodes(draft, parents, seq.token_ids[start + 1:start + computed])
                    rows = [row, *(row + 1 + node for node in nodes)]
                    self._keep_block_ends(seq, start, rows)
                seq.spec_state = Feature(self.last_hidden[rows[-1]].clone(), start + computed - 1)
                if self.capture is not None and self.capture.wants(seq):
                    self.capture.add(seq, start, self.last_hidden[rows])
            self.last_hidden = None
            self.last_rows, self.last_trees = {}, {}
        for parent, children in forks.items():
            for child in children:
                child.spec_state = parent.spec_state
        if self.capture is not None:
            self.capture.end_step()

    def _keep_block_ends(self, seq: Sequence, start: int, rows: list[int]) -> None:
        """A tree's accepted path: the features of the block ends it computed (rows[j] is position start + j)."""
        bs = self.block_size
        for j, r in enumerate(rows[1:], 1):
            p = start + j
            if p % bs == bs - 1:
                block = seq.block_ids[p // bs]
                self.block_features[block] = self.last_hidden[r]
                self.feature_valid[block] = True

    def invalidate(self, blocks: list[int]) -> None:
        for b in blocks:
            self.feature_valid[b] = False

    def usable_hits(self, hits: list[int]) -> list[int]:
        """The longest prefix of a cache hit whose last block has a feature."""
        n = len(hits)
        while n and not self.feature_valid[hits[n - 1]]:
            n -= 1
        return hits[:n]

    def export(self, seq: Sequence) -> bytes:
        """The prompt's last hidden state, the one piece of the head's state the blocks do not
        carry (raw bytes in the KV layout's dtype)."""
        feature = feature_of(seq)
        if feature is None:
            return b""
        return feature.hidden.cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def adopt(self, data: bytes, num_prompt_tokens: int) -> Feature:
        if len(data) != self.hidden_size * self.dtype.itemsize:
            raise ValueError(f"a handoff to an EAGLE decode worker must carry the prompt's last hidden state "
                             f"({self.hidden_size} values); got {len(data)} bytes")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return Feature(raw.view(self.dtype).to(self.device), num_prompt_tokens - 1)
