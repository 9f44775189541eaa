"""Skill routing's accuracy on held-out prompts (code vs chat), for the two classifiers the issue
weighs (docs/models.md):

  bayes      router/skills.py's naive Bayes over words and symbols, trained from the routes' examples
             and skills (what `model: "auto"` uses)
  embedding  nearest example (cosine) in an embedding a served model computes: the mean of its
             last hidden states over the prompt (transformers on the served weights: what a worker
             would compute), with each served model as the embedder in turn

Routes: bench/skill_routing/routes.yaml; held-out prompts: bench/skill_routing/heldout.yaml (none of
them among the examples). Prints accuracy per label, the misrouted prompts, and the time per
prompt (the embedding's is a forward pass on CPU; the router's budget is microseconds).

  python bench/skill_routing.py [--no-embedding]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cluster.config import STDLIB_CODER_DIR, default_model_dir  # noqa: E402
from router.skills import SkillClassifier, load_skill_routes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_compare import busy_s  # noqa: E402

HERE = Path(__file__).resolve().parent / "skill_routing"
LABELS = {"code": "stdlib-coder", "chat": "SmolLM2-135M-Instruct.Q4_1"}


def heldout() -> list[tuple[str, str]]:
    data = yaml.safe_load((HERE / "heldout.yaml").read_text())
    return [(prompt, LABELS[label]) for label, prompts in data.items() for prompt in prompts]


def report(name: str, choose, cases: list[tuple[str, str]]) -> float:
    start = time.perf_counter()
    got = [choose(prompt) for prompt, _ in cases]
    per_prompt_ms = (time.perf_counter() - start) / len(cases) * 1e3
    right = sum(g == want for g, (_, want) in zip(got, cases))
    by_label = {want: sum(g == w for g, (_, w) in zip(got, cases) if w == want) for want in LABELS.values()}
    counts = {want: sum(w == want for _, w in cases) for want in LABELS.values()}
    print(f"{name:36s} {right}/{len(cases)} = {right / len(cases):.0%}  "
          + "  ".join(f"{m}: {by_label[m]}/{counts[m]}" for m in counts) + f"  ({per_prompt_ms:.3f} ms/prompt)")
    for g, (prompt, want) in zip(got, cases):
        if g != want:
            print(f"    misrouted to {g}: {prompt!r}")
    return right / len(cases)


def embedder(model_dir: Path):
    """The mean of the model's last hidden states over a prompt's tokens, normalized."""
    import torch  # noqa: PLC0415 - only for the embedding variant
    from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    @torch.no_grad()
    def embed(text: str):
        ids = tok(text, return_tensors="pt")
        vec = model(**ids).last_hidden_state[0].mean(0)
        return vec / vec.norm()
    return embed


def nearest_example(routes, embed):
    examples = [(embed(text), r.model) for r in routes for text in (*r.examples, *r.skills)]

    def choose(prompt: str) -> str:
        v = embed(prompt)
        return max(examples, key=lambda e: float(v @ e[0]))[1]
    return choose


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-embedding", action="store_true", help="the naive Bayes classifier only")
    args = parser.parse_args()
    routes = load_skill_routes(HERE / "routes.yaml")
    cases = heldout()
    busy0, own0, wall0 = busy_s(), sum(os.times()[:2]), time.monotonic()
    print(f"{len(cases)} held-out prompts, {sum(len(r.examples) for r in routes)} examples in the routes")
    report("bayes (router/skills.py)", SkillClassifier(routes).choose, cases)
    if not args.no_embedding:
        for name, model_dir in (("SmolLM2-135M-Instruct", default_model_dir()), ("stdlib-coder", STDLIB_CODER_DIR)):
            report(f"embedding: nearest example, {name}", nearest_example(routes, embedder(model_dir)), cases)
    own = sum(os.times()[:2]) - own0
    busy = max(0.0, (busy_s() - busy0 - own) / ((time.monotonic() - wall0) * os.cpu_count()))
    print(f"CPU busy with other work: {busy:.0%} of {os.cpu_count()} cores during the run (times are noisy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
