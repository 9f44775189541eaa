"""Forks: the n samples of one prompt (OpenAI's `n`), computed once.

A request's forks wait on it (`Sequence.forks`) until its prompt's last logits exist; each then
draws its first token from that row beside the parent, with its own generator, and decodes on the
parent's prompt blocks (shared, the partial last block copied: `Scheduler.fork`). On a P/D
producer (`hold_kv`) a fork ends with its first token instead: the hold hook hands it on.
"""
from __future__ import annotations

from cluster.engine.sequence import Sequence
from cluster.types import FinishReason, TokenDelta


def spawn_forks(engine, parents: list[Sequence], forked: dict[Sequence, int]) -> list[TokenDelta]:
    """Before the scheduler's update (which may end a parent and free the blocks its forks are to
    share): each waiting fork of `parents` takes its first token (`forked`). Returns their first
    deltas, to leave after the parents' (which carry the prompt's logprobs)."""
    out = []
    for parent in parents:
        forks, parent.forks = parent.forks, []
        for fork in forks:
            if not fork.is_finished:
                delta = _spawn(engine, parent, fork, forked[fork])
                if delta is not None:
                    out.append(delta)
    return out


def _spawn(engine, parent: Sequence, fork: Sequence, token: int) -> TokenDelta | None:
    scheduler = engine.scheduler
    fork.token_ids.append(token)
    reason = scheduler.stop_reason(fork, token)
    if reason is not None:
        scheduler.finish(fork, reason)
    elif not parent.hold_kv and not scheduler.fork(parent, fork, parent.num_prompt_tokens,
                                                   engine.kv_cache.copy_block):
        scheduler.add(fork)   # no block free for its copy: it computes the prompt itself
    delta = engine.requests.delta(fork, [token])      # a stop string in its text ends it here
    if not parent.hold_kv:
        return delta
    if not delta.finished:                  # it goes on elsewhere: drop its state here
        scheduler.finish(fork, FinishReason.LENGTH)
        engine.requests.finish(fork, (), "")
    engine.hold_hook.fork_first(parent.request_id, delta)
    return None
