"""Training text for the default model's draft heads: chat prompts built from what lies on this
machine, answered by the target itself, greedily, through our own engine.

A draft head serves the target's own output, so it learns best from the target's answers (the
EAGLE papers regenerate their chat data with the target for the same reason). The prompts come
from three local sources, nothing downloaded:
 - the Python standard library: functions with docstrings ("What does `json.dumps` do?", "Write
   a Python function that ...", "Explain this code: ..."), files split as in corpus.py;
 - Python's own documentation topics (`pydoc_data.topics`): summaries and explanations;
 - the packages' documentation under /usr/share/doc (README and changelog paragraphs).

A prompt is held out iff sha1(its source key) % 10 == 0: held-out prompts are never trained on,
and the benches draw their "unseen prompts" from them (`heldout_prompts`).

    python -m bench.spec_training.smollm_data --out /tmp/ss-eagle3/answers.jsonl --limit 3000
"""
from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.spec_training.corpus import iter_stdlib_files, stdlib_root
from decode.spec.heads.eagle3 import eagle3_feature_layers


@dataclass(frozen=True)
class Prompt:
    key: str       # the source it came from: the held-out split hashes it
    text: str      # the user message

    @property
    def heldout(self) -> bool:
        return int(hashlib.sha1(self.key.encode()).hexdigest(), 16) % 10 == 0


def _functions(path: str, rel: str):
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    source = Path(path).read_text(encoding="utf-8").splitlines()
    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= 4:
                body = "\n".join(source[node.lineno - 1:min(node.end_lineno, node.lineno + 30)])
                yield module, node.name, doc.strip().splitlines()[0].strip(), body


def stdlib_prompts() -> list[Prompt]:
    out = []
    for f in iter_stdlib_files():
        for module, name, first, body in _functions(os.path.join(stdlib_root(), f.relpath), f.relpath):
            key = f"stdlib:{module}.{name}"
            out.append(Prompt(key + ":what", f"What does the Python function `{module}.{name}` do?"))
            out.append(Prompt(key + ":write", f"Write a Python function `{name}`: {first}"))
            out.append(Prompt(key + ":explain", f"Explain this code:\n```python\n{body}\n```"))
    return out


def _paragraphs(text: str, lo: int = 200, hi: int = 900) -> list[str]:
    paras = [p.strip() for p in text.split("\n\n")]
    return [p for p in paras if lo <= len(p) <= hi]


def pydoc_prompts() -> list[Prompt]:
    from pydoc_data.topics import topics   # noqa: PLC0415
    out = []
    for name, text in sorted(topics.items()):
        out.append(Prompt(f"pydoc:{name}", f"Explain `{name}` in Python, with an example."))
        for i, p in enumerate(_paragraphs(text)):
            out.append(Prompt(f"pydoc:{name}:{i}", f"Summarize this passage of the Python documentation:\n\n{p}"))
    return out


def usr_doc_prompts(root: str = "/usr/share/doc") -> list[Prompt]:
    out = []
    for path in sorted(Path(root).glob("*/*")):
        if not path.is_file() or path.stat().st_size > 200_000 or not path.name.lower().startswith(("readme", "changelog", "news")):
            continue
        raw = path.read_bytes()
        try:
            text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for i, p in enumerate(_paragraphs(text)[:1]):
            out.append(Prompt(f"doc:{path.parent.name}:{path.name}:{i}", f"What does this text say? Answer briefly.\n\n{p}"))
    return out


def all_prompts(seed: int = 0) -> list[Prompt]:
    prompts = stdlib_prompts() + pydoc_prompts() + usr_doc_prompts()
    random.Random(seed).shuffle(prompts)
    return prompts


def heldout_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """n held-out prompts, mixed across the sources (the benches' unseen prompts)."""
    return [p for p in all_prompts(seed) if p.heldout][:n]


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


class FeatureTap:
    """The engine's hidden hook while it answers: each sequence's features at every position it
    computes (the outputs of `layers`, side by side, bf16), so training needs no second pass of
    the target. Greedy answers make the labels free: the token after position j is the target's
    argmax there."""

    def __init__(self, engine, layers: tuple[int, ...]):
        self.rows: dict[str, dict[int, "torch.Tensor"]] = {}
        engine.runner.hidden_hook = self.after_forward
        engine.runner.hidden_layers = layers

    def after_forward(self, plan, ids, positions, hidden, meta) -> None:
        offset = 0
        for chunk in plan.chunks:
            rows = self.rows.setdefault(chunk.seq.request_id, {})
            for i in range(chunk.num_tokens):
                rows[chunk.start + i] = hidden[offset + i].to(torch.bfloat16)
            offset += chunk.num_tokens

    def take(self, request_id: str, length: int) -> "torch.Tensor":
        rows = self.rows.pop(request_id)
        return torch.stack([rows[p] for p in range(length)])


def generate(out: Path, limit: int, new_tokens: int, batch: int, threads: int, dtype: str) -> None:
    from transformers import AutoTokenizer   # noqa: PLC0415

    from cluster.config import CacheConfig, EngineConfig, default_model_dir   # noqa: PLC0415
    from cluster.engine.engine import LLMEngine   # noqa: PLC0415
    from cluster.types import SamplingParams   # noqa: PLC0415
    model = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model)
    # No prefix caching: the tap needs every position computed (the system prompt is shared).
    engine = LLMEngine(EngineConfig(model=model, num_threads=threads, dtype=dtype,
                                    cache=CacheConfig(enable_prefix_caching=False)))
    layers = eagle3_feature_layers(engine.model_config.num_layers)
    tap = FeatureTap(engine, layers)
    shards = out.with_suffix(".features")
    shards.mkdir(exist_ok=True)
    train = [p for p in all_prompts() if not p.heldout][:limit]
    done = set()
    if out.exists():
        done = {json.loads(line)["key"] for line in out.open()}
    todo = [p for p in train if p.key not in done]
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    t0, produced = time.time(), 0
    with out.open("a") as f:
        for i in range(0, len(todo), batch):
            group = todo[i:i + batch]
            prompts, ids = {}, {}
            for p in group:   # the chat template rendered once a prompt
                prompt_ids = chat_ids(tok, p.text)[:768]
                rid = engine.add_request(prompt_ids, sp)
                prompts[rid], ids[rid] = p, prompt_ids
            answers = {rid: [] for rid in prompts}
            while engine.has_unfinished():
                for d in engine.step():
                    answers[d.request_id].extend(d.token_ids)
            shard = []
            for rid, p in prompts.items():
                produced += len(answers[rid])
                # The last answer token was sampled, never fed back: features stop one short.
                full = ids[rid] + answers[rid][:-1]
                shard.append({"key": p.key, "tokens": torch.tensor(ids[rid] + answers[rid], dtype=torch.int32),
                              "prompt_len": len(ids[rid]), "feats": tap.take(rid, len(full))})
            torch.save({"layers": layers, "target": str(model), "seqs": shard}, shards / f"{len(done) + i:06d}.pt")
            for rid, p in prompts.items():
                f.write(json.dumps({"key": p.key, "prompt": ids[rid], "answer": answers[rid]}) + "\n")
            f.flush()
            print(f"{len(done) + i + len(group)}/{len(train)} prompts, {produced} tokens, "
                  f"{produced / (time.time() - t0):.0f} tok/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="a JSONL file (appended to: a rerun resumes)")
    ap.add_argument("--limit", type=int, default=3000, help="training prompts to answer")
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--count", action="store_true", help="print the prompt counts per source and split")
    a = ap.parse_args()
    if a.count:
        ps = all_prompts()
        for src in ("stdlib", "pydoc", "doc"):
            sel = [p for p in ps if p.key.startswith(src + ":")]
            print(src, len(sel), "held out", sum(p.heldout for p in sel))
        return
    a.out.parent.mkdir(parents=True, exist_ok=True)
    generate(a.out, a.limit, a.new_tokens, a.batch, a.threads, a.dtype)


if __name__ == "__main__":
    main()
