"""Ray GPU placement: a CUDA engine asks Ray for a GPU per worker by default (Ray then sets each
actor's CUDA_VISIBLE_DEVICES; without a GPU request every worker would run on cuda:0), a fraction
shares one on purpose, and contradictory settings fail before anything starts."""
import pytest

from cluster.launch.app import ClusterConfig, gpus_per_worker
from cluster.config import EngineConfig


def _cfg(device="cpu", gpus=None):
    return ClusterConfig(engine=EngineConfig(device=device), worker_gpus=gpus)


def test_defaults_follow_the_device():
    assert gpus_per_worker(_cfg("cpu")) == 0.0
    assert gpus_per_worker(_cfg("cuda")) == 1.0


def test_a_fraction_shares_a_gpu_on_purpose():
    assert gpus_per_worker(_cfg("cuda", 0.5)) == 0.5


@pytest.mark.parametrize("device,gpus,message", [
    ("cuda", 0.0, "needs --worker-gpus above 0"),
    ("cuda:1", None, "give --device cuda"),
    ("cpu", -1.0, "worker_gpus must be >= 0"),
])
def test_contradictions_are_refused(device, gpus, message):
    with pytest.raises(ValueError, match=message):
        gpus_per_worker(_cfg(device, gpus))
