import math

import pytest
import torch

from cluster.engine.sampler import apply_repetition_penalty, sample, warp_probs
from cluster.engine.sequence import Sequence
from cluster.types import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"seed": -1}, "seed"),
    ({"stop": ("",)}, "stop"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_top_p_min_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]))
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (p > 0).tolist() == [True, True, False, False, False]
    p = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))   # 0.5 + 0.25 reaches 0.75
    assert (p > 0).tolist() == [True, True, False, False, False]
    p = warp_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))    # keep p >= 0.1
    assert (p > 0).tolist() == [True, True, True, False, False]
    assert torch.isclose(p.sum(), torch.tensor(1.0))


def test_repetition_penalty_follows_transformers_rule():
    row = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(row, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_the_penalty_counts_the_prompt_unless_asked_for_the_output_only():
    """transformers' and vLLM's rule counts the prompt's tokens; `penalize_prompt=False` (what
    `chat` sends) counts only the output's, so a question's own words stay as likely as before."""
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.5]] * 2)
    everything = Sequence("a", (0,), SamplingParams(repetition_penalty=2.0), token_ids=[0, 2])
    answer_only = Sequence("b", (0,), SamplingParams(repetition_penalty=2.0, penalize_prompt=False), token_ids=[0, 2])
    assert sample(logits, [everything, answer_only]) == [1, 0]   # token 0 is the prompt's, token 2 the output's
    assert SamplingParams().penalize_prompt is True
