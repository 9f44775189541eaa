"""The engine's speculator: loads what runs beside the target, picks the proposer per request,
sizes each draft, verifies.

It implements the engine's `Speculator` protocol (cluster/engine/speculation.py): what loads
beside the target (loading.py), the EAGLE head's pass over the target's hidden states and its
features (eagle_head.py), and the per-step policy below. Proposers:
 - `ngram`: prompt lookup, model-free, always available;
 - `draft`: a small model of the same tokenizer with its own paged KV (draft_model.py);
 - `quantspec`: the target's checkpoint in 4 bits over the target's own KV (quantspec.py);
 - `eagle`: a head over the target's last hidden states whose KV shares the target's blocks
   (eagle.py);
 - `block`: a DFlash-style drafter that proposes the whole draft in one pass from a window of the
   target's features (block.py).
Verification keeps the target's output distribution: greedy requests accept the longest prefix
equal to the target's argmax; sampled requests use the p/q rejection rule (acceptance.py).

`make_speculator` is the factory decode workers and `splitserve generate` give their engine;
`make_kv_only_speculator` the prefill workers': it never proposes, but with an EAGLE head it
still computes the head's KV and the prompt's last hidden state that a handoff carries.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from cluster.config import AUTO, EngineConfig, SpeculativeConfig
from cluster.engine.builder import Models
from cluster.engine.draft_tree import accepted_nodes, depths
from cluster.engine.sampler import apply_repetition_penalty, warp_probs
from cluster.engine.scheduler import StepPlan
from cluster.engine.sequence import Sequence
from cluster.engine.speculation import Draft, SpecFootprint
from cluster.types import SamplingParams
from decode.spec.acceptance import accept_greedy, accept_greedy_tree, accept_sampled
from decode.spec.block import BlockFeatures, BlockProposer
from decode.spec.compat import weights_fingerprint
from decode.spec.draft_model import DraftModelProposer
from decode.spec.eagle import EagleProposer
from decode.spec.eagle_head import EagleFeatures
from decode.spec.jacobi import JacobiProposer
from decode.spec.loading import SpecModels, load_spec_models
from decode.spec.lookahead import Calibration, Lookahead, StopRule
from decode.spec.ngram import NgramProposer
from decode.spec.online.capture import OnlineCapture
from decode.spec.online.heads import HeadVariants
from decode.spec.online.messages import TRAINABLE, TRAINABLE_EAGLE3, AcceptanceCount
from decode.spec.quantspec import QuantSpecProposer
from decode.spec.step_policy import StepLookahead, StepSetting


MODEL_FREE = ("ngram", "jacobi")   # drafting costs next to nothing: no draft time to measure
TREE_METHODS = ("ngram", "quantspec", "eagle")   # proposers that grow token trees (propose_tree)


class NgramDrafts:
    """Adapts `NgramProposer` (token lists) to the batch interface the other proposers share."""
    method = "ngram"

    def __init__(self, config: SpeculativeConfig):
        self.proposer = NgramProposer(config.ngram_min, config.ngram_max)

    def propose(self, seqs: list[Sequence], ks: list[int], stop_rules: list) -> list[Draft]:
        return [Draft(tuple(self.proposer.propose(s.token_ids, k))) for s, k in zip(seqs, ks)]

    def propose_tree(self, seqs: list[Sequence], ks: list[int], stop_rules: list, sizes: list[int], budget: int,
                     min_gain: float) -> list[Draft]:
        """Trees of the other earlier occurrences' continuations (ngram.py), the step's leaves
        shared in batch order (n-gram drafts carry no probabilities to rank them by)."""
        out = []
        for seq, k, size in zip(seqs, ks, sizes):
            if size <= k:    # no room past the chain: this request gets a chain (sampled, or no budget left)
                out.append(Draft(tuple(self.proposer.propose(seq.token_ids, k))))
                continue
            tokens, parents = self.proposer.propose_tree(seq.token_ids, k, min(size, k + budget))
            chain = max(depths(tuple(parents)), default=0)
            budget -= len(tokens) - chain
            out.append(Draft(tuple(tokens), parents=tuple(parents) if len(tokens) > chain else ()))
        return out

    def release(self, seq: Sequence) -> None:
        pass


class SpecDecoder:
    def __init__(self, engine_config: EngineConfig, proposing: bool = True):
        self.engine_config = engine_config
        self.config = config = engine_config.speculative
        self.proposing = proposing      # False: a prefill worker's, which only computes what a handoff carries
        self.default_method = config.method
        self.proposers: dict = {}
        self.models: SpecModels | None = None
        self.features = None            # an EagleFeatures, with an EAGLE head
        self.capture = None             # online adaptation (--spec-online): an OnlineCapture
        self.heads = None               # ... and the tenants' head versions (HeadVariants)
        self.online_counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])   # (tenant, version) -> steps, accepted
        self._lookahead: dict[Sequence, Lookahead] = {}
        self._method: dict[Sequence, str] = {}
        self.counts = defaultdict(lambda: {"drafted": 0, "accepted": 0, "steps": 0, "emitted": 0,
                                           "drafted_at": [], "accepted_at": [], "tree_drafted": 0,
                                           "tree_accepted": 0})
        # Dynamic lookahead's cost ratio per method: draft step / target step, measured (EMA).
        self.tau = {"ngram": config.ngram_cost, "jacobi": config.ngram_cost, "draft": config.draft_cost_prior,
                    "eagle": config.draft_cost_prior, "quantspec": config.draft_cost_prior,
                    "block": config.draft_cost_prior, "mtp": config.draft_cost_prior}
        self._t_draft: dict[str, float] = {}
        self._t_target: float | None = None
        self._proposed_at: float | None = None
        self.calibration = defaultdict(Calibration)
        self.max_k = config.max_speculative_tokens
        self.step_policy = StepLookahead(config.max_speculative_tokens, tree_leaves=config.spec_tree_budget)
        # Greedy requests on the server's fixed k: that k (and tree budget) or plain decoding,
        # measured, from 2 decodes a step on. Not in the deterministic mode: drafting follows the
        # configuration there, not timings (docs/determinism.md).
        k = config.num_speculative_tokens
        measured = config.spec_fixed_k_policy and k != AUTO and not engine_config.deterministic
        self.fixed_policy = None if not measured else StepLookahead(
            config.max_speculative_tokens, fixed=StepSetting(k, config.spec_tree_budget))
        self._step_extra = 0        # accepted draft tokens of the current step
        self._chain: dict[Sequence, int] = {}   # this step's chain length where a tree may grow past it
        self._trees = False         # token trees: a budget, a proposer that grows them, a backend that verifies them
        self._step_leaves = 0       # this step's tree leaves, all sequences together

    # --- building ---------------------------------------------------------------------------
    def load(self, target: Models, device: torch.device) -> SpecFootprint:
        self.models = load_spec_models(self.engine_config, target, device, self.proposing)
        return self.models.footprint

    def attach(self, engine) -> None:
        loaded = self.models
        if loaded.eagle is not None:
            self.features = EagleFeatures(loaded.eagle, engine)
        if loaded.block is not None:
            self.features = BlockFeatures(loaded.block, engine)
        if not self.proposing:
            return
        if loaded.eagle is not None and self.config.spec_online:
            self._attach_online(loaded)
        self._trees = self.config.spec_tree_budget > 0 and engine.backend.verifies_trees
        self.proposers["ngram"] = NgramDrafts(self.config)
        self.proposers["jacobi"] = JacobiProposer(self.config)
        if loaded.draft_model is not None and self.config.method == "quantspec":
            self.proposers["quantspec"] = QuantSpecProposer(engine, self.config, loaded.draft_config,
                                                            loaded.draft_model)
        elif loaded.draft_model is not None:
            self.proposers["draft"] = DraftModelProposer(engine, self.config, loaded.draft_config, loaded.draft_model)
        elif loaded.eagle is not None:   # an EAGLE head, or the MTP layer in its place (mtp.py)
            self.proposers[self.config.method] = EagleProposer(engine, self.config, loaded.eagle, self.heads)
        elif loaded.block is not None:
            self.proposers["block"] = BlockProposer(engine, self.config, loaded.block)

    def _attach_online(self, loaded: SpecModels) -> None:
        """Online adaptation (decode/spec/online/): capture served traffic, serve per-tenant versions."""
        trainable = TRAINABLE_EAGLE3 if loaded.eagle.lm_head is not None else TRAINABLE
        self.capture = OnlineCapture(self.config)
        self.features.capture = self.capture
        self.heads = HeadVariants(loaded.eagle, loaded.build_eagle, trainable,
                                  weights_fingerprint(self.engine_config.model), loaded.eagle_dir.name)

    # --- around the forward pass, and the handoff (the EAGLE head's features) ----------------
    def after_forward(self, plan: StepPlan, input_ids, positions, hidden: torch.Tensor, meta) -> None:
        self.features.after_forward(plan, input_ids, positions, hidden, meta)

    def after_update(self, forks: dict[Sequence, list[Sequence]]) -> None:
        if self.features is not None:
            self.features.keep(forks)
        for policy in (self.step_policy, self.fixed_policy):   # the one that timed this step, if any
            if policy is not None:
                policy.observe(self._step_extra)
        self._step_extra = 0

    def usable_hits(self, hits: list[int]) -> list[int]:
        return hits if self.features is None else self.features.usable_hits(hits)

    def invalidate(self, blocks: list[int]) -> None:
        if self.features is not None:
            self.features.invalidate(blocks)

    def export_state(self, seq: Sequence) -> bytes:
        return b"" if self.features is None else self.features.export(seq)

    def import_state(self, data: bytes, num_prompt_tokens: int) -> object:
        return None if self.features is None else self.features.adopt(data, num_prompt_tokens)

    # --- per request ----------------------------------------------------------------------
    def check_request(self, sp: SamplingParams) -> None:
        method = sp.speculative
        if not self.proposing:
            if method not in (None, "off"):
                raise ValueError(f"speculative={method!r} was asked for, but this engine does not propose "
                                 "(a prefill worker's): speculation is the decode worker's")
            return
        if method not in (None, "off") and method not in self.proposers:
            raise ValueError(f"speculative={method!r} is not loaded on this engine (it serves "
                             f"{', '.join(sorted(self.proposers))}); set it in the cluster config")
        k = sp.num_speculative_tokens
        if isinstance(k, int) and k > self.config.max_speculative_tokens:
            raise ValueError(f"num_speculative_tokens {k} exceeds the server's maximum of "
                             f"{self.config.max_speculative_tokens}")

    def _state(self, seq: Sequence) -> tuple[str, Lookahead]:
        look = self._lookahead.get(seq)
        if look is None:
            sp = seq.sampling
            method = self.default_method if sp.speculative is None else sp.speculative
            own = sp.num_speculative_tokens is not None
            k = sp.num_speculative_tokens if own else self.config.num_speculative_tokens
            k_max = self.config.max_speculative_tokens
            look = Lookahead(1 if k == AUTO else k, k_max, k == AUTO, server_k=not own and k != AUTO and sp.greedy)
            self._lookahead[seq] = look
            self._method[seq] = method
        return self._method[seq], look

    # --- the engine's protocol --------------------------------------------------------------
    def lookaheads(self, plan: StepPlan) -> list[int]:
        """Per decode of the plan: its own k (fixed, or dynamic from its acceptance), within the
        step's cap for dynamic ones (step_policy.py: measured at this batch size), and the
        server's fixed k of greedy requests on or off as measured; plus room for token-tree leaves
        where a tree may grow (the chain's length is kept for `propose`)."""
        if not self.proposing:
            return [0] * len(plan.decodes)
        states = [self._state(c.seq) for c in plan.decodes]
        policy, step = self._step_setting(plan, states)
        self._step_extra = 0
        self._chain.clear()
        self._step_leaves = step.leaves
        out = []
        for chunk, (method, look) in zip(plan.decodes, states):
            governed = look.dynamic or (look.server_k and policy is self.fixed_policy)
            if method == "off":
                k = 0
            elif look.dynamic:
                k = min(look.next_k(self.tau[method]), step.cap)
            else:
                k = (look.k if step.cap else 0) if governed else min(look.k, self.max_k)
            leaves = step.leaves if governed else self.config.spec_tree_budget
            if k and leaves and self._trees and method in TREE_METHODS and _tree_ok(chunk.seq.sampling):
                self._chain[chunk.seq] = k
                k += min(k, leaves)
            out.append(k)
        return out

    def _step_setting(self, plan: StepPlan, states: list) -> tuple[StepLookahead | None, StepSetting]:
        """The step's setting and the policy that chose (and times) it: `auto` requests' if the
        step has any, else that of greedy requests on the server's fixed k (at batch 1 its rows are
        nearly free and it drafts as configured); None: all as asked."""
        batch, measured = len(plan.decodes), not plan.prefills
        if any(look.dynamic and method != "off" for method, look in states):
            return self.step_policy, self.step_policy.choose(batch, measured)
        if self.fixed_policy is not None and batch > 1 and any(look.server_k and method != "off"
                                                               for method, look in states):
            return self.fixed_policy, self.fixed_policy.choose(batch, measured)
        return None, StepSetting(self.max_k, self.config.spec_tree_budget)   # fixed-k requests: as configured

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        by_method: dict[str, list[int]] = defaultdict(list)
        for i, seq in enumerate(seqs):
            by_method[self._method[seq]].append(i)
        drafts: list[Draft] = [Draft(())] * len(seqs)
        for method, idx in by_method.items():
            group = [seqs[i] for i in idx]
            rule = StopRule(self.tau[method], self.calibration[method].factor)
            stop_rules = [rule if self._lookahead[s].dynamic else None for s in group]
            sizes = [ks[i] for i in idx]
            chains = [min(self._chain.get(s, n), n) for s, n in zip(group, sizes)]
            t0 = time.perf_counter()
            if chains != sizes:
                out = self.proposers[method].propose_tree(group, chains, stop_rules, sizes, self._step_leaves,
                                                          self.config.spec_tree_min_gain)
            else:
                out = self.proposers[method].propose(group, sizes, stop_rules)
            if method not in MODEL_FREE:
                passes = max(max(depths(d.parents)) if d.parents else len(d) for d in out)   # a tree's longest path
                self._observe_draft_cost(method, (time.perf_counter() - t0) / max(1, passes))
            for i, d in zip(idx, out):
                drafts[i] = d
        self._proposed_at = time.perf_counter()
        return drafts

    def _observe_draft_cost(self, method: str, seconds: float) -> None:
        old = self._t_draft.get(method)
        self._t_draft[method] = seconds if old is None else 0.9 * old + 0.1 * seconds
        if self._t_target:
            self.tau[method] = min(0.9, self._t_draft[method] / self._t_target)

    def verify(self, seq: Sequence, logits: torch.Tensor, draft: Draft) -> list[int]:
        if self._proposed_at is not None:   # the first verification of a step: time the target's pass
            seconds = time.perf_counter() - self._proposed_at
            self._t_target = seconds if self._t_target is None else 0.9 * self._t_target + 0.1 * seconds
            self._proposed_at = None
        sp = seq.sampling
        if draft.parents:   # a token tree: grown for greedy requests only
            if not _tree_ok(sp):
                raise ValueError(f"a token tree was drafted for {seq.request_id}, whose sampling needs a chain")
            tokens = accept_greedy_tree(logits, draft.tokens, draft.parents)
        elif sp.greedy and sp.repetition_penalty == 1.0:
            tokens = accept_greedy(logits, list(draft.tokens))
        else:
            rows = logits
            if sp.repetition_penalty != 1.0:
                history = seq.token_ids
                rows = torch.stack([apply_repetition_penalty(logits[i], [*history, *draft.tokens[:i]],
                                                             sp.repetition_penalty) for i in range(len(logits))])
            if sp.greedy:
                tokens = accept_greedy(rows, list(draft.tokens))
            else:
                target = torch.stack([warp_probs(r, sp) for r in rows])
                proposal = draft.probs
                if proposal is None:
                    proposal = _one_hot(draft.tokens, target.shape[-1], target.device)
                tokens = accept_sampled(target, proposal, list(draft.tokens), seq.generator)
        method, look = self._state(seq)
        accepted = len(tokens) - 1
        proposed = max(depths(draft.parents)) if draft.parents else len(draft)   # a tree's longest path
        if method == "jacobi":
            self.proposers["jacobi"].observe(seq, seq.token_ids, draft.tokens, logits.argmax(-1).tolist(), len(tokens))
        self._step_extra += accepted
        look.after_verify(proposed, accepted)
        if look.dynamic and draft.confidences:
            self.calibration[method].observe(draft.confidences, accepted)
        if method == "eagle" and self.heads is not None and self.capture.wants(seq):
            counted = self.online_counts[(seq.tenant, self.heads.version_of(seq.tenant))]
            counted[0] += 1
            counted[1] += accepted
        c = self.counts[method]
        c["drafted"] += len(draft)
        c["accepted"] += accepted
        c["steps"] += 1
        c["emitted"] += len(tokens)
        if draft.parents:   # leaves follow the chain (decode/spec/tree.py): nodes past it
            c["tree_drafted"] += len(draft) - proposed
            nodes = accepted_nodes(draft.tokens, draft.parents, tokens[:-1])
            c["tree_accepted"] += sum(1 for n in nodes if n >= proposed)
        for at, n in (("drafted_at", proposed), ("accepted_at", accepted)):
            counts = c[at]
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1
        return tokens

    def release(self, seq: Sequence) -> None:
        self._lookahead.pop(seq, None)
        self._method.pop(seq, None)
        for proposer in self.proposers.values():
            proposer.release(seq)
        if self.capture is not None:
            self.capture.release(seq)

    def take_online(self) -> tuple[tuple, tuple]:
        """Online adaptation: the samples and acceptance counts since the last take (engine thread)."""
        counts = tuple(AcceptanceCount(t, v, steps, acc) for (t, v), (steps, acc) in self.online_counts.items())
        self.online_counts.clear()
        return self.capture.take(), counts

    def stats(self) -> dict:
        return {m: {k: tuple(v) if isinstance(v, list) else v for k, v in c.items()}
                for m, c in self.counts.items()}


def _tree_ok(sp: SamplingParams) -> bool:
    """Token trees are verified by the greedy rule (acceptance.accept_greedy_tree)."""
    return sp.greedy and sp.repetition_penalty == 1.0


def _one_hot(tokens: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """A deterministic proposer's distributions, on the device of the target's (they are subtracted)."""
    q = torch.zeros(len(tokens), vocab, device=device)
    q[torch.arange(len(tokens), device=device), torch.tensor(tokens, device=device)] = 1.0
    return q


def make_speculator(config: EngineConfig) -> SpecDecoder:
    """The factory `LLMEngine(config, speculator_factory=...)` takes. With the method "off" the
    engine still serves requests that ask for n-gram speculation themselves."""
    return SpecDecoder(config)


def make_kv_only_speculator(config: EngineConfig) -> SpecDecoder:
    """A prefill worker's: no proposing, no draft model; an EAGLE head's KV and features still."""
    return SpecDecoder(config, proposing=False)
