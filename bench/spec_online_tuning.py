"""How hard an online round may train: held-out acceptance after fine-tuning on a little traffic.

One engine (the default model, its EAGLE-3 head, k = 4, greedy) serves code completions (stdlib
files) and held-out chat prompts with online capture on. Each domain's first part trains the head
(decode/spec/online/trainer.py) at several learning rates and step counts; the score (mean accepted
length of a greedy 4-token chain, what promotion compares) is taken on that domain's other prompts,
never trained on. It chose the trainer's defaults: on a few thousand tokens, more steps overfit.

    PYTHONPATH=. python bench/spec_online_tuning.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch   # noqa: E402

from bench.spec_online import code_prompts   # noqa: E402
from bench.spec_training.corpus import iter_stdlib_files, split_files   # noqa: E402
from bench.spec_training.smollm_data import chat_ids, heldout_prompts   # noqa: E402

SETTINGS = ((3e-4, 60), (3e-4, 10), (1e-4, 10), (1e-4, 20), (3e-5, 30))


def main() -> None:
    from transformers import AutoTokenizer

    from cluster.config import EngineConfig, SpeculativeConfig, default_model_dir
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams
    from decode.spec.online.trainer import HeadTrainer
    from decode.spec.speculator import make_speculator
    torch.set_num_threads(2)
    model = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model)
    engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16", num_threads=2, speculative=SpeculativeConfig(
        method="eagle", num_speculative_tokens=4, spec_online=True, spec_online_buffer_tokens=10 ** 7)),
        speculator_factory=make_speculator)

    def serve(prompts):
        out = []
        for b in range(0, len(prompts), 8):
            ids = [engine.add_request(p, SamplingParams(max_tokens=96), f"r{time.monotonic_ns()}-{i}")
                   for i, p in enumerate(prompts[b:b + 8])]
            seqs = [engine.requests.seqs[i] for i in ids]
            while any(not s.is_finished for s in seqs):
                engine.step()
            out += list(engine.speculator.take_online()[0])
        return out
    train_files, heldout_files = split_files(iter_stdlib_files())
    chat = [chat_ids(tok, p.text)[:1024] for p in heldout_prompts(64)]
    domains = {"code": (serve(code_prompts(tok, train_files[::3], 48)), serve(code_prompts(tok, heldout_files, 8))),
               "chat": (serve(chat[:48]), serve(chat[48:]))}
    trainer = HeadTrainer(engine.speculator.models.eagle_dir, model)
    print(f"model {model.name}; tokens (train / held out): "
          + ", ".join(f"{d} {sum(len(s.tokens) for s in a)} / {sum(len(s.tokens) for s in b)}"
                      for d, (a, b) in domains.items()))
    print(f"{'lr':>7} {'steps':>5} " + " ".join(f"{d:>8}" for d in domains))
    print(f"{'base':>7} {'':>5} " + " ".join(f"{trainer.score(trainer.base, b):8.3f}" for _, b in domains.values()))
    for lr, steps in SETTINGS:
        trainer.lr = lr
        scores = []
        for train, held in domains.values():
            tuned = _train_uncapped(trainer, train, steps)
            scores.append(trainer.score(tuned, held))
        print(f"{lr:7.0e} {steps:5d} " + " ".join(f"{s:8.3f}" for s in scores), flush=True)


def _train_uncapped(trainer, samples, steps: int):
    """`HeadTrainer.train` without its two-pass cap (the cap is what this measures)."""
    return trainer.train(trainer.base, samples, steps, max_passes=float("inf"))


if __name__ == "__main__":
    main()
