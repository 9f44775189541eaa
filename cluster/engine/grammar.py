"""Constrained decoding: a request's grammar masks the logits of every row it samples from.

A request with `SamplingParams.structured` (cluster/types.py: a JSON schema, any JSON object, a
regex, a choice, an EBNF or Lark grammar, or a tool call) gets an xgrammar matcher on its
`Sequence.grammar`, built from the compiled grammar (compiled once per distinct constraint, kept
in a bounded LRU). The matcher's state is a function of the tokens it accepted, so it never
travels: a P/D decode worker, a failover's new worker or a fork rebuilds it from the request's
output tokens (`GrammarRuntime.matcher`).

Each step the masks of the rows to be sampled are filled on a helper thread while the model's
forward runs (xgrammar's fill releases the GIL), then applied to the fp32 logits before any
sampler or verifier sees them (`MaskJob`). A drafted sequence gets one mask per verified row:
row i is masked for the state after the draft's path to it, so the verifier (greedy or
rejection sampling) can only accept tokens the grammar allows, and its bonus token obeys too.
Rows past a token the grammar refuses are left unmasked: verification stops before them.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cluster.engine import draft_tree
from kernels import cpu_ops
from cluster.types import StructuredKind, StructuredOutput


class _Xgrammar:
    """xgrammar, imported on first use: it imports transformers, seconds of every worker's start,
    and most engines never see a constrained request."""

    def __getattr__(self, name: str):
        import xgrammar  # noqa: PLC0415 - heavy optional dependency, loaded on the first grammar
        return getattr(xgrammar, name)


xgr = _Xgrammar()

log = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 64          # distinct constraints kept compiled per engine
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"   # the Hermes / Qwen format


class GrammarError(ValueError):
    """A constraint the grammar library cannot compile; the message says what is unsupported."""


def build_grammar(spec: StructuredOutput) -> xgr.Grammar:
    """The constraint as an xgrammar Grammar (no tokenizer needed: the router checks requests with
    it). JSON is compact (no free whitespace): free whitespace lets a small model loop on newlines."""
    try:
        return _build(spec)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own kinds
        raise GrammarError(f"{spec.kind.value}: {_first_line(exc)}") from None


def _build(spec: StructuredOutput) -> xgr.Grammar:
    kind = spec.kind
    if kind is StructuredKind.JSON_OBJECT:
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind is StructuredKind.JSON_SCHEMA:
        return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
    if kind is StructuredKind.REGEX:
        return xgr.Grammar.from_regex(spec.spec)
    if kind is StructuredKind.CHOICE:
        choices = json.loads(spec.spec)
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
    if kind is StructuredKind.GRAMMAR:
        return xgr.Grammar.from_ebnf(spec.spec)
    if kind is StructuredKind.LARK:
        return xgr.Grammar.from_lark(spec.spec)
    if kind is StructuredKind.TOOL_CALL:
        return tool_call_grammar(json.loads(spec.spec))
    raise GrammarError(f"unknown constraint kind {kind!r}")


def tool_call_grammar(functions: list[dict]) -> xgr.Grammar:
    """One call of one of `functions` ({"name", "parameters"}) in the Hermes format:
    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, the arguments matching the
    function's parameter schema."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_OPEN)}"),
                              xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                              xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_CALL_CLOSE)}"))


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizers.Tokenizer`: every id's raw token, and how raw tokens map
    to bytes (byte-level BPE, SentencePiece byte fallback, or plain text)."""
    vocab = [""] * vocab_size
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            vocab[i] = token
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = json.dumps(decoder)
    if '"ByteLevel"' in kinds:
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif '"ByteFallback"' in kinds:
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    return xgr.TokenizerInfo(vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=False)


class GrammarRuntime:
    """One engine's compiler, compiled-grammar LRU and mask thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()     # workers compile off the engine thread (EngineWorker._compile)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.mask_rows = 0
        self.mask_seconds = 0.0      # filling masks, on the mask thread (beside the forward)
        self.apply_seconds = 0.0     # applying them, on the step's own path

    def compiled(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The constraint compiled against this tokenizer, from the LRU when it was seen lately."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        try:
            grammar = self.compiler.compile_grammar(build_grammar(spec))
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(f"{spec.kind.value}: {_first_line(exc)}") from None
        with self._lock:
            self._compiled[spec] = grammar
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutput, done: list[int]) -> xgr.GrammarMatcher:
        """A matcher for `spec` that has accepted `done` (the tokens the request already produced:
        a handoff's first token, a failover's streamed ones); ValueError if they break the grammar."""
        m = xgr.GrammarMatcher(self.compiled(spec), max_rollback_tokens=-1)
        for t in done:
            if not m.accept_token(int(t)):
                raise ValueError(f"token {t} of the output so far breaks the request's {spec.kind.value} constraint")
        return m

    def begin(self, plan: dict[object, tuple[object, tuple[int, ...], tuple[int, ...]]]) -> "MaskJob":
        """Start filling, on the mask thread, the masks of each sequence of `plan` (sequence ->
        (matcher, draft tokens, draft parents)): 1 + len(draft) rows each."""
        return MaskJob(self, plan)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class MaskJob:
    """Masks of one step's constrained rows, filled while the forward runs."""

    def __init__(self, runtime: GrammarRuntime, plan: dict):
        self.runtime = runtime
        self.plan = plan
        self.future: Future | None = runtime._pool.submit(self._fill) if plan else None

    def _fill(self) -> tuple[torch.Tensor, dict[object, tuple[int, list[int]]]]:
        t0 = time.perf_counter()
        n = sum(1 + len(draft) for _, draft, _ in self.plan.values())
        bitmask = xgr.allocate_token_bitmask(n, self.runtime.vocab_size)
        live: dict[object, tuple[int, list[int]]] = {}    # seq -> (its first mask row, rows filled)
        row = 0
        for seq, (matcher, draft, parents) in self.plan.items():
            live[seq] = (row, fill_draft_masks(matcher, draft, parents, bitmask, row))
            row += 1 + len(draft)
        self.runtime.mask_rows += sum(len(rows) for _, rows in live.values())
        self.runtime.mask_seconds += time.perf_counter() - t0
        return bitmask, live

    def apply(self, logits: torch.Tensor, sampled: list, drafts: dict) -> None:
        """Mask `logits` in place: its rows are `sampled`'s, in order, 1 + len(draft) per drafted one.
        A row only ever read for its argmax (`_argmax_only`) gets its masked argmax without a full
        mask (`_steer_argmax`): on a CPU a full mask costs ~50-90 us a row, 6% of a step at batch 32."""
        if self.future is None:
            return
        bitmask, live = self.future.result()
        t0 = time.perf_counter()
        self._apply(logits, sampled, drafts, bitmask, live)
        self.runtime.apply_seconds += time.perf_counter() - t0

    def _apply(self, logits: torch.Tensor, sampled: list, drafts: dict, bitmask: torch.Tensor, live: dict) -> None:
        src, dst, lazy, row = [], [], [], 0
        for seq in sampled:
            draft = drafts.get(seq)
            if seq in live:
                base, filled = live[seq]
                src += [base + r for r in filled]
                dst += [row + r for r in filled]
                lazy += [_argmax_only(seq)] * len(filled)
            row += 1 + (len(draft) if draft is not None else 0)
        if not src:
            return
        with torch.inference_mode():      # the runner's logits are inference tensors
            if any(lazy):
                pairs = [(d, m) for d, m, z in zip(dst, src, lazy) if z]
                steered = _steer_argmax(logits, bitmask, pairs)
                rest = [(d, m) for d, m in zip(dst, src) if d not in steered]
                dst, src = [d for d, _ in rest], [m for _, m in rest]
            if dst:   # the rows a sampler draws from (or reads logprobs of): every forbidden token -inf
                full = torch.empty((logits.shape[0], bitmask.shape[1]), dtype=bitmask.dtype)
                full[dst] = bitmask[src]
                xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=self.runtime.vocab_size,
                                                indices=dst)


def _steer_argmax(logits: torch.Tensor, bitmask: torch.Tensor, pairs: list[tuple[int, int]]) -> set[int]:
    """For each (logits row, mask row) of `pairs`, the token a full mask's argmax would pick,
    raised above the row's maximum so that the sampler's or verifier's argmax picks it
    (kernels/cpu/ops.c `ss_masked_argmax`: one pass over the row, no -inf written). Returns the
    rows done: none where the C ops are not built or the logits are not fp32 on the CPU."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or cpu_ops.load() is None:
        return set()
    rows, mask_rows = [p[0] for p in pairs], [p[1] for p in pairs]
    found = cpu_ops.masked_argmax(logits, bitmask, rows, mask_rows, logits.shape[1], steer=True)
    return set() if found is None else {row for row, token in zip(rows, found[0]) if token >= 0}


def _argmax_only(seq) -> bool:
    """Its rows are read for their argmax alone: greedy, no logprobs, no penalty, no forks drawing
    from its row (the sampler's plain path, a greedy verification)."""
    sp = seq.sampling
    return sp.greedy and sp.logprobs is None and sp.repetition_penalty == 1.0 and not seq.forks


def fill_draft_masks(matcher, draft: tuple[int, ...], parents: tuple[int, ...], bitmask: torch.Tensor,
                     first_row: int) -> list[int]:
    """Fill the masks of a sequence's 1 + len(draft) rows: row 0 for the matcher's state, row i+1
    for the state after the path to draft node i (a chain when `parents` is empty). Returns the
    rows filled (relative); a node whose path the grammar refuses gets none (never accepted)."""
    if matcher.is_terminated():
        return []
    matcher.fill_next_token_bitmask(bitmask, first_row)
    filled = [0]
    for i in range(len(draft)):
        path = draft_tree.path(parents, i) if parents else list(range(i + 1))
        accepted = 0
        for node in path:
            if not matcher.accept_token(int(draft[node])):
                break
            accepted += 1
        if accepted == len(path) and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, first_row + i + 1)
            filled.append(i + 1)
        if accepted:
            matcher.rollback(accepted)
    return filled


def mask_plan(plan, drafts: dict) -> dict:
    """The constrained sequences of a step plan that sample, with their drafts (MaskJob's plan)."""
    jobs = {}
    for chunk in plan.chunks:
        seq = chunk.seq
        if seq.grammar is not None and (chunk.draft or chunk.samples):
            draft = drafts.get(seq)
            jobs[seq] = (seq.grammar, draft.tokens if draft else (), draft.parents if draft else ())
    return jobs


def accept_outputs(appended: dict) -> None:
    """Advance each constrained sequence's matcher past the tokens it just appended
    (sequence -> its new tokens). A refused token means a row went unmasked: logged, never silent."""
    for seq, tokens in appended.items():
        matcher = seq.grammar
        if matcher is None or matcher.is_terminated():
            continue
        for t in tokens:
            if not matcher.accept_token(int(t)):
                log.error("request %s: token %d breaks its %s constraint", seq.request_id, t,
                          seq.sampling.structured.kind.value)
                break
