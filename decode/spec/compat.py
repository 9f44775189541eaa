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


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def read_eagle_config(head_dir: Path) -> dict:
    path = Path(head_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"EAGLE head directory {head_dir} has no config.json")
    raw = json.loads(path.read_text())
    if raw.get("model_type") != "splitserve_eagle":
        raise ValueError(f"{head_dir} is not an EAGLE head (model_type {raw.get('model_type')!r}, "
                         "expected 'splitserve_eagle')")
    return raw


_SHIPPED = ("; the shipped draft model and EAGLE head are stdlib-coder's (--model stdlib-coder): give this model "
            "its own (--draft-model, --eagle-head), or use --speculative ngram")


def check_speculative_models(cfg: EngineConfig, disaggregated: bool) -> None:
    spec = cfg.speculative
    if spec.method in ("off", "ngram", "quantspec"):   # quantspec drafts with the target's own weights
        return
    target = load_model_config(cfg.model)
    if spec.method == "draft":
        draft = load_model_config(spec.draft_dir)
        if draft.vocab_size != target.vocab_size or \
                _sha(spec.draft_dir / "tokenizer.json") != _sha(Path(cfg.model) / "tokenizer.json"):
            raise ValueError(f"draft model {spec.draft_dir} does not share the target's tokenizer "
                             f"({cfg.model}/tokenizer.json): its tokens would mean something else"
                             f"{_SHIPPED if spec.draft_model is None else ''}")
        return
    head = read_eagle_config(spec.eagle_dir)
    if head.get("vocab_size") != target.vocab_size or head.get("hidden_size") != target.hidden_size:
        raise ValueError(f"EAGLE head {spec.eagle_dir} was built for a model with hidden size "
                         f"{head.get('hidden_size')} and vocab {head.get('vocab_size')}, but the target has "
                         f"{target.hidden_size} and {target.vocab_size}{_SHIPPED if spec.eagle_head is None else ''}")
    head_kv = (head.get("num_key_value_heads"), head.get("head_dim"))
    if head_kv != (target.num_kv_heads, target.head_dim):
        where = " and across the P/D handoff" if disaggregated else ""
        raise ValueError(f"EAGLE head {spec.eagle_dir} has KV shape {head_kv} (kv heads, head dim) but the target's "
                         f"is {(target.num_kv_heads, target.head_dim)}: the head's KV rides in the target's KV "
                         f"blocks through the prefix cache{where}, so the shapes must match")
