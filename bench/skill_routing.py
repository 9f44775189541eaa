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

`--quality`: on a mixed set (bench/skill_routing/quality.yaml, code and chat prompts with a
reference continuation each), each model's log-likelihood of the references (nats per character:
the two tokenizers differ) for each model alone and for the model naive Bayes routes each prompt to.

  python bench/skill_routing.py [--no-embedding] [--quality]
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
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

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


def loglik_per_char(model_dir: Path):
    """The reference's log-likelihood after the prompt, per character of the reference."""
    import torch  # noqa: PLC0415 - only for the quality comparison
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def score(prompt: str, reference: str) -> float:
        head = tok(prompt)["input_ids"]
        ids = tok(prompt + reference)["input_ids"]
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        picked = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        return float(picked[len(head) - 1:].sum()) / len(reference)
    return score


def quality(routes) -> None:
    data = yaml.safe_load((HERE / "quality.yaml").read_text())
    items = [(item["prompt"], item["reference"], label) for label, rows in data.items() for item in rows]
    dirs = {LABELS["chat"]: default_model_dir(), LABELS["code"]: STDLIB_CODER_DIR}
    scores = {}
    for name, model_dir in dirs.items():
        score = loglik_per_char(model_dir)
        scores[name] = [score(prompt, reference) for prompt, reference, _ in items]
    routed = SkillClassifier(routes)
    chosen = [routed.choose(prompt) for prompt, _, _ in items]
    columns = {**{f"{n} alone": v for n, v in scores.items()},
               "routed (bayes)": [scores[c][i] for i, c in enumerate(chosen)]}
    print(f"quality: mean log-likelihood of the references, nats per character (higher is better), "
          f"{len(items)} items")
    for column, values in columns.items():
        by = {label: [v for v, (_, _, lab) in zip(values, items) if lab == label] for label in data}
        print(f"  {column:40s} all {sum(values) / len(values):+.3f}  " +
              "  ".join(f"{label} {sum(v) / len(v):+.3f}" for label, v in by.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-embedding", action="store_true", help="the naive Bayes classifier only")
    parser.add_argument("--quality", action="store_true", help="also the routed answers' quality on a mixed set")
    args = parser.parse_args()
    routes = load_skill_routes(HERE / "routes.yaml")
    cases = heldout()
    busy0, own0, wall0 = busy_s(), sum(os.times()[:2]), time.monotonic()
    print(f"{len(cases)} held-out prompts, {sum(len(r.examples) for r in routes)} examples in the routes")
    report("bayes (router/skills.py)", SkillClassifier(routes).choose, cases)
    if not args.no_embedding:
        for name, model_dir in (("SmolLM2-135M-Instruct", default_model_dir()), ("stdlib-coder", STDLIB_CODER_DIR)):
            report(f"embedding: nearest example, {name}", nearest_example(routes, embedder(model_dir)), cases)
    if args.quality:
        quality(routes)
    own = sum(os.times()[:2]) - own0
    busy = max(0.0, (busy_s() - busy0 - own) / ((time.monotonic() - wall0) * os.cpu_count()))
    print(f"CPU busy with other work: {busy:.0%} of {os.cpu_count()} cores during the run (times are noisy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
