"""The engine: add a request, step, abort; `generate` on top.

One step is `plan = scheduler.schedule(); result = execute(plan); update(plan, result)`: `execute`
runs the pass (`runner.execute`) and turns its rows into tokens (a `StepResult`); `update` takes
them in named stages (prompt logprobs, token trees, forks, the scheduler's update, grammars,
speculation) followed by detokenization, which may end a request on a stop string. What is not every
request's lives beside it: construction in `builder.py`, forks (n samples) in `forks.py`, the
deltas in `outputs.py`, speculation behind the `Speculator` of `speculation.py` (decode/spec/
implements it), the prefill side of a P/D handoff behind the `HoldHook` of `hooks.py`
(prefill/handoff.py) and the decode side in decode/handoff.py.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from itertools import islice
from collections.abc import Callable, Iterable, Iterator, Sequence as Seq
from dataclasses import dataclass

import torch

from cluster.config import EngineConfig
from cluster.engine import builder, offline
from cluster.engine.compaction import Compactor, compacting_sampling, resolve as resolve_compaction
from cluster.engine.forks import spawn_forks
from cluster.engine.grammar import GrammarRuntime, accept_outputs, mask_plan
from cluster.engine.graphs import DecodeGraphs
from cluster.engine.hooks import HoldHook
from cluster.engine.outputs import Requests
from cluster.engine.runner import PromptLogits
from cluster.engine.sampler import record_prompt_logprobs
from cluster.engine.scheduler import Gate, StepPlan
from cluster.engine.sequence import Sequence
from cluster.engine.speculation import (Draft, NoSpeculation, Speculator, SpeculatorFactory, attach_drafts,
                                        choose_tokens, compact_trees)
from cluster.kv.hashing import hash_prefix_blocks
from cluster.kv.kv_events import KVEventLog
from cluster.kv.window import KVWindow, resolve as resolve_window, windowed_sampling
from cluster.parallel.kv_export import KVExport
from cluster.parallel.local_ranks import LocalRanks
from cluster.placement import ComputeSetup
from cluster.types import Completion, FinishReason, Fork, SamplingParams, TokenDelta

log = logging.getLogger(__name__)

# How many requests at the queue's head may load KV from the tiers at once: those about to run.
TIER_LOOKAHEAD = 4

# What keeps the KV of `hold_kv` requests, built with the engine it serves (prefill/handoff.py).
HoldFactory = Callable[["LLMEngine"], HoldHook]


@dataclass(frozen=True)
class StepResult:
    """What one step's pass produced, for the update's stages: the tokens to append per sequence
    (a verification's accepted prefix and the target's own), each fork's first token, the drafts
    that were verified (token trees to compact), and the prompt logprob rows."""
    tokens: dict[Sequence, list[int]]
    forked: dict[Sequence, int]
    drafts: dict[Sequence, Draft]
    prompt_logits: tuple[PromptLogits, ...] = ()


class LLMEngine:
    def __init__(self, config: EngineConfig, speculator_factory: SpeculatorFactory | None = None,
                 hold_factory: HoldFactory | None = None, kv_events: KVEventLog | None = None):
        """`speculator_factory(config) -> Speculator` turns on speculative decoding (decode workers
        and the single-engine CLI pass `decode.spec.speculator.make_speculator`; prefill workers
        one that only computes what a handoff carries, `decode.spec.speculator.make_kv_only_speculator`).
        `hold_factory(engine) -> HoldHook`: what keeps the KV of `hold_kv` requests (a prefill
        worker's `prefill.handoff.PrefillHandoff`); it may read the engine only once built.
        `kv_events`: the log the pool and tiers report their changes to (a worker's, for the router)."""
        self.config = config
        self.hold_hook: HoldHook | None = hold_factory(self) if hold_factory else None
        # Tensor parallel: this process is rank 0; the other ranks start here as processes.
        self.ranks = LocalRanks(config) if config.tensor_parallel_size > 1 else None
        group = self.ranks.group if self.ranks is not None else None
        self.device = builder.setup_threads(config)
        # Without a factory: NoSpeculation (never proposes, refuses speculative requests).
        self.speculator: Speculator = speculator_factory(config) if speculator_factory else NoSpeculation(config)
        models = builder.load_models(config, self.device, group)
        footprint = builder.load_speculation(config, models, self.speculator, self.device)
        self.model_config, self.model, self.dtype = models.config, models.model, models.dtype
        self.kernel_plan, self.max_model_len, self.layout = models.kernel_plan, models.max_model_len, models.layout
        self._models = models
        self.tokenizer, self.generation = builder.tokenizer_and_defaults(config)
        self.memory_plan = builder.plan_for(config, models, footprint, self.device, group)
        core = builder.build_core(config, models, self.memory_plan, self.device, self.generation.eos_token_ids,
                                  self.speculator, footprint,
                                  on_hold=self.hold_hook.hold if self.hold_hook is not None else None,
                                  admit_gate=self._admission, kv_events=kv_events, group=group)
        self.backend, self.graph_replay, self.kv_cache = core.backend, core.replay, core.kv_cache
        self.pool, self.scheduler, self.runner = core.pool, core.scheduler, core.runner
        self.tiers = core.tiers        # KV tiers below the pool (cluster/kv/tiers.py), or None
        # KV compaction of long prompts after their prefill (cluster/engine/compaction.py).
        self.compactor = Compactor(self.kv_cache.arena, self.pool, self.layout.block_size,
                                   self.model_config.attention_scale)
        # Tensor parallel: rank 0's full-head arena, what a P/D handoff moves (cluster/parallel/kv_export.py).
        self.kv_export = KVExport(group, self.runner.step_sender, self.kv_cache, list(models.shards)) \
            if group is not None else None
        self.requests = Requests(self.tokenizer, self.scheduler, on_finish=self.speculator.release)
        self.prompt_tokens_computed = 0   # prefill work: prompt positions run through the model
        self.prompt_seconds = 0.0         # time of the steps that computed prompt tokens (prefill speed)
        self.idle_step = False   # the last step scheduled nothing and produced no delta (the loop may sleep)
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._grammar: GrammarRuntime | None = None   # built on the first constrained request
        self._grammar_lock = threading.Lock()
        self.speculator.attach(self)
        if self.backend.name == "triton" and self.device.type == "cuda":
            offline.warm_up(self)
        log.info("engine ready: %s (%s, %.1fM parameters), %s attention, %d KV blocks of %d tokens",
                 self.model_config.model_id, self.layout.dtype, self.model_config.num_parameters() / 1e6,
                 self.backend.name, self.pool.num_blocks, self.layout.block_size)

    def decode_graphs(self, model, arena: torch.Tensor, backend, pad_block: int, rows_per_seq: int = 1) -> DecodeGraphs:
        """Decode graphs of `model` over `arena` (also what a draft model's passes replay with)."""
        return builder.decode_graphs(self.config, self._models, self.graph_replay, model, arena, backend, pad_block,
                                     self.device, rows_per_seq)

    @property
    def transfer_arena(self) -> torch.Tensor:
        """The arena a P/D handoff reads or writes: the KV cache's, or a TP worker's export arena."""
        return self.kv_export.arena if self.kv_export is not None else self.kv_cache.arena

    @property
    def transfer_layout(self):
        """The layout of `transfer_arena` (a TP worker's: every KV head, as a single rank's)."""
        return self.kv_export.layout if self.kv_export is not None else self.layout

    def close(self) -> None:
        """Stops the tensor-parallel ranks this engine started (none: nothing to do)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def compute_setup(self) -> ComputeSetup:
        return ComputeSetup(self.kernel_plan, torch.get_num_threads(), self.config.cpus)

    @classmethod
    def from_model_dir(cls, model_dir, **overrides) -> "LLMEngine":
        return cls(EngineConfig(model=model_dir, **overrides))

    # --- requests ------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def validate_prompt(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenize(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty: it must have at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len} "
                             "tokens (one must be left to generate)")
        blocks = -(-(len(ids) + 1) // self.layout.block_size)
        if blocks > self.pool.num_blocks:
            raise ValueError(f"prompt needs {blocks} KV blocks but the cache has {self.pool.num_blocks}; "
                             "give the KV cache more memory")
        return ids

    def add_request(self, prompt: str | Seq[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None, hold_kv: bool = False, forks: Seq[Fork] = (),
                    tenant: str = "") -> str:
        """Queue a request. With `hold_kv` its blocks outlive it: the engine's `hold_hook` (the
        prefill side of a P/D handoff) keeps them pinned until the consumer has read them.
        `forks`: more samples of the same prompt (OpenAI's `n`), computed once (see forks.py). With
        `hold_kv` the forks only draw their first tokens (given to the hold hook): the decode worker
        forks them on the transferred KV. `tenant`: the API key's, for per-tenant state (the
        online-adapted draft heads, decode/spec/online/)."""
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams) or not all(isinstance(f, Fork) for f in forks):
            raise ValueError("sampling must be a SamplingParams and forks Forks")
        if hold_kv and self.hold_hook is None:
            raise ValueError("hold_kv needs a hold hook on the engine (prefill.handoff.PrefillHandoff)")
        request_id = request_id or uuid.uuid4().hex
        self.requests.check_free([request_id, *(f.request_id for f in forks)])
        ids = self.validate_prompt(prompt)
        if not hold_kv:   # a P/D producer only prefills: speculation is the decode worker's concern
            for sp in (sampling, *(f.sampling for f in forks)):
                self.validate_speculation(sp)
        seq = self.new_sequence(request_id, ids, sampling, hold_kv=hold_kv, tenant=tenant, num_forks=len(forks))
        # The parent reports the prompt's logprobs; a fork's prompt is never computed.
        seq.forks = [self.new_sequence(f.request_id, ids, f.sampling, hold_kv=hold_kv, prompt_logprobs_sent=True,
                                       tenant=tenant)
                     for f in forks]
        self._queue(seq)
        return request_id

    def _queue(self, seq: Sequence) -> None:
        """Queue a new request; when it is next in line and KV tiers hold blocks of its prompt past
        the pool's cached prefix, `_prefetch_next` parks it while they load."""
        self.scheduler.add(seq)
        self._prefetch_next()

    def _admission(self, seq: Sequence) -> Gate:
        """The scheduler's gate: a request whose prefix the tiers have not been asked for waits; for
        a load slot it lets the requests behind it go on, for room to load into it does not
        (they would take that room: first come first served on memory)."""
        if not self._needs_tier_check(seq):
            return Gate.ADMIT
        return Gate.STOP if self.pool.num_free <= 1 else Gate.HOLD

    def _needs_tier_check(self, seq: Sequence) -> bool:
        return not (seq.tiers_checked or seq.block_ids or seq.num_computed_tokens or seq.wants_prompt_logprobs)

    def _prefetch_next(self) -> None:
        """Ask the KV tiers for the prefixes of the requests next in line, in queue order (prefetch
        at admission, not on arrival: blocks loaded for a request that then waits behind a long
        queue would be evicted again before it runs). At most TIER_LOOKAHEAD requests load at once;
        a parked request leaves the queue and `step` puts it back at the front. The scheduler admits
        no request before it was asked (`admit_gate`), so none recomputes what a tier holds; one
        that waits for a load slot does not hold up the requests behind it that need no load."""
        if self.tiers is None or not self.pool.enable_prefix_caching:
            return
        waiting, bs = self.scheduler.waiting, self.layout.block_size
        for seq in [s for s in islice(waiting, self.scheduler.config.max_num_seqs) if self._needs_tier_check(s)]:
            seq.block_hashes = hash_prefix_blocks(seq.token_ids, bs, seq.sampling.cache_salt)
            usable = (seq.num_tokens - 1) // bs
            if self.tiers.would_load(seq.block_hashes, usable):
                if self.tiers.num_parked >= TIER_LOOKAHEAD or self.pool.num_free <= 1:
                    continue  # its load waits for a slot (or a free block); it waits, the others go on
                if self.tiers.prefetch(seq, seq.block_hashes, usable):
                    waiting.remove(seq)
            seq.tiers_checked = True

    def prefix_keys(self, token_ids: Seq[int], salt: str | None = None) -> list:
        """The pool's keys of the full blocks of `token_ids` (what a prefix hit looks up)."""
        return hash_prefix_blocks(list(token_ids), self.layout.block_size, salt)

    def wait_for_tiers(self, timeout: float = 0.05) -> None:
        """Block until a tier job completes (or `timeout`): what an idle offline loop does while
        requests wait for their KV to load, instead of spinning."""
        if self.tiers is not None:
            self.tiers.wait(timeout)

    def new_sequence(self, request_id: str, ids: list[int], sampling: SamplingParams, **fields) -> Sequence:
        """A request's record with its own generator, registered (not queued: `scheduler.add`).
        A constrained one gets its grammar matcher, past the output tokens it already has. A windowed
        one (its own kv_window or the server's) runs on its windowed sampling (cluster/kv/window.py)."""
        cc = self.config.cache
        window = resolve_window(sampling.kv_window, sampling.kv_sink_tokens, cc.kv_window, cc.kv_sink_tokens,
                                self.layout.block_size)
        if window is not None:
            self._check_windowed(sampling, window, len(ids), fields.get("hold_kv", False))
            sampling = windowed_sampling(sampling, window)
            fields["kv_window"] = window
        compact = resolve_compaction(sampling, cc.kv_compaction_ratio, cc.kv_compaction_method)
        num_forks = fields.pop("num_forks", 0)
        if compact is not None:
            sharing = self.model_config.num_kv_layers != self.model_config.num_layers
            why = Compactor.refusal(sampling, self._unsupported_kv_layout() or (
                "cross-layer KV sharing (a shared layer's queries would have to choose its source's entries)"
                if sharing else None), window is not None, num_forks)
            if why is not None:
                raise ValueError(f"kv_compaction is not supported with {why}")
            sampling = compacting_sampling(sampling, compact)
            fields["kv_compaction"] = compact
        seq = Sequence(request_id, tuple(ids), sampling, self._generator(sampling), **fields)
        if sampling.structured is not None:
            seq.grammar = self.grammar.matcher(sampling.structured, seq.output_token_ids)
        return self.requests.add(seq)

    def _check_windowed(self, sampling: SamplingParams, window: KVWindow, num_prompt: int, hold_kv: bool) -> None:
        """Refuse, by name, a windowed request where windows are not supported yet."""
        why = self._unsupported_kv_layout()
        if sampling.speculative not in (None, "off") or sampling.num_speculative_tokens is not None:
            why = "speculative decoding (a verification's drafts would need the window's masks)"
        elif why is None and hold_kv and window.drops_within(num_prompt):
            why = (f"a P/D handoff of a prompt past its window ({num_prompt} tokens, window {window.window} + "
                   f"{window.sink_tokens} sink tokens): only prompts within the window are handed off yet")
        if why is not None:
            raise ValueError(f"kv_window is not supported with {why}")

    def _unsupported_kv_layout(self) -> str | None:
        """Why this engine cannot lay a sequence's tokens out apart from their positions (windows,
        compaction): its backends, MLA, tensor parallelism, sliding-window layers; None: it can."""
        if self.backend.name != "torch" or self.kernel_plan.batch_invariant or self.model_config.mla is not None:
            return "this attention backend (the prefill's masks and captures run on --attention-backend torch, " \
                   "not deterministic, not MLA)"
        if self.ranks is not None:
            return "tensor parallelism (the step message carries no window or compaction to the other ranks yet)"
        if any(w is not None for w in self.model_config.layer_windows):
            return "a model with sliding-window layers of its own"
        return None

    @property
    def grammar(self) -> GrammarRuntime:
        """Constrained decoding's compiler and mask thread (cluster/engine/grammar.py)."""
        with self._grammar_lock:       # a worker may compile off the engine thread
            if self._grammar is None:
                self._grammar = GrammarRuntime(self.tokenizer, self.model_config.vocab_size,
                                               self.generation.eos_token_ids)
        return self._grammar

    def validate_speculation(self, sampling: SamplingParams) -> None:
        method = sampling.speculative
        if method in (None, "off") and sampling.num_speculative_tokens is None:
            return
        self.speculator.check_request(sampling)

    def skip_samples(self, request_id: str, n: int) -> None:
        """Advance a queued request's generator past `n` sampled tokens: it continues a request
        that already sampled them elsewhere (a handoff, a failover), and resumes its seeded draws
        where that one was. One draw per plain sampled token, as `sampler.sample_row` makes; a
        speculative request's draws depend on its acceptances, so only plain decoding resumes exactly."""
        seq = self.requests.seqs[request_id]
        if not seq.sampling.greedy and seq.generator is not None:
            self.skip_draws(seq.generator, n)
        if seq.grammar is not None:      # the resumed tokens end its prompt: the matcher moves past them
            accept_outputs({seq: seq.prompt_token_ids[-n:]})

    def skip_draws(self, generator: torch.Generator, n: int) -> None:
        """The draws of n plain sampled tokens, made as the sampler makes them: on the engine's
        device, whose generator the request holds (a CUDA generator does not advance for a draw
        on a CPU tensor, and a CPU one cannot draw on a CUDA tensor)."""
        for _ in range(n):
            torch.empty(self.model_config.vocab_size, device=generator.device).exponential_(generator=generator)

    def _generator(self, sampling: SamplingParams) -> torch.Generator:
        """The request's own generator, on the engine's device (the sampler draws noise there)."""
        seed = sampling.seed
        if seed is None:   # the engine's seed source stays on the host: one draw per request
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        return torch.Generator(device=self.device).manual_seed(seed)

    def abort(self, request_id: str) -> bool:
        """End a request now; its blocks are freed at once and its last delta comes from `step`."""
        seq = self.requests.seqs.get(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.requests.pending.append(self.requests.finish(seq, (), ""))
        return True

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self.requests.pending)
                or (self.tiers is not None and self.tiers.busy))

    @property
    def kv_discarded(self) -> int:
        """Handed-off requests whose transferred KV was thrown away (recomputed here instead)."""
        return self.scheduler.kv_discarded

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """`plan = scheduler.schedule(); result = execute(plan); update(plan, result)`, after the
        deltas owed since the last step."""
        out = self._owed_deltas()
        plan = self.scheduler.schedule()
        out += self._ended(plan)
        self.idle_step = plan.empty and not out
        if not plan.empty:
            t0, computed = time.perf_counter(), self.prompt_tokens_computed
            out += self._update(plan, self._execute(plan))
            if self.prompt_tokens_computed > computed:
                self.prompt_seconds += time.perf_counter() - t0
        return out

    def _owed_deltas(self) -> list[TokenDelta]:
        """Deltas made between steps (aborts); requests whose KV the tiers loaded go first in line."""
        out, self.requests.pending = self.requests.pending, []
        if self.tiers is not None:
            self.scheduler.waiting.extendleft(reversed(self.tiers.poll()))
            self._prefetch_next()
        return out

    def _ended(self, plan: StepPlan) -> list[TokenDelta]:
        """Requests the scheduler had to end (the pool cannot hold them) still owe their caller a
        delta; preempted ones lose their proposer state."""
        for seq in plan.preempted:
            self.speculator.release(seq)
        return [d for d in map(self.requests.ended, self.scheduler.take_ended()) if d is not None]

    def _execute(self, plan: StepPlan) -> StepResult:
        """The plan's forward pass and its tokens: decodes with a draft become verifications, the
        grammar's masks (computed beside the pass) constrain the rows before they are sampled."""
        drafts = attach_drafts(self.speculator, self.scheduler, plan) if plan.decodes else {}
        self._count_prompt_tokens(plan)
        masks = self.grammar.begin(jobs) if (jobs := mask_plan(plan, drafts)) else None
        forward = self.runner.execute(plan)
        if masks is not None:
            masks.apply(forward.logits, forward.sampled, drafts)
        tokens, forked = choose_tokens(forward.logits, forward.sampled, drafts, self.speculator) \
            if forward.sampled else ({}, {})
        return StepResult(tokens, forked, drafts, forward.prompt_logits)

    def _count_prompt_tokens(self, plan: StepPlan) -> None:
        for c in plan.prefills + plan.decodes:   # a prompt's 1-token chunk is scheduled as a decode
            self.prompt_tokens_computed += max(0, min(c.start + c.num_tokens, c.seq.num_prompt_tokens) - c.start)

    def _update(self, plan: StepPlan, result: StepResult) -> list[TokenDelta]:
        """The step's tokens into the requests, in named stages; returns their deltas."""
        record_prompt_logprobs(result.prompt_logits)
        compact_trees(self.kv_cache.arena, result.drafts, result.tokens, self.layout.block_size)
        before = {seq: seq.num_tokens for seq in result.tokens}
        forks = {seq: list(seq.forks) for seq in result.tokens if seq.forks}
        spawned = spawn_forks(self, list(forks), result.forked)   # before the update may free a parent's blocks
        self.compactor.after_pass(plan)    # before the update: a P/D producer holds the compacted blocks
        self.scheduler.update(plan, result.tokens)
        self._advance_grammars(before, result.forked)
        self.speculator.after_update(forks)
        return [self.requests.delta(seq, seq.token_ids[n:]) for seq, n in before.items()] + spawned

    @staticmethod
    def _advance_grammars(before: dict[Sequence, int], forked: dict[Sequence, int]) -> None:
        """Constrained requests' matchers move past the tokens the update kept (`before`: each
        sequence's length before it) and each fork's first token."""
        accept_outputs({**{seq: seq.token_ids[n:] for seq, n in before.items()},
                        **{fork: (t,) for fork, t in forked.items()}})

    # --- helpers on top (cluster/engine/offline.py) ------------------------------------
    def sequence(self, request_id: str) -> Sequence:
        """A queued or running request's record (KeyError once it has ended)."""
        return self.requests.seqs[request_id]

    def stream(self, prompt: str | Seq[int], sampling: SamplingParams | None = None) -> Iterator[TokenDelta]:
        """Run one request to the end (others already added keep running) and yield its deltas."""
        return offline.stream(self, prompt, sampling)

    def generate(self, prompts: Iterable[str | Seq[int]],
                 sampling: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Run every prompt to the end together; one `Completion` each, in order."""
        return offline.generate(self, prompts, sampling)
