"""Checkpoint tensors are read one at a time, onto the device they go to, when they are taken."""
import pytest
import torch

from cluster.model.loader import LazyCheckpoint, load_model

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_are_read_when_taken_onto_the_device(device, tiny_model_dir):
    ckpt = LazyCheckpoint(tiny_model_dir("llama"), device)
    assert ckpt.reads == 0 and "model.embed_tokens.weight" in ckpt and "nope" not in ckpt
    t = ckpt["model.embed_tokens.weight"]
    assert ckpt.reads == 1 and t.device.type == device
    _, model = load_model(tiny_model_dir("llama"), device=device)
    assert {p.device.type for p in model.parameters()} == {device}
