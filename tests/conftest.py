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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: a tiny checkpoint of the given kind, built once per session."""
    cache = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = make_model(tmp_path_factory.mktemp(kind), kind)
        return cache[kind]
    return get


def pytest_sessionfinish(session, exitstatus):
    """The session's shared Ray (tests/e2e/cluster_harness.py), ended here rather than at exit."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
