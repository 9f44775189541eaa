"""The decode side of a P/D handoff: a sequence whose prompt KV was pulled into this engine's
blocks (decode/worker.py runs the pull over cluster/transfer/consumer.py) joins the batch here,
with its forks (more samples of the prompt) on the same blocks.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

from cluster.engine.engine import LLMEngine
from cluster.engine.sequence import Sequence
from cluster.types import Fork, SamplingParams


def add_prefilled(e: LLMEngine, request_id: str, prompt_ids: Seq[int], first_token: int,
                  sampling: SamplingParams, block_ids: Seq[int], feature: bytes = b"",
                  forks: Seq[Fork] = (), tenant: str = "") -> None:
    """Join a sequence whose prompt KV already sits in `block_ids` (taken from the engine's pool
    and filled by a transfer) and whose first token was sampled elsewhere. It decodes from its
    second token on, waiting with its blocks while the pool is full; if it is ever preempted, or
    its KV is discarded to avoid a deadlock, it is recomputed here. `forks` (their `first_token`
    set): more samples of the prompt, on the same blocks. `feature`: the proposer state the
    producer exported beside the blocks (`Speculator.export_state`; with an EAGLE head the
    target's hidden state at the prompt's last position), checked by this engine's speculator."""
    ids = e.validate_prompt(list(prompt_ids))
    if any(f.first_token is None for f in forks):
        raise ValueError("a handed-off fork needs the first token its producer drew")
    for sp in (sampling, *(f.sampling for f in forks)):
        e.validate_speculation(sp)
    e.requests.check_free([request_id, *(f.request_id for f in forks)])
    need = -(-len(ids) // e.layout.block_size)
    if len(block_ids) != need:
        raise ValueError(f"{len(ids)} prompt tokens need {need} blocks, got {len(block_ids)}")
    spec_state = e.speculator.import_state(feature, len(ids)) if e.speculator is not None else None
    lead = _prefilled_sequence(e, request_id, ids, sampling, first_token, spec_state, tenant)
    lead.block_ids, lead.num_computed_tokens = list(block_ids), len(ids)
    e.scheduler.add(lead)
    for fork in forks:
        child = _prefilled_sequence(e, fork.request_id, ids, fork.sampling, fork.first_token, spec_state, tenant)
        if not e.scheduler.fork(lead, child, len(ids), e.kv_cache.copy_block):
            e.scheduler.add(child)      # no block for its copy: it computes the prompt itself


def _prefilled_sequence(e: LLMEngine, request_id: str, ids: list[int], sampling: SamplingParams,
                        first_token: int, spec_state: object | None, tenant: str) -> Sequence:
    # Its prompt (and prompt logprobs) were computed by the producer.
    seq = e.new_sequence(request_id, ids, sampling, token_ids=[*ids, int(first_token)], prompt_logprobs_sent=True,
                         spec_state=spec_state, tenant=tenant)
    if not sampling.greedy and seq.generator is not None:
        # The producer drew the first token from the same seed: skip that draw so a seeded
        # request samples the same tokens as it would in one engine.
        e.skip_draws(seq.generator, 1)
    # Replays the producer's text state; its text was streamed there.
    e.requests.detok[request_id].add([int(first_token)])
    return seq
