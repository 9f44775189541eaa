"""The engine's fair share of steps between tenants (cluster/engine/fair_share.py) on a real tiny
model: two tenants' greedy outputs, scheduled in shared steps (small prefill chunks, sequences
skipped in turn, one preempted for a slot), equal those of the same requests from one tenant, and
every block comes back."""
from __future__ import annotations

import torch

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, 300, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(7)]


def _run(model, tenants: list[str]) -> tuple[dict[str, list[int]], int, int]:
    """(outputs by prompt, steps shared between tenants, preemptions)."""
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", deterministic=True, max_model_len=128,
                                    cache=CacheConfig(block_size=4, num_blocks=128),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                                              fair_step_tokens=3)))
    ids, out, shared_steps = {}, {}, 0

    def step() -> None:
        for delta in engine.step():
            out.setdefault(f"r{ids[delta.request_id]}", []).extend(delta.token_ids)
    for i, (prompt, tenant) in enumerate(zip(_prompts(), tenants)):
        ids[engine.add_request(prompt, GREEDY, tenant=tenant)] = i
        if i == 4:       # the last two come once the first four fill the batch
            for _ in range(3):
                step()
    while engine.has_unfinished():
        shared_steps += len(engine.scheduler.fair.deficit) > 1
        step()
    engine.pool.check_idle()
    return out, shared_steps, engine.scheduler.num_preemptions


def test_two_tenants_greedy_outputs_equal_one_tenants(tiny_model_dir):
    model = tiny_model_dir("llama")
    reference, shared, preempted = _run(model, [""] * 7)
    assert shared == 0 and preempted == 0                # one tenant: never shared, nobody preempted
    fair, shared, preempted = _run(model, ["hog"] * 5 + ["victim"] * 2)
    assert shared > 3 and preempted >= 1                 # shared steps, and a slot taken for a victim
    assert fair == reference
    assert all(len(tokens) == GREEDY.max_tokens for tokens in fair.values())
