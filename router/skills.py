"""Skill routing: `model: "auto"` goes to the served model whose skills fit the prompt.

`--skill-routes FILE` (YAML) describes each model's skills and example prompts:

    routes:
      - model: stdlib-coder
        skills: [completing Python code]
        examples: ["def parse_args(argv):", "import os\\n"]
      - model: SmolLM2-135M-Instruct.Q4_1
        skills: [answering questions, conversation]
        examples: ["What is the capital of France?"]

The classifier is a multinomial naive Bayes over the prompt's words and symbols, trained from the
examples and the skills' descriptions when the router starts (microseconds a prompt, nothing
computed on a worker). A nearest-example search in an embedding that a served model computes was
the alternative: it costs a forward pass per request on a worker that has a queue of its own, and
on the held-out set of bench/skill_routing.py the word-and-symbol features already separate code
from chat (docs/models.md has the figures). The routes are plain data: the classifier is rebuilt
from them, never saved.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

AUTO = "auto"       # the model name that asks for skill routing

# Words (identifiers), and each symbol on its own: code's `(`, `:`, `=` and `_` say as much as its words.
_TOKEN = re.compile(r"[A-Za-z]+|\d+|[^\sA-Za-z\d]")


@dataclass(frozen=True)
class SkillRoute:
    model: str                      # a served model's name
    skills: tuple[str, ...]         # short descriptions of what it is good at
    examples: tuple[str, ...]       # prompts it should get


def load_skill_routes(path: str | Path) -> tuple[SkillRoute, ...]:
    """The routes a `--skill-routes` YAML file gives; a malformed one is a ValueError naming the entry."""
    data = yaml.safe_load(Path(path).read_text())
    routes = data.get("routes") if isinstance(data, dict) else None
    if not isinstance(routes, list) or not routes:
        raise ValueError(f"{path}: expected `routes:`, a list of {{model, skills, examples}}")
    out = []
    for i, entry in enumerate(routes):
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise ValueError(f"{path}: routes[{i}] needs `model: SERVED_NAME`")
        skills, examples = entry.get("skills") or [], entry.get("examples") or []
        if not all(isinstance(s, str) for s in [*skills, *examples]) or not (skills or examples):
            raise ValueError(f"{path}: routes[{i}] ({entry['model']}) needs `skills` or `examples`, lists of strings")
        out.append(SkillRoute(entry["model"], tuple(skills), tuple(examples)))
    return tuple(out)


def features(text: str) -> list[str]:
    """A prompt's words (lower case) and symbols, plus a mark for each indented line."""
    tokens = [t.lower() for t in _TOKEN.findall(text)]
    tokens += ["<indent>" for line in text.splitlines() if line.startswith((" ", "\t"))]
    return tokens


class SkillClassifier:
    """Multinomial naive Bayes (Laplace smoothing) over `features`, one class per route's model."""

    def __init__(self, routes: Sequence[SkillRoute]):
        self.models = tuple(dict.fromkeys(r.model for r in routes))
        counts: dict[str, Counter] = {m: Counter() for m in self.models}
        docs = Counter()
        for r in routes:
            for text in (*r.examples, *r.skills):
                counts[r.model].update(features(text))
                docs[r.model] += 1
        vocab = set().union(*counts.values())
        self._unseen = {}
        self._log_p: dict[str, dict[str, float]] = {}
        total_docs = sum(docs.values())
        self._prior = {m: math.log(docs[m] / total_docs) for m in self.models}
        for m in self.models:
            denominator = sum(counts[m].values()) + len(vocab) + 1
            self._log_p[m] = {t: math.log((c + 1) / denominator) for t, c in counts[m].items()}
            self._unseen[m] = math.log(1 / denominator)
        self._vocab = vocab

    def scores(self, text: str, among: Iterable[str] | None = None) -> dict[str, float]:
        """Each model's log score for `text` (words never seen in training are left out)."""
        candidates = [m for m in self.models if among is None or m in set(among)]
        tokens = [t for t in features(text) if t in self._vocab]
        return {m: self._prior[m] + sum(self._log_p[m].get(t, self._unseen[m]) for t in tokens) for m in candidates}

    def choose(self, text: str, among: Iterable[str] | None = None) -> str | None:
        """The best-scoring model among `among` (all routes' when None); None when no route names one."""
        scores = self.scores(text, among)
        return max(scores, key=scores.get) if scores else None
