"""The shipped default model through our loader and engine: token for token equal to transformers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.config import STDLIB_CODER_DIR, CacheConfig, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:\n    def __init__(self", "for i in range(10):\n"]


# The data-only draft is a training baseline (bench/spec_training/weights/), not shipped, but it
# is still a checkpoint our engine must read like transformers does.
NODISTILL = Path(__file__).resolve().parents[2] / "bench" / "spec_training" / "weights" / "stdlib-coder-draft-nodistill"


@pytest.mark.parametrize("model_dir", [STDLIB_CODER_DIR, STDLIB_CODER_DIR.parent / "stdlib-coder-draft", NODISTILL],
                         ids=lambda p: p.name)
def test_shipped_checkpoint_greedy_matches_transformers(model_dir):
    import transformers
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", cache=CacheConfig(num_blocks=64)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=24))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert list(out.prompt_token_ids) == ids[0].tolist()       # same tokenization, BOS included
        ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        assert list(out.token_ids) == ref, prompt
        assert out.text == tok.decode(ref, skip_special_tokens=True)
    engine.pool.check_idle()


def test_default_model_is_what_the_cli_uses():
    from cluster.config import EngineConfig as Cfg
    assert Cfg().model == STDLIB_CODER_DIR and (STDLIB_CODER_DIR / "config.json").is_file()
