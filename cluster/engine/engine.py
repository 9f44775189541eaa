"""The engine: add a request, step, abort; `generate` on top.

One step is `plan = scheduler.schedule(); logits = runner.execute(plan); scheduler.update(...)`,
followed by detokenization, which may end a request on a stop string.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence as Seq

import torch

from cluster.config import EngineConfig
from cluster.engine import offline
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.graphs import DecodeGraphs, replay_factory
from cluster.engine.runner import ModelRunner
from cluster.engine.sampler import logprob_entry, record_prompt_logprobs, sample
from cluster.engine.scheduler import Scheduler, StepPlan
from cluster.engine.speculation import Draft, Speculator
from cluster.engine.sequence import Sequence
from cluster.kv.block_pool import BlockPool
from cluster.kv.paged_cache import PagedKVCache, draft_footprint, plan_memory, resident_bytes
from cluster.model.attention import make_attention_backend
from cluster.model.kernel_choice import apply_kernel_plan, engine_config_plan
from cluster.model.loader import load_generation_defaults, load_model, load_tokenizer
from cluster.model.model_config import TORCH_DTYPES
from cluster.model.spec_compat import check_speculative_models
from cluster.placement import ComputeSetup, pin_process, usable_cpus
from cluster.types import Completion, FinishReason, Fork, KVLayout, SamplingParams, TokenDelta

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, speculator_factory=None):
        """`speculator_factory(engine) -> Speculator` turns on speculative decoding (decode workers
        and the single-engine CLI pass `decode.spec.make_speculator`)."""
        self.config = config
        if config.cpus:
            pin_process(config.cpus)
        torch.set_num_threads(config.num_threads or len(usable_cpus()))
        self.device = torch.device(config.device)
        dtype = None if config.dtype == "auto" else TORCH_DTYPES[config.dtype]
        self.model_config, self.model = load_model(config.model, dtype=dtype, device=self.device,
                                                   max_positions=config.max_model_len)
        self.dtype = self.model.embed_tokens.weight.dtype
        self.kernel_plan = engine_config_plan(config)
        log.info("kernel plan: %s", self.kernel_plan.describe())
        apply_kernel_plan(self.model, self.kernel_plan)
        self.tokenizer = load_tokenizer(config.model)
        self.generation = load_generation_defaults(config.model)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        cc = config.cache
        self.eagle = None
        model_id, num_layers = mc.model_id, mc.num_layers
        check_speculative_models(config, disaggregated=False)   # a draft or head that cannot work
        if config.speculative.method == "eagle":
            # The head's KV is one more layer of the arena; the layout hash then tells a P/D peer
            # that its blocks carry the head's KV too.
            from cluster.model.eagle import load_eagle_head  # noqa: PLC0415
            self.eagle = load_eagle_head(config.speculative.eagle_dir, mc, self.model, self.dtype, self.device)
            apply_kernel_plan(self.eagle, self.kernel_plan)
            model_id, num_layers = f"{mc.model_id}+eagle:{config.speculative.eagle_dir.name}", num_layers + 1
        self.layout = KVLayout(model_id=model_id, num_layers=num_layers, num_kv_heads=mc.num_kv_heads,
                               head_dim=mc.head_dim, block_size=cc.block_size,
                               dtype=str(self.dtype).removeprefix("torch."))
        self.draft_model = self.draft_model_config = None
        if config.speculative.method == "draft" and speculator_factory is not None:
            # Loaded with the target, before the plan, so its real size is planned (the proposer runs
            # it; an engine without a speculator, a prefill worker's, needs no draft).
            self.draft_model_config, self.draft_model = load_model(config.speculative.draft_dir, dtype=self.dtype,
                                                                   device=self.device, max_positions=self.max_model_len)
            apply_kernel_plan(self.draft_model, self.kernel_plan)
        weight_bytes = resident_bytes(self.model)
        draft_per_block, draft_bytes = (0, 0) if self.draft_model is None else draft_footprint(
            self.draft_model, self.draft_model_config, config, self.layout.dtype)
        self.memory_plan = plan_memory(mc, self.layout, cc, config.scheduler, self.dtype, weight_bytes,
                                       self.max_model_len, self.device, draft_per_block, draft_bytes)
        log.info("%s", self.memory_plan.describe())
        self.backend = make_attention_backend(config.attention_backend, mc.num_heads, mc.num_kv_heads,
                                              mc.head_dim, self.device, self.kernel_plan, self.dtype,
                                              scale=mc.attention_scale)
        replay = replay_factory(self.device, config.cuda_graphs)
        if replay is not None and config.cuda_graphs == "auto" and not self.backend.static_decode_ready():
            log.info("decode graphs off: the %s attention backend cannot replay static decode steps here",
                     self.backend.name)
            replay = None
        # Decode graphs pad their batches into one block past the pool's (never allocated).
        pad_blocks = 1 if replay is not None else 0
        self.kv_cache = PagedKVCache(self.layout, self.memory_plan.num_blocks + pad_blocks, self.device)
        self.pool = BlockPool(self.memory_plan.num_blocks, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.pool, cc.block_size, self.max_model_len,
                                   self.generation.eos_token_ids)
        self.runner = ModelRunner(self.model, self.kv_cache.arena, self.backend, cc.block_size, self.device)
        self._held_features: dict[str, torch.Tensor] = {}
        if self.eagle is not None:
            self.runner.eagle = self.eagle
            self.runner.block_features = torch.zeros((self.pool.num_blocks, mc.hidden_size), dtype=self.dtype,
                                                     device=self.device)
            self.runner.feature_valid = [False] * self.pool.num_blocks
            self.pool.on_allocate = self.runner.invalidate_features
            self.scheduler.hit_filter = self.runner.usable_hits
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[TokenDelta] = []
        self._fork_firsts: dict[str, list[TokenDelta]] = {}
        self.prompt_tokens_computed = 0   # prefill work: prompt positions run through the model
        self.idle_step = False   # the last step scheduled nothing and produced no delta (the loop may sleep)
        self._seed_source = torch.Generator().manual_seed(config.seed)
        # Called with each step's plan before it runs (the KV push binds its blocks here and
        # sets `runner.layer_hook` to stream each layer as it is computed).
        self.plan_hooks: list = []
        self.graph_replay = replay   # also what a draft model's passes replay with
        self.speculator: Speculator | None = speculator_factory(self) if speculator_factory else None
        if replay is not None and self.eagle is None:   # the EAGLE head runs over every token: eager
            width = 1 + config.speculative.max_speculative_tokens if self.speculator is not None else 1
            self.runner.graphs = self.decode_graphs(self.model, self.kv_cache.arena, self.backend,
                                                    self.memory_plan.num_blocks, rows_per_seq=width)
        self._drafts: dict[Sequence, Draft] = {}
        if self.backend.name == "triton" and self.device.type == "cuda":
            offline.warm_up(self)
        log.info("engine ready: %s (%s, %.1fM parameters), %s attention, %d KV blocks of %d tokens",
                 mc.model_id, self.layout.dtype, mc.num_parameters() / 1e6, self.backend.name,
                 self.pool.num_blocks, cc.block_size)

    def decode_graphs(self, model, arena: torch.Tensor, backend, pad_block: int, rows_per_seq: int = 1) -> DecodeGraphs:
        """Decode graphs of `model` over `arena` for every batch bucket up to max_num_seqs
        sequences of `rows_per_seq` rows (the widest verification)."""
        bs, buckets = self.config.cache.block_size, self.kernel_plan.buckets
        limit = self.config.scheduler.max_num_seqs * rows_per_seq
        sizes = [s for s in buckets.sizes if s < limit] + [buckets.bucket(limit)]
        return DecodeGraphs(model, arena, backend, bs, self.device, sizes, -(-self.max_model_len // bs), pad_block,
                            self.graph_replay)

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
                    request_id: str | None = None, hold_kv: bool = False,
                    forks: Seq[Fork] = ()) -> str:
        """Queue a request. With `hold_kv` its blocks outlive it (see `take_held_kv`): the
        prefill side of a P/D handoff keeps them pinned until the consumer has read them.
        `forks` (request id, sampling): more samples of the same prompt (OpenAI's `n`). The
        prompt is computed once: each fork draws its first token from the same logits with its own
        generator, then decodes on the prompt's blocks (shared; see `Scheduler.fork`). With
        `hold_kv` the forks only draw their first tokens (`take_fork_firsts`): the decode worker
        forks them on the transferred KV."""
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams) or not all(isinstance(f, Fork) for f in forks):
            raise ValueError("sampling must be a SamplingParams")
        request_id = request_id or uuid.uuid4().hex
        ids_in_use = [r for r in (request_id, *(f.request_id for f in forks)) if r in self._seqs]
        if ids_in_use or len({request_id, *(f.request_id for f in forks)}) != 1 + len(forks):
            raise ValueError(f"request_id {(ids_in_use or [request_id])[0]!r} is already in use")
        ids = self.validate_prompt(prompt)
        if not hold_kv:   # a P/D producer only prefills: speculation is the decode worker's concern
            for sp in (sampling, *(f.sampling for f in forks)):
                self.validate_speculation(sp)
        seq = self._new_sequence(request_id, ids, sampling, hold_kv=hold_kv)
        # The parent reports the prompt's logprobs; a fork's prompt is never computed.
        seq.forks = [self._new_sequence(f.request_id, ids, f.sampling, hold_kv=hold_kv, prompt_logprobs_sent=True)
                     for f in forks]
        self.scheduler.add(seq)
        return request_id

    def _new_sequence(self, request_id: str, ids: list[int], sampling: SamplingParams, **fields) -> Sequence:
        seq = Sequence(request_id, tuple(ids), sampling, self._generator(sampling), **fields)
        self._seqs[request_id] = seq
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids, sampling.stop)
        return seq

    def validate_speculation(self, sampling: SamplingParams) -> None:
        method = sampling.speculative
        if method in (None, "off") and sampling.num_speculative_tokens is None:
            return
        if self.speculator is None:
            if method in (None, "off"):
                return
            raise ValueError(f"speculative={method!r} was asked for, but this engine runs without speculative "
                             "decoding; start it with --speculative")
        self.speculator.check_request(sampling)

    def skip_samples(self, request_id: str, n: int) -> None:
        """Advance a queued request's generator past `n` sampled tokens: it continues a request
        that already sampled them elsewhere (a handoff, a failover), and resumes its seeded draws
        where that one was. One draw per plain sampled token, as `sampler.sample_row` makes; a
        speculative request's draws depend on its acceptances, so only plain decoding resumes exactly."""
        seq = self._seqs[request_id]
        if seq.sampling.greedy or seq.generator is None or n <= 0:
            return
        self._skip_draws(seq.generator, n)

    def _skip_draws(self, generator: torch.Generator, n: int) -> None:
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

    def add_prefilled(self, request_id: str, prompt_ids: Seq[int], first_token: int,
                      sampling: SamplingParams, block_ids: Seq[int], feature: bytes = b"",
                      forks: Seq[Fork] = ()) -> None:
        """Join a sequence whose prompt KV already sits in `block_ids` (taken from this engine's
        pool and filled by a transfer) and whose first token was sampled elsewhere. It decodes
        from its second token on, waiting with its blocks while the pool is full; if it is ever
        preempted, or its KV is discarded to avoid a deadlock, it is recomputed here. `forks`:
        (request id, sampling, first token) of more samples of the prompt, on the same blocks."""
        ids = self.validate_prompt(list(prompt_ids))
        for sp in (sampling, *(f.sampling for f in forks)):
            self.validate_speculation(sp)
        for rid in (request_id, *(f.request_id for f in forks)):
            if rid in self._seqs:
                raise ValueError(f"request_id {rid!r} is already in use")
        if len(block_ids) != -(-len(ids) // self.layout.block_size):
            raise ValueError(f"{len(ids)} prompt tokens need {-(-len(ids) // self.layout.block_size)} blocks, "
                             f"got {len(block_ids)}")
        if self.eagle is not None and len(feature) != self.model_config.hidden_size * self.dtype.itemsize:
            raise ValueError(f"a handoff to an EAGLE decode worker must carry the prompt's last hidden state "
                             f"({self.model_config.hidden_size} values); got {len(feature)} bytes")
        lead = self._prefilled_sequence(request_id, ids, sampling, first_token, feature)
        lead.block_ids, lead.num_computed_tokens = list(block_ids), len(ids)
        self.scheduler.add(lead)
        for f in forks:
            child = self._prefilled_sequence(f.request_id, ids, f.sampling, f.first_token, feature)
            if not self.scheduler.fork(lead, child, len(ids), self.kv_cache.copy_block):
                self.scheduler.add(child)      # no block for its copy: it computes the prompt itself

    def _prefilled_sequence(self, request_id: str, ids: list[int], sampling: SamplingParams, first_token: int,
                            feature: bytes) -> Sequence:
        # Its prompt (and prompt logprobs) were computed by the producer.
        seq = self._new_sequence(request_id, ids, sampling, token_ids=[*ids, int(first_token)],
                                 prompt_logprobs_sent=True)
        if self.eagle is not None:
            raw = torch.frombuffer(bytearray(feature), dtype=torch.uint8)
            seq.spec_feature = raw.view(self.dtype).to(self.device)
            seq.spec_feature_pos = len(ids) - 1
        if not sampling.greedy and seq.generator is not None:
            # The producer drew the first token from the same seed: skip that draw so a seeded
            # request samples the same tokens as it would in one engine.
            self._skip_draws(seq.generator, 1)
        # Replays the producer's text state; its text was streamed there.
        self._detok[request_id].add([int(first_token)])
        return seq

    def take_held_kv(self, request_id: str) -> tuple[list[int], int]:
        """Blocks and token count of a finished `hold_kv` request; they stay referenced until
        `release_held_kv`."""
        return self.scheduler.held[request_id]

    def release_held_kv(self, request_id: str) -> None:
        self._held_features.pop(request_id, None)
        self.scheduler.release_held(request_id)

    def take_held_feature(self, request_id: str) -> bytes:
        """With an EAGLE head: the target's hidden state at the prompt's last position, the one
        piece of proposer state the blocks do not carry (raw bytes in the KV layout's dtype)."""
        feature = self._held_features.pop(request_id, None)
        if feature is None:
            return b""
        return feature.cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def abort(self, request_id: str) -> bool:
        """End a request now; its blocks are freed at once and its last delta comes from `step`."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._pending.append(self._finish_delta(seq, (), ""))
        return True

    def take_fork_firsts(self, request_id: str) -> list[TokenDelta]:
        """A `hold_kv` request's forks, each ended with its first token (drawn from the prompt's
        logits beside the request's own): what a decode worker continues them from."""
        return self._fork_firsts.pop(request_id, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def kv_discarded(self) -> int:
        """Handed-off requests whose transferred KV was thrown away (recomputed here instead)."""
        return self.scheduler.kv_discarded

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        out, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        # A request the scheduler had to end (the pool cannot hold it) still owes its caller a delta.
        for seq in self.scheduler.take_ended():
            if seq.request_id in self._detok:
                out.append(self._finish_delta(seq, (), self._detok[seq.request_id].add((), final=True)))
        if self.speculator is not None:
            for seq in plan.preempted:
                self.speculator.release(seq)
        self.idle_step = plan.empty and not out
        if plan.empty:
            return out
        if self.speculator is not None and plan.decodes:
            self._attach_drafts(plan)
        for hook in self.plan_hooks:
            hook(plan)
        for c in plan.prefills + plan.decodes:   # a prompt's 1-token chunk is scheduled as a decode
            self.prompt_tokens_computed += max(0, min(c.start + c.num_tokens, c.seq.num_prompt_tokens) - c.start)
        logits, sampled_seqs = self.runner.execute(plan)
        if self.runner.prompt_logits:
            record_prompt_logprobs(self.runner.prompt_logits)
            self.runner.prompt_logits = []
        forked: dict[Sequence, int] = {}
        tokens = self._choose_tokens(logits, sampled_seqs, forked) if sampled_seqs else {}
        before = {seq: seq.num_tokens for seq in tokens}
        # Before the update, which may end the parent and free the blocks its forks are to share.
        parents = [(seq, seq.forks) for seq in tokens if seq.forks]
        spawned = []    # their first deltas leave after the parent's (which carries the prompt's logprobs)
        for parent, forks in parents:
            parent.forks = []
            spawned.extend(self._spawn(parent, fork, forked[fork]) for fork in forks if not fork.is_finished)
        self.scheduler.update(plan, tokens)
        self.runner.keep_features()
        for parent, forks in parents:   # EAGLE: the prompt's last hidden state is the forks' too
            for fork in forks:
                fork.spec_feature, fork.spec_feature_pos = parent.spec_feature, parent.spec_feature_pos
        for seq, n in before.items():
            out.append(self._delta(seq, seq.token_ids[n:]))
        out.extend(d for d in spawned if d is not None)
        return out

    def _spawn(self, parent: Sequence, fork: Sequence, token: int) -> TokenDelta | None:
        """A fork's first token is drawn: it joins the queue on its parent's prompt KV. For a P/D
        producer it ends here instead: its first token is what the decode worker continues from."""
        fork.token_ids.append(token)
        reason = self.scheduler.stop_reason(fork, token)
        if reason is not None:
            self.scheduler.finish(fork, reason)
        elif not parent.hold_kv and not self.scheduler.fork(parent, fork, parent.num_prompt_tokens,
                                                            self.kv_cache.copy_block):
            self.scheduler.add(fork)   # no block free for its copy: it computes the prompt itself
        delta = self._delta(fork, [token])      # a stop string in its text ends it here
        if not parent.hold_kv:
            return delta
        if not delta.finished:                  # it goes on elsewhere: drop its state here
            self.scheduler.finish(fork, FinishReason.LENGTH)
            self._finish_delta(fork, (), "")
        self._fork_firsts.setdefault(parent.request_id, []).append(delta)
        return None

    # --- speculation -----------------------------------------------------------------------
    def _attach_drafts(self, plan: StepPlan) -> None:
        chunks, ks = [], []
        for chunk in plan.decodes:
            k = self.speculator.lookahead(chunk.seq)
            if k > 0:
                k = self.scheduler.lookahead_room(chunk.seq, k, plan)
            if k > 0:
                chunks.append(chunk)
                ks.append(k)
        if not chunks:
            return
        drafts = self.speculator.propose([c.seq for c in chunks], ks)
        for chunk, draft in zip(chunks, drafts):
            if draft.tokens:
                self.scheduler.attach_draft(plan, chunk, draft.tokens)
                self._drafts[chunk.seq] = draft
            else:
                self.scheduler.trim_blocks(chunk.seq)

    def _choose_tokens(self, logits: torch.Tensor, seqs: list[Sequence],
                       forked: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Plain rows are sampled together; each verification's k+1 rows go to the speculator. A
        prompt's forks draw from its row beside it (their tokens go to `forked`)."""
        if not self._drafts and not any(seq.forks for seq in seqs):
            return {seq: [t] for seq, t in zip(seqs, sample(logits, seqs))}
        out: dict[Sequence, list[int]] = {}
        plain_rows, plain_seqs, forks, row = [], [], set(), 0
        for seq in seqs:
            draft = self._drafts.pop(seq, None)
            if draft is None:
                plain_rows.append(row)
                plain_seqs.append(seq)
                for fork in seq.forks:
                    plain_rows.append(row)
                    plain_seqs.append(fork)
                    forks.add(fork)
                row += 1
                continue
            rows = logits[row:row + len(draft) + 1]
            tokens = self.speculator.verify(seq, rows, draft)
            if seq.sampling.logprobs is not None:
                for i, tok in enumerate(tokens):
                    seq.logprobs.append(logprob_entry(torch.log_softmax(rows[i], dim=-1), tok, seq.sampling.logprobs))
            out[seq] = tokens
            row += len(draft) + 1
        if plain_seqs:
            index = torch.tensor(plain_rows, dtype=torch.long, device=logits.device)
            for seq, t in zip(plain_seqs, sample(logits.index_select(0, index), plain_seqs)):
                if seq in forks:
                    forked[seq] = t
                else:
                    out[seq] = [t]
        return out

    def _delta(self, seq: Sequence, tokens: list[int]) -> TokenDelta:
        detok = self._detok[seq.request_id]
        finished = seq.is_finished
        text = ""
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            # A P/D producer's request ends after its first token but the text goes on elsewhere: no
            # flush, so it emits exactly what a single engine would for that token.
            text += detok.add((token,), final=finished and last and not seq.hold_kv)
            if detok.stopped:
                if not last:   # a stop string inside an accepted draft: the tokens after it never happened
                    del seq.token_ids[len(seq.token_ids) - (len(tokens) - i - 1):]
                    tokens = tokens[:i + 1]
                    if finished:
                        seq.finish_reason = FinishReason.STOP
                if not finished:
                    self.scheduler.finish(seq, FinishReason.STOP)
                    finished = True
                break
        logprobs = ()
        if seq.sampling.logprobs is not None and seq.logprobs:
            del seq.logprobs[seq.num_output_tokens:]
            logprobs = tuple(seq.logprobs[-len(tokens):])
        if finished:
            return self._finish_delta(seq, tuple(tokens), text, logprobs)
        return TokenDelta(seq.request_id, tuple(tokens), text, None, logprobs, seq.num_prompt_tokens,
                          seq.num_output_tokens, seq.num_cached_tokens, seq.take_prompt_logprobs())

    def _finish_delta(self, seq: Sequence, token_ids, text: str, logprobs=()) -> TokenDelta:
        for fork in seq.forks:   # it ended before its first sampling: so do the forks waiting on it
            self.scheduler.finish(fork, seq.finish_reason)
            self._pending.append(self._finish_delta(fork, (), ""))
        seq.forks = []
        if seq.hold_kv and seq.spec_feature is not None and seq.request_id in self.scheduler.held:
            self._held_features[seq.request_id] = seq.spec_feature
        if self.speculator is not None:
            self.speculator.release(seq)
        self._seqs.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        return TokenDelta(seq.request_id, tuple(token_ids), text, seq.finish_reason, tuple(logprobs),
                          seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens,
                          seq.take_prompt_logprobs())

    # --- helpers on top (cluster/engine/offline.py) ------------------------------------
    def sequence(self, request_id: str) -> Sequence:
        """A queued or running request's record (KeyError once it has ended)."""
        return self._seqs[request_id]

    def stream(self, prompt: str | Seq[int], sampling: SamplingParams | None = None) -> Iterator[TokenDelta]:
        """Run one request to the end (others already added keep running) and yield its deltas."""
        return offline.stream(self, prompt, sampling)

    def generate(self, prompts: Iterable[str | Seq[int]],
                 sampling: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Run every prompt to the end together; one `Completion` each, in order."""
        return offline.generate(self, prompts, sampling)
