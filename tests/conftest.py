import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's default model is the small built-in one (12.6M parameters, with drafts for
# speculation); the real default, SmolLM2-135M-Instruct, is served by the tests that name it.
os.environ.setdefault("SPLITSERVE_MODEL", "stdlib-coder")

from tiny_models import make_model  # noqa: E402
from session_ray import stop_session_ray  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: a tiny checkpoint of the given kind, built once per session."""
    cache = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = make_model(tmp_path_factory.mktemp(kind), kind)
        return cache[kind]
    return get


@pytest.fixture(scope="session")
def single_engine():
    """Factory: the single engine a test compares a cluster (or another engine) with, built once
    per engine config and speculator factory for the session. Greedy and seeded outputs do not
    depend on what the engine ran before, so tests share it."""
    from cluster.engine.engine import LLMEngine
    engines = {}

    def get(config, speculator_factory=None):
        key = (config, speculator_factory)
        if key not in engines:
            engines[key] = LLMEngine(config, speculator_factory=speculator_factory)
        return engines[key]
    return get


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dir):
    """(greedy tokens, their log-probabilities) from transformers' generate, per (kind, prompt),
    for the session: the engine's, the Triton kernels' and the cluster's family tests share it."""
    import torch
    import transformers
    models, cache = {}, {}

    def ref(kind: str, prompt: list[int], max_tokens: int = 16) -> tuple[list[int], list[float]]:
        key = (kind, tuple(prompt), max_tokens)
        if key not in cache:
            if kind not in models:
                models[kind] = transformers.AutoModelForCausalLM.from_pretrained(
                    tiny_model_dir(kind), dtype=torch.float32).eval()
            out = models[kind].generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                        output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
            cache[key] = tokens, logprobs
        return cache[key]
    return ref


def pytest_runtest_setup(item):
    """The session's shared Ray (tests/session_ray.py) is ended before a test that is not
    marked `ray`: its idle processes need not share the cores with in-process tests (the next
    cluster starts it again)."""
    if "ray" not in item.keywords:
        stop_session_ray()


def pytest_sessionfinish(session, exitstatus):
    """... and at the session's end rather than at exit."""
    stop_session_ray()
