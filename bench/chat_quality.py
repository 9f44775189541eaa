"""Chat quality of the default model under each sampling: how many of 20 held-out chat questions
get an answer with a sentence repeated three times or more (a loop), and how many are cut by the
token limit.

    PYTHONPATH=. python bench/chat_quality.py [--max-tokens 512] [--seed 0] [--configs greedy,chat]

Each question is sent as `splitserve chat` sends a first turn (the model's chat template, one user
message), through the engine in-process (the same sampler as a cluster's workers; a seeded request
samples the same tokens whatever shares its batch). `greedy` is what `chat` did before (and what
`--temperature 0` does now); `chat` is what it does now (cluster/launch/chat_sampling.py
`model_sampling`: for SmolLM2-135M-Instruct its model card's temperature 0.2, top-p 0.9 and a
repetition penalty of 1.15 over the answer's tokens). The others are the variations tried; the penalty
was first set to 1.1 (ollama's) and raised to 1.15 after 1.1 left one of these 20 looping, so they are
no longer strictly held out (`--tuning` runs the issue's questions). `chat-prompt-penalty` is the
penalty over the prompt's tokens too (transformers' rule, what `chat` did before).

    PYTHONPATH=. python bench/chat_quality.py --paris 9 [--configs chat,chat-prompt-penalty]

asks "What is the capital of France?" with seeds 0..8 instead and prints each first sentence
(over the prompt's tokens the penalty made the model avoid the question's own words: "L'Étoile de la
Cité"). docs/first_run.md has the figures.
"""
from __future__ import annotations

import argparse
import re
import time
from collections import Counter
from dataclasses import replace

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.launch.chat_cli import PromptBuilder
from cluster.launch.chat_sampling import GREEDY, model_sampling
from cluster.types import FinishReason, SamplingParams

QUESTIONS = (      # held out: none of them was used to choose the defaults
    "How do I make a good cup of tea?",
    "What are the benefits of regular exercise?",
    "Explain what a black hole is in simple terms.",
    "Give me three ideas for a rainy weekend.",
    "How can I improve my sleep?",
    "What is the difference between weather and climate?",
    "Write a short poem about the sea.",
    "What should I pack for a week-long hiking trip?",
    "How does a bicycle stay upright?",
    "Suggest a healthy breakfast.",
    "Why is the sky blue?",
    "What are some good habits for studying?",
    "Describe how photosynthesis works.",
    "How do I start learning to play the guitar?",
    "What is a prime number? Give examples.",
    "List four tips for saving money.",
    "What causes earthquakes?",
    "How can I be more productive when working from home?",
    "Tell me about the history of the Roman Empire in a few sentences.",
    "What are the main differences between cats and dogs as pets?",
)
TUNING = ("Give me three tips for writing clean Python code.", "Which programming language should I learn first?",
          "What is the capital of France?")


def sentences(text: str) -> list[str]:
    """The answer's sentences and list items, normalized (case, numbering, markdown, spaces)."""
    parts = re.split(r"(?<=[.!?])\s+|\n+", text)
    out = []
    for part in parts:
        norm = re.sub(r"^\s*(\d+[.)]|[-*•])\s*", "", part).replace("*", "").strip().lower()
        if len(norm) >= 8:
            out.append(norm)
    return out


def loops(text: str) -> bool:
    """A sentence said three times or more."""
    return any(n >= 3 for n in Counter(sentences(text)).values())


def configs(model_dir) -> dict:
    chat = model_sampling(model_dir)
    return {"greedy": GREEDY, "chat": chat,
            "chat-prompt-penalty": replace(chat, penalize_prompt=True, source="penalty over the prompt too"),
            "chat-penalty-1.1": replace(chat, repetition_penalty=1.1, source="penalty 1.1"),
            "chat-no-penalty": replace(chat, repetition_penalty=1.0, source="chat defaults without the penalty"),
            "chat-penalty-1.05": replace(chat, repetition_penalty=1.05, source="penalty 1.05"),
            "chat-penalty-1.15": replace(chat, repetition_penalty=1.15, source="penalty 1.15"),
            "chat-penalty-1.2": replace(chat, repetition_penalty=1.2, source="penalty 1.2"),
            "greedy-penalty-1.1": replace(GREEDY, repetition_penalty=1.1, source="greedy, penalty 1.1"),
            "temp-0.7": replace(chat, temperature=0.7, source="temperature 0.7")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=512, help="the bound of one answer (chat's is the room left)")
    ap.add_argument("--seed", type=int, default=0, help="question i is seeded seed + i")
    ap.add_argument("--configs", default="greedy,chat", help="comma-separated, of: " + ", ".join(configs(None)))
    ap.add_argument("--tuning", action="store_true", help="the tuning questions instead of the held-out ones")
    ap.add_argument("--show", action="store_true", help="print every answer")
    ap.add_argument("--paris", type=int, default=0, metavar="N",
                    help="ask 'What is the capital of France?' with N seeds instead; print the first sentences")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig())
    model_dir = engine.config.model
    builder = PromptBuilder(model_dir)
    if args.paris:
        return capital_of_france(engine, builder.prompt(TUNING[2]), configs(model_dir), args)
    questions = TUNING if args.tuning else QUESTIONS
    prompts = [builder.prompt(q) for q in questions]
    table = configs(model_dir)
    print(f"model {model_dir.name}; {len(questions)} questions; max_tokens {args.max_tokens}; seed {args.seed}")
    for name in args.configs.split(","):
        sampling = table[name]
        params = [SamplingParams(max_tokens=args.max_tokens, seed=args.seed + i, **sampling.request())
                  for i in range(len(prompts))]
        start = time.perf_counter()
        done = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        looped = [q for q, c in zip(questions, done) if loops(c.text)]
        cut = sum(c.finish_reason is FinishReason.LENGTH for c in done)
        tokens = sum(len(c.token_ids) for c in done)
        print(f"{name:20s} {sampling.describe()}\n{'':20s} looping answers {len(looped)}/{len(done)}, cut by the "
              f"limit {cut}, mean {tokens / len(done):.0f} tokens, {seconds:.0f} s")
        for q in looped:
            print(f"{'':22s}loops: {q}")
        if args.show:
            for q, c in zip(questions, done):
                print(f"--- {q}\n{c.text}\n")


def capital_of_france(engine, prompt, table: dict, args) -> None:
    """The one-line factual question over seeds: how many first sentences name Paris as the capital."""
    for name in args.configs.split(","):
        params = [SamplingParams(max_tokens=48, seed=args.seed + i, **table[name].request()) for i in range(args.paris)]
        firsts = [re.split(r"(?<=[.!?])\s|\n", c.text.strip(), maxsplit=1)[0]
                  for c in engine.generate([prompt] * args.paris, params)]
        plain = sum("Paris" in f and "toile" not in f for f in firsts)
        print(f"{name:20s} {table[name].describe()}\n{'':20s} first sentence names Paris plainly: {plain}/{args.paris}")
        for seed, first in enumerate(firsts, args.seed):
            print(f"{'':22s}seed {seed}: {first[:100]}")


if __name__ == "__main__":
    main()
