"""GGUF files (llama.cpp's format) as Hugging Face model directories.

A GGUF file holds the config (metadata), the tensors (often quantized: Q4_0, Q4_1, Q8_0, ...)
and the tokenizer with its chat template. `hf_dir_for(path)` converts it once into a Hugging Face
directory that everything else serves as it serves any checkpoint (and that transformers and vLLM
load too: `splitserve export-hf`):

  config.json              from the `llama.*` metadata (GGUF's "llama" architecture)
  model.safetensors        every tensor dequantized to float32 by the `gguf` library, with the
                           row permutation llama.cpp applies to Q and K undone
  tokenizer.json, ...      transformers' GGUF tokenizer converter (its vocab, merges, special
                           tokens), chat_template.jinja from the file
  gguf_source.json         the file it came from and its hash: [quant] serves the quantized
                           tensors from there without dequantizing

Converting takes seconds (reading 49k vocab entries, dequantizing): the result is cached under
`cache_dir()/gguf/<sha256 of the file>/`, written to a temporary directory and renamed into place
(atomic: a crash leaves no half-written model), and reused on every later start.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1        # part of the cache key: a fix to the conversion makes new directories
# llama.cpp writes Mistral and Llama 2/3 checkpoints (and SmolLM2) as "llama"; other GGUF
# architectures (qwen2, qwen3, gemma3, phi3: served here from Hugging Face directories) are refused
# until a test holds their conversion to transformers' own GGUF loader.
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def hf_dir_for(gguf_path: Path, cache_root: Path) -> Path:
    """The Hugging Face directory converted from `gguf_path` (made on first use, then cached)."""
    gguf_path = Path(gguf_path).resolve()
    digest = file_hash(gguf_path)
    final = cache_root / "gguf" / f"{digest[:24]}-v{CONVERTER_VERSION}" / gguf_path.stem
    if (final / "gguf_source.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=final.parent))
    try:
        log.info("converting %s to a Hugging Face directory (once; cached in %s)", gguf_path.name, final,
                 extra={"phase": f"converting {gguf_path.name} (first start only)"})
        export_hf(gguf_path, tmp, digest)
        try:
            os.rename(tmp, final)          # atomic; another process may have won the race
        except OSError:
            if not (final / "gguf_source.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def export_hf(gguf_path: Path, out_dir: Path, digest: str | None = None) -> Path:
    """Write the Hugging Face directory of `gguf_path` into `out_dir` (which may exist, empty)."""
    reader = GGUFReader(str(gguf_path))
    meta = _Metadata(reader)
    config = hf_config(meta)
    tensors = {name: torch.from_numpy(np.require(t, requirements=["C", "W"]))    # a memory-mapped view is read-only
               for name, t in hf_tensors(reader, config).items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], **sampling_defaults(meta)},
        indent=1))
    _write_tokenizer(gguf_path, out_dir)
    (out_dir / "gguf_source.json").write_text(json.dumps(
        {"gguf": str(Path(gguf_path).resolve()), "sha256": digest or file_hash(gguf_path),
         "converter_version": CONVERTER_VERSION,
         "tensor_types": sorted({t.tensor_type.name for t in reader.tensors})}, indent=1))
    return out_dir


class _Metadata:
    """GGUF key-value metadata as Python values."""

    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        if field is None or not field.data:
            return default
        if field.types[0].name == "STRING":
            return bytes(field.parts[field.data[0]]).decode()
        if field.types[0].name == "ARRAY":
            return [field.parts[i].tolist()[0] for i in field.data]
        return field.parts[field.data[0]].tolist()[0]


# The sampling a GGUF file's author recommends (llama.cpp's general.sampling.* keys), as
# generation_config.json names it: `chat` and `serve --request` sample so (cluster/launch/chat_sampling.py).
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def sampling_defaults(meta: _Metadata) -> dict:
    return {hf: meta.get(key) for key, hf in GGUF_SAMPLING_KEYS.items() if meta.get(key) is not None}


def hf_config(meta: _Metadata) -> dict:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not served here; supported: {', '.join(ARCHITECTURES)}")
    p = f"{arch}."
    heads = meta.get(p + "attention.head_count")
    hidden = meta.get(p + "embedding_length")
    head_dim = meta.get(p + "attention.key_length") or meta.get(p + "rope.dimension_count") or hidden // heads
    if meta.get(p + "rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {meta.get(p + 'rope.scaling.type')!r} is not supported")
    vocab = meta.get(p + "vocab_size") or len(meta.get("tokenizer.ggml.tokens"))
    return {"architectures": [ARCHITECTURES[arch]], "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": meta.get(p + "feed_forward_length"), "num_hidden_layers": meta.get(p + "block_count"),
            "num_attention_heads": heads, "num_key_value_heads": meta.get(p + "attention.head_count_kv", heads),
            "head_dim": head_dim, "rms_norm_eps": meta.get(p + "attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": meta.get(p + "context_length"), "rope_theta": meta.get(p + "rope.freq_base",
                                                                                              10000.0),
            "hidden_act": "silu", "tie_word_embeddings": None,   # decided by whether output.weight exists
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32"}


def hf_tensors(reader, config: dict) -> dict[str, np.ndarray]:
    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape.tolist())])   # GGUF lists dims fastest first
        if name.endswith("q_proj.weight"):
            w = unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, config["num_key_value_heads"])
        out[name] = w
    config["tie_word_embeddings"] = "lm_head.weight" not in out
    return out


def hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")        # kind: weight | bias
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: its converter interleaves the two rotary halves of every
    head ([h, 2, d/2] -> [h, d/2, 2]) for its own RoPE kernel; ours expects Hugging Face's halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Through transformers' GGUF tokenizer converter: vocab, merges, special tokens, template."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - transformers is heavy: only when a file is converted
    tok = AutoTokenizer.from_pretrained(str(Path(gguf_path).parent), gguf_file=Path(gguf_path).name)
    tok.save_pretrained(str(out_dir))
