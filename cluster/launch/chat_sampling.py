"""How the commands a person reads (`chat`, `serve --request`) sample: the model's own defaults
where it states them, else a setting we ship for the default model, else chat defaults like the
established local runners' (ollama, llama.cpp: a temperature, top-p and a repetition penalty);
the flags given win. `generate`, `--json` and the APIs keep their greedy / OpenAI defaults.

A 135M model decoded greedily loops ("Use a single import statement" three times); the penalty
and a little temperature break the loop (bench/chat_quality.py measures it, docs/first_run.md).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, fields, replace
from pathlib import Path

# The sampling flags, as `SamplingParams` names them (argparse's dests too).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ChatSampling:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # Ours count the answer's tokens only: over the prompt's too (transformers' rule, which a model's
    # own generation_config.json means) the 135M model avoided a short question's own words
    # ("L'Étoile de la Cité" for the capital of France, docs/first_run.md).
    penalize_prompt: bool = True
    source: str = ""

    def describe(self) -> str:
        if self.temperature == 0 and self.repetition_penalty == 1.0:
            return f"greedy ({self.source})"
        parts = [f"temperature {self.temperature:g}", f"top-p {self.top_p:g}"]
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p else []
        over = "" if self.penalize_prompt else " on the answer's tokens"
        parts += [f"repetition penalty {self.repetition_penalty:g}{over}"] if self.repetition_penalty != 1.0 else []
        return f"{', '.join(parts)} ({self.source})"

    def request(self) -> dict:
        """The request's sampling fields (for `SamplingParams`, the gRPC client, the HTTP body)."""
        return {**{name: getattr(self, name) for name in SAMPLING_FIELDS},
                **({} if self.penalize_prompt or self.repetition_penalty == 1.0 else {"penalize_prompt": False})}


# A repetition penalty of 1.1 is ollama's default and the one transformers' docs suggest.
CHAT_DEFAULTS = ChatSampling(temperature=0.7, top_p=0.9, repetition_penalty=1.1, penalize_prompt=False,
                             source="splitserve's chat defaults")
GREEDY = ChatSampling(temperature=0.0, source="--temperature 0")
# The default model states none in its files; its model card samples at temperature 0.2, top-p 0.9.
# The penalty is ours: on bench/chat_quality.py's 20 questions 1.1 left one answer looping, 1.15
# none, 1.2 none but 8 of 20 ran to the 512-token bound (docs/first_run.md).
SHIPPED = {"SmolLM2-135M-Instruct": ChatSampling(temperature=0.2, top_p=0.9, repetition_penalty=1.15,
                                                 penalize_prompt=False,
                                                 source="SmolLM2-135M-Instruct's model card, our penalty")}


def model_sampling(model_dir: Path | None) -> ChatSampling:
    """The model's own defaults over the shipped or chat defaults (each field the model states wins)."""
    if model_dir is None:
        return CHAT_DEFAULTS
    model_dir = Path(model_dir)
    base = next((s for name, s in SHIPPED.items() if model_dir.name.startswith(name)), CHAT_DEFAULTS)
    stated = _generation_config(model_dir / "generation_config.json")
    if not stated:
        return base
    if "repetition_penalty" in stated:      # the model's own penalty means transformers' rule
        stated["penalize_prompt"] = True
    return replace(base, **stated, source=f"{model_dir.name}'s generation_config.json")


def _generation_config(path: Path) -> dict:
    try:
        gen = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if gen.get("do_sample") is False:        # the model asks for greedy decoding
        return {"temperature": 0.0}
    types = {f.name: f.type for f in fields(ChatSampling)}
    # generation_config.json names them as we do (transformers' names; the GGUF's are mapped at conversion)
    return {name: (int if types[name] == "int" else float)(gen[name]) for name in SAMPLING_FIELDS
            if isinstance(gen.get(name), (int, float))}


def session_sampling(args, model_dir: Path | None) -> ChatSampling:
    """The model's (or chat) defaults with the flags given on top. `--temperature 0` alone is plain
    greedy decoding: no penalty, no truncation, as `generate` decodes."""
    given = given_sampling(args)
    base = GREEDY if given.get("temperature") == 0 else model_sampling(model_dir)
    given = {name: value for name, value in given.items() if getattr(base, name) != value}
    if not given:
        return base
    return replace(base, **given, source=f"{base.source}; flags given win")


def given_sampling(args) -> dict:
    """The sampling flags given on the command line (unset ones are None)."""
    return {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name, None) is not None}


def session_seed(args) -> int:
    """One seed per session (turn i is seeded seed + i): `--seed N` repeats a session."""
    seed = getattr(args, "seed", None)
    return seed if seed is not None else secrets.randbelow(2**31)
