import math

import pytest
import torch

from cluster.engine.sampler import apply_repetition_penalty, warp_probs
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
