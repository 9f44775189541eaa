"""The block proposer (`--speculative block`): a DFlash-style drafter proposes k tokens in one pass.

The drafter (decode/spec/heads/block.py, run here as is) reads a window of the target's fused
features at the last `context` verified positions and the pending token, and drafts the block's
rows together: one forward pass for the whole draft, where EAGLE runs one per token.

`BlockFeatures` is the speculator's pass over every step (`after_forward`, then `keep` once the
scheduler knows what was accepted): each sequence's window (`Sequence.spec_state`, a
`ContextWindow`) gets the fused features of the positions this step computed and kept. The
drafter keeps no KV, so nothing rides in the blocks: a prefix hit starts a window from the
positions the engine computes after it (at least the prompt's last), and a handoff carries the
window (at most `context` rows, the layout's dtype) in the `KVHandle`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.config import SpeculativeConfig
from cluster.engine.draft_tree import accepted_nodes
from cluster.engine.scheduler import StepPlan
from cluster.engine.sequence import Sequence
from cluster.engine.speculation import Draft
from cluster.model.llama import CausalLM
from cluster.model.loader import LazyCheckpoint
from decode.spec.heads.block import BlockDrafter, load_block_drafter


@dataclass(frozen=True)
class ContextWindow:
    """The fused target features of positions pos - len(rows) + 1 .. pos."""
    rows: torch.Tensor
    pos: int


def window_of(seq: Sequence) -> ContextWindow | None:
    state = seq.spec_state
    return state if isinstance(state, ContextWindow) else None


def load_drafter(drafter_dir: Path, model_dir: Path, target: CausalLM, dtype: torch.dtype,
                 device: torch.device) -> BlockDrafter:
    """The drafter in the target's dtype, with the rows of the target's LM head for its draft
    vocabulary read from the checkpoint (the served head may be packed or quantized): a copy of
    1/6 of the head here, its `draft_head`."""
    drafter = load_block_drafter(str(drafter_dir), dtype)
    checkpoint = LazyCheckpoint(Path(model_dir))
    name = "lm_head.weight" if "lm_head.weight" in checkpoint else "model.embed_tokens.weight"   # tied
    rows = checkpoint[name][drafter.d2t]
    drafter.draft_head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False)
    with torch.no_grad():
        drafter.draft_head.weight.copy_(rows)
    drafter.target = [target]      # not a submodule: the target's own norm and embeddings
    return drafter.to(device=device, dtype=dtype).eval()


class BlockFeatures:
    """The drafter's context windows, updated after every step with the rows the step kept."""

    def __init__(self, drafter: BlockDrafter, engine):
        self.drafter = drafter
        self.context = drafter.config.context
        self.hidden_size = engine.model_config.hidden_size
        self.dtype, self.device = engine.dtype, engine.device
        self._chunks: list = []
        self._hidden: torch.Tensor | None = None

    def after_forward(self, plan: StepPlan, ids_t, pos_t, hidden: torch.Tensor, meta) -> None:
        offset, self._chunks = 0, []
        for chunk in plan.chunks:
            self._chunks.append((chunk, offset))
            offset += chunk.num_tokens
        self._hidden = hidden

    def keep(self, forks: dict[Sequence, list[Sequence]]) -> None:
        """After the scheduler's update: the rows of positions each sequence kept, fused in one
        pass for the whole step, appended to its window (or starting it)."""
        if self._hidden is not None:
            picked, owners = [], []
            for chunk, row in self._chunks:
                rows, last = self._kept_rows(chunk, row)
                if rows:
                    picked.extend(rows)
                    owners.append((chunk, len(rows), last))
            if picked:
                with torch.inference_mode():
                    fused = self.drafter.fused(self._hidden.index_select(
                        0, torch.tensor(picked, device=self._hidden.device)).to(self.dtype))
                at = 0
                for chunk, n, last in owners:
                    self._extend(chunk.seq, chunk.start, fused[at:at + n], last)
                    at += n
            self._hidden, self._chunks = None, []
        for parent, children in forks.items():
            for child in children:
                child.spec_state = parent.spec_state

    def _kept_rows(self, chunk, row: int) -> tuple[list[int], int]:
        """The step's rows of the positions `chunk.seq` kept (its last `context`), and the last one's position."""
        seq, start = chunk.seq, chunk.start
        # A request that ended this step gave its blocks back (its count is 0 now): every
        # position but its last token's was computed.
        computed = (seq.num_tokens - 1 if seq.is_finished else seq.num_computed_tokens) - start
        if computed <= 0:
            return [], -1
        if chunk.tree:
            nodes = accepted_nodes(chunk.draft, chunk.tree, seq.token_ids[start + 1:start + computed])
            rows = [row, *(row + 1 + node for node in nodes)]
        else:
            rows = list(range(row, row + computed))
        return rows[-self.context:], start + computed - 1

    def _extend(self, seq: Sequence, start: int, rows: torch.Tensor, last: int) -> None:
        old = window_of(seq)
        if old is not None and old.pos == start - 1 and len(rows) < self.context:
            rows = torch.cat([old.rows, rows])[-self.context:]
        seq.spec_state = ContextWindow(rows.clone(), last)

    # Nothing of the drafter lives in the blocks: every prefix hit is usable.
    def usable_hits(self, hits: list[int]) -> list[int]:
        return hits

    def invalidate(self, blocks: list[int]) -> None:
        pass

    def export(self, seq: Sequence) -> bytes:
        """The prompt's window (raw rows in the layout's dtype) for a handoff."""
        window = window_of(seq)
        if window is None:
            return b""
        return window.rows.cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def adopt(self, data: bytes, num_prompt_tokens: int) -> ContextWindow:
        row = self.hidden_size * self.dtype.itemsize
        if not data or len(data) % row or len(data) // row > self.context:
            raise ValueError(f"a handoff to a block-drafting decode worker must carry 1 to {self.context} rows of "
                             f"the prompt's fused features ({row} bytes each); got {len(data)} bytes")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = raw.view(self.dtype).view(-1, self.hidden_size).to(self.device)
        return ContextWindow(rows, num_prompt_tokens - 1)


class BlockProposer:
    """One drafter pass for every ready sequence of the step; each takes its first k rows."""
    method = "block"

    def __init__(self, engine, config: SpeculativeConfig, drafter: BlockDrafter):
        self.engine = engine
        self.config = config
        self.drafter = drafter
        self.block_size = drafter.config.block_size

    def propose(self, seqs: list[Sequence], ks: list[int], stop_rules: list) -> list[Draft]:
        ready = [i for i, s in enumerate(seqs) if ks[i] > 0 and (w := window_of(s)) is not None
                 and w.pos == s.num_computed_tokens - 1]
        drafts = [Draft(()) for _ in seqs]
        if not ready:
            return drafts
        k = min(self.block_size, max(ks[i] for i in ready))
        tokens, confidence = self._draft([seqs[i] for i in ready], k)
        for j, i in enumerate(ready):
            n = min(ks[i], k)
            drafts[i] = Draft(tuple(tokens[j][:n]), confidences=tuple(confidence[j][:n]))
        return drafts

    @torch.inference_mode()
    def _draft(self, seqs: list[Sequence], k: int) -> tuple[list[list[int]], list[list[float]]]:
        drafter, device = self.drafter, self.engine.device
        C = drafter.config.context
        windows = [window_of(s) for s in seqs]
        ctx = windows[0].rows.new_zeros((len(seqs), C, windows[0].rows.shape[-1]))
        for b, w in enumerate(windows):
            ctx[b, C - len(w.rows):] = w.rows
        first = torch.tensor([s.token_ids[-1] for s in seqs], device=device)
        ctx_len = torch.tensor([len(w.rows) for w in windows], device=device)
        pos = torch.tensor([s.num_tokens - 1 for s in seqs], device=device)
        target = drafter.target[0]
        g = drafter(target.embed, first, ctx, ctx_len, pos)[:, :k]
        fp = target.new_pass(pos, g.dtype, None, None)   # for its final norm only
        logits = drafter.draft_head(target.final_norm(g.reshape(-1, g.shape[-1]), fp))
        probs = torch.softmax(logits.float(), dim=-1).view(len(seqs), k, -1)
        top, index = probs.max(dim=-1)
        return drafter.d2t[index].tolist(), top.tolist()

    def release(self, seq: Sequence) -> None:
        pass
