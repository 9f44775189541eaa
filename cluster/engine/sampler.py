"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, logprobs.

Each sampled row draws its randomness from its request's own generator, so a seeded request
produces the same tokens whatever else shares its batch. The draw is an exponential race
(argmax of p / E with E ~ Exp(1)), which samples exactly from p with one vector of noise.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from cluster.engine.sequence import Sequence
from cluster.types import SamplingParams, TokenLogprob


def apply_repetition_penalty(row: torch.Tensor, token_ids: Seq[int], penalty: float) -> torch.Tensor:
    """transformers' rule: divide positive logits of seen tokens by the penalty, multiply negative ones."""
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=row.device)
    seen = row.index_select(0, ids)
    row = row.clone()
    row.index_copy_(0, ids, torch.where(seen < 0, seen * penalty, seen / penalty))
    return row


_SERIAL = 32768   # torch's grain size: shorter reductions run on one thread


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D tensor in an order that never depends on torch's thread count (a long
    reduction is otherwise split between threads, so a prefill and a decode worker with different
    thread counts would round the same row's normaliser differently): fixed chunks of 1024, each
    summed by one thread, then the chunk sums."""
    n = x.shape[0]
    if n < _SERIAL:
        return x.sum()
    return torch.nn.functional.pad(x, (0, -n % 1024)).view(-1, 1024).sum(-1).sum()


def warp_probs(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to one row of fp32 logits; returns probabilities."""
    row = row / sp.temperature
    if sp.top_k and sp.top_k < row.shape[-1]:
        kth = torch.topk(row, sp.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (torch.cumsum(sorted_p, 0) - sorted_p) >= sp.top_p
        probs = probs.masked_fill(drop_sorted.scatter(0, order, drop_sorted), 0.0)
    if sp.min_p > 0.0:
        probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
    return probs / ordered_sum(probs)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The exponential race on the probabilities' device; the token as a 0-d tensor (no sync)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / noise)


def sample_row(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(draw(probs, generator))


def logprob_entry(logprobs_row: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        values, ids = torch.topk(logprobs_row, top_n)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logprobs_row[token]), top=top)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Pick one token per row of `logits` [len(seqs), vocab]; records logprobs on the sequences."""
    plain = all(s.sampling.greedy and s.sampling.repetition_penalty == 1.0 and s.sampling.logprobs is None
                for s in seqs)
    if plain:
        return torch.argmax(logits, dim=-1).tolist()
    picks = []   # 0-d device tensors: the rows' tokens come to the host in one copy, not one sync per row
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        row = logits[i]
        if sp.repetition_penalty != 1.0:
            seen = seq.token_ids if sp.penalize_prompt else seq.output_token_ids
            row = apply_repetition_penalty(row, seen, sp.repetition_penalty)
        picks.append(torch.argmax(row) if sp.greedy else draw(warp_probs(row, sp), seq.generator))
    tokens = torch.stack(picks).tolist()
    for i, (seq, token) in enumerate(zip(seqs, tokens)):
        if seq.sampling.logprobs is not None:
            # Logprobs of the model's own distribution (before penalties and warping), as vLLM reports.
            seq.logprobs.append(logprob_entry(torch.log_softmax(logits[i], dim=-1), token, seq.sampling.logprobs))
    return tokens


def record_prompt_logprobs(prompt_logits) -> None:
    """The runner's prompt logits (seq, first position, rows) as each prompt token's logprob: the
    row at position p scores token p + 1. A position already scored (a request recomputed after
    preemption) is not scored twice."""
    for seq, first, rows in prompt_logits:
        lps = torch.log_softmax(rows, dim=-1)
        for i in range(rows.shape[0]):
            if first + i == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(logprob_entry(lps[i], seq.prompt_token_ids[first + i + 1],
                                                         seq.sampling.prompt_logprobs))
