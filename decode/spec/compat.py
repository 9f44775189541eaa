"""Checks that a speculative setup can work, from config files alone (before any model loads).

A draft model must share the target's tokenizer. An EAGLE head reads the target's hidden states
and keeps its KV in the target's own KV blocks (as one more layer), which is how its state crosses
the P/D handoff and the prefix cache; so its hidden size and KV shape must equal the target's.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cluster.config import EngineConfig
from cluster.model.model_config import load_model_config
from decode.spec.mtp import check_mtp


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def weights_fingerprint(model_dir: Path) -> str:
    """What a draft head records of the weights it was trained on, so that a head trained for other
    weights (a fine-tune, a new release) is refused instead of silently drafting badly: a GGUF's
    sha256 for a converted GGUF directory, else the sha256 of the safetensors files' bytes (cached
    under ~/.cache/splitserve by path, size and mtime: 0.5 GB hashes in seconds)."""
    model_dir = Path(model_dir)
    source = model_dir / "gguf_source.json"
    if source.is_file():
        return "gguf-sha256:" + json.loads(source.read_text())["sha256"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no safetensors weights to fingerprint")
    key = hashlib.sha256(repr([(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns)
                               for f in files]).encode()).hexdigest()[:32]
    cache = Path.home() / ".cache" / "splitserve" / "fingerprints" / key
    if cache.is_file():
        return cache.read_text()
    digest = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    value = "safetensors-sha256:" + digest.hexdigest()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(value)
    return value


def read_eagle_config(head_dir: Path) -> dict:
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"EAGLE head directory {head_dir} has no config.json")
    raw = json.loads(path.read_text())
    if raw.get("model_type") not in EAGLE_MODEL_TYPES:
        raise ValueError(f"{head_dir} is not an EAGLE head (model_type {raw.get('model_type')!r}, "
                         f"expected one of {', '.join(EAGLE_MODEL_TYPES)})")
    return raw


EAGLE_MODEL_TYPES = ("splitserve_eagle", "splitserve_eagle3")


def is_eagle3(raw: dict) -> bool:
    return raw.get("model_type") == "splitserve_eagle3"


def _check_head_target(head_dir: Path, head: dict, model: Path, num_layers: int) -> None:
    """A head is trained on one set of target weights: a fine-tune or a new release of the same
    architecture would keep every shape and silently lose the acceptance (the trackers' "drafts
    that go stale after a weight update"), so a recorded fingerprint must match."""
    recorded = head.get("target_fingerprint")
    if recorded:
        actual = weights_fingerprint(Path(model))
        if actual != recorded:
            raise ValueError(f"EAGLE head {head_dir} was trained for other weights ({head.get('target_model')}, "
                             f"{recorded}) than the target's ({model}, {actual}); train a head for these weights "
                             f"(bench/spec_training/README.md) or use --speculative ngram or quantspec")
    layers = head.get("feature_layers", ())
    if is_eagle3(head) and (len(layers) != 3 or not all(0 <= i < num_layers for i in layers)
                            or list(layers) != sorted(set(layers))):
        raise ValueError(f"EAGLE head {head_dir} reads the outputs of layers {layers}, but the target has "
                         f"{num_layers} layers (three distinct layers, in ascending order)")


_SHIPPED = ("; the shipped EAGLE heads are stdlib-coder's and the default model's, and the shipped draft model is "
            "stdlib-coder's: give this model its own (--draft-model, --eagle-head), or use --speculative ngram")


def check_speculative_models(cfg: EngineConfig, disaggregated: bool) -> None:
    spec = cfg.speculative
    if spec.method in ("off", "ngram", "jacobi", "quantspec"):   # model-free, or the target's own weights
        return
    target = load_model_config(cfg.model)
    if target.mla is not None and spec.method in ("eagle", "block"):
        raise ValueError(f"--speculative {spec.method} is not supported with latent attention (MLA, DeepSeek): "
                         "its head's KV and features assume per-head K/V; use --speculative mtp or ngram")
    if spec.method == "mtp":
        check_mtp(target, Path(cfg.model))
        return
    if spec.method == "block":
        _check_block_drafter(spec.block_dir_for(), cfg.model, target, explicit=spec.block_drafter is not None)
        return
    if spec.method == "draft":
        draft = load_model_config(spec.draft_dir)
        if draft.vocab_size != target.vocab_size or \
                _sha(spec.draft_dir / "tokenizer.json") != _sha(Path(cfg.model) / "tokenizer.json"):
            raise ValueError(f"draft model {spec.draft_dir} does not share the target's tokenizer "
                             f"({cfg.model}/tokenizer.json): its tokens would mean something else"
                             f"{_SHIPPED if spec.draft_model is None else ''}")
        return
    head_dir = spec.eagle_dir_for(cfg.model)
    head = read_eagle_config(head_dir)
    if head.get("vocab_size") != target.vocab_size or head.get("hidden_size") != target.hidden_size:
        raise ValueError(f"EAGLE head {head_dir} was built for a model with hidden size "
                         f"{head.get('hidden_size')} and vocab {head.get('vocab_size')}, but the target has "
                         f"{target.hidden_size} and {target.vocab_size}{_SHIPPED if spec.eagle_head is None else ''}")
    head_kv = (head.get("num_key_value_heads"), head.get("head_dim"))
    if head_kv != (target.num_kv_heads, target.head_dim):
        where = " and across the P/D handoff" if disaggregated else ""
        raise ValueError(f"EAGLE head {head_dir} has KV shape {head_kv} (kv heads, head dim) but the target's "
                         f"is {(target.num_kv_heads, target.head_dim)}: the head's KV rides in the target's KV "
                         f"blocks through the prefix cache{where}, so the shapes must match")
    _check_head_target(head_dir, head, cfg.model, target.num_layers)


BLOCK_MODEL_TYPE = "splitserve_block"


def read_block_config(drafter_dir: Path) -> dict:
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"block drafter directory {drafter_dir} has no config.json")
    raw = json.loads(path.read_text())
    if raw.get("model_type") != BLOCK_MODEL_TYPE:
        raise ValueError(f"{drafter_dir} is not a block drafter (model_type {raw.get('model_type')!r}, "
                         f"expected {BLOCK_MODEL_TYPE!r})")
    return raw


def _check_block_drafter(drafter_dir: Path, model: Path, target, explicit: bool) -> None:
    """The drafter reads the target's features (three depths), embeddings and LM-head rows: its
    sizes, layers and the weights it was trained on must be the target's."""
    raw = read_block_config(drafter_dir)
    shipped = "" if explicit else ("; the shipped block drafter is the default model's: train one for this model "
                                   "(bench/spec_training/train_block.py, --block-drafter) or use --speculative ngram")
    if raw.get("vocab_size") != target.vocab_size or raw.get("hidden_size") != target.hidden_size:
        raise ValueError(f"block drafter {drafter_dir} was built for a model with hidden size {raw.get('hidden_size')} "
                         f"and vocab {raw.get('vocab_size')}, but the target has {target.hidden_size} and "
                         f"{target.vocab_size}{shipped}")
    layers = raw.get("feature_layers", ())
    if len(layers) != 3 or not all(0 <= i < target.num_layers for i in layers) or list(layers) != sorted(set(layers)):
        raise ValueError(f"block drafter {drafter_dir} reads the outputs of layers {layers}, but the target has "
                         f"{target.num_layers} layers (three distinct layers, in ascending order)")
    recorded = raw.get("target_fingerprint")
    if recorded:
        actual = weights_fingerprint(Path(model))
        if actual != recorded:
            raise ValueError(f"block drafter {drafter_dir} was trained for other weights ({raw.get('target_model')}, "
                             f"{recorded}) than the target's ({model}, {actual}){shipped}")
