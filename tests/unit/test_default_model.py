"""The built-in default model (cluster/model/weights/) loads, tokenizes
losslessly and writes Python-looking code. CPU only, a few seconds."""
from __future__ import annotations

import json
import os
import sysconfig

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer  # noqa: E402
from safetensors import safe_open  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WEIGHTS = os.path.join(REPO, "cluster", "model", "weights")
TARGET = "stdlib-coder"
DRAFTS = ("stdlib-coder-draft", "stdlib-coder-draft-nodistill")
NAMES = (TARGET,) + DRAFTS
EOT_ID = 0

TRICKY = [
    "def f(x):\n\treturn x  \r\n",  # tab indent, trailing spaces, CRLF
    "s = 'héllo wörld — ünïcode ✓ 日本語 🐍'\n",
    "\n\n   \t \n\r\r\n  ",
    "x = '\\x00\\u1234'\x0c# form feed and a NUL: \x00\n",
    "   leading spaces and no trailing newline",
    "",
]
STDLIB_FILES = ["os.py", "json/__init__.py", "textwrap.py", "encodings/cp1252.py"]


def _dir(name: str) -> str:
    if name == "stdlib-coder-draft-nodistill":   # a training baseline, kept beside the training code
        return os.path.join(REPO, "bench", "spec_training", "weights", name)
    return os.path.join(WEIGHTS, name)


@pytest.fixture(scope="module")
def models():
    return {n: transformers.AutoModelForCausalLM.from_pretrained(_dir(n)).eval() for n in NAMES}


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(_dir(TARGET))


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_is_complete_bf16_llama(name):
    d = _dir(name)
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "README.md"):
        assert os.path.isfile(os.path.join(d, f)), f
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == EOT_ID
    assert cfg["max_position_embeddings"] >= 2048 and cfg["vocab_size"] == 8192
    gen = json.load(open(os.path.join(d, "generation_config.json")))
    assert gen["eos_token_id"] == gen["bos_token_id"] == EOT_ID
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_all_checkpoints_share_one_tokenizer_and_fit_budget():
    blobs = {open(os.path.join(_dir(n), "tokenizer.json"), "rb").read() for n in NAMES}
    assert len(blobs) == 1
    total = sum(os.path.getsize(os.path.join(_dir(n), "model.safetensors")) for n in NAMES)
    assert total < 40 * 2**20


def test_load_with_transformers(models):
    n_target = sum(p.numel() for p in models[TARGET].parameters())
    assert 10e6 <= n_target <= 30e6
    for d in DRAFTS:
        n_draft = sum(p.numel() for p in models[d].parameters())
        assert n_draft < n_target / 5


@pytest.mark.parametrize("text", TRICKY)
def test_tokenizer_roundtrips_tricky_strings(tok, text):
    raw = Tokenizer.from_file(os.path.join(_dir(TARGET), "tokenizer.json"))
    assert raw.decode(raw.encode(text, add_special_tokens=False).ids,
                      skip_special_tokens=False) == text
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == EOT_ID  # post-processor prepends BOS
    assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("rel", STDLIB_FILES)
def test_tokenizer_roundtrips_stdlib_files(tok, rel):
    path = os.path.join(sysconfig.get_paths()["stdlib"], rel)
    if not os.path.exists(path):
        pytest.skip(f"{rel} not in this Python's stdlib")
    text = open(path, encoding="utf-8", newline="").read()  # keep CRLF if any
    ids = tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode("utf-8")) / 2.5  # BPE actually compresses


def test_greedy_generation_looks_like_python(models, tok):
    ids = tok("def fibonacci(n):", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = models[TARGET].generate(ids, max_new_tokens=64, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    # The shipped target writes an indented method body, roughly:
    #   "\n        # XXX ...\n        if isinstance(self.value):\n ... return self.get_name(..."
    # It is not valid Python (a 12M model trained for 50 CPU-minutes), but a
    # random-init model would not produce indented lines with keywords.
    assert "\n    " in text, text  # at least one indented line
    assert "return" in text or "if " in text, text


# Our loader and engine against transformers, token for token, on these checkpoints:
# tests/integration/test_default_model_engine.py.
