"""Greedy acceptance of the EAGLE head vs the draft models, same code, same run.

Methodology is bench/draft_acceptance.py's (its prompts, its target greedy
continuations and its ``acceptance`` loop are reused as is for the draft
models): ``--prompts`` held-out windows of ``--prompt-len`` tokens evenly
spaced over the held-out stream; the target generates ``--new-tokens`` greedy
tokens; per step the drafter proposes k tokens from the accepted context and
the target accepts the longest prefix matching its greedy tokens, then adds one.

For the head, a step at accepted context x_0..x_n uses the target's TRUE
pre-norm last-layer features f_0..f_{n-1} (computed once per prompt over
prompt + continuation; features are causal so this equals recomputing them per
step) and drafts k tokens autoregressively on its own features with
``eagle.draft_greedy`` (the dense reference of the serving contract).

    python -m bench.spec_training.eval_eagle            # 50 prompts, k=4
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from decode.spec.heads.eagle import FeatureHook, draft_greedy, load_eagle_head, load_target_parts
from .evaluate import heldout_windows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WEIGHTS = os.path.join(REPO, "cluster", "model", "weights")


def _bench():
    path = os.path.join(REPO, "bench", "draft_acceptance.py")
    spec = importlib.util.spec_from_file_location("draft_acceptance", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@torch.no_grad()
def target_features(target, hook: FeatureHook, ids: list[int]) -> torch.Tensor:
    """f_0..f_{T-1} ([T, H]) of the target on ids: pre-norm last-layer output."""
    target(input_ids=torch.tensor([ids]))
    return hook.f[0]


def head_acceptance(head, tp, f: torch.Tensor, prompt: list[int], ref: list[int],
                    n_new: int, k: int, depth: list[int]) -> tuple[int, int, int]:
    """Same loop as bench's ``acceptance``; depth[i] counts steps accepting > i."""
    accepted = proposed = steps = 0
    pos = 0
    while pos < n_new:
        ctx = prompt + ref[:pos]
        guess = draft_greedy(head, tp, ctx, f[: len(ctx) - 1], k)
        a = 0
        while a < k and guess[a] == ref[pos + a]:
            a += 1
        for i in range(a):
            depth[i] += 1
        accepted += a
        proposed += k
        steps += 1
        pos += a + 1
    return accepted, proposed, steps


def row(name, acc, prop, steps, **extra) -> dict:
    return {"drafter": name, "accepted": acc, "proposed": prop, "rate": acc / prop,
            "mean_accepted": acc / steps, "tokens_per_target_step": (acc + steps) / steps,
            "steps": steps, **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.path.join(WEIGHTS, "stdlib-coder"))
    ap.add_argument("--head", default=os.path.join(WEIGHTS, "stdlib-coder-eagle"))
    ap.add_argument("--drafts", nargs="*", default=[os.path.join(WEIGHTS, "stdlib-coder-draft")])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    bench = _bench()

    prompts = heldout_windows(args.target, args.prompts, args.prompt_len, args.new_tokens + args.k)

    t0 = time.time()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    refs = [bench.greedy(target, torch.tensor([p]), args.new_tokens + args.k) for p in prompts]
    print(f"target greedy continuations: {time.time() - t0:.1f}s", file=sys.stderr)

    rows = []
    for d in args.drafts:
        t1 = time.time()
        draft = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
        acc = prop = steps = 0
        for p, r in zip(prompts, refs):
            a, q, s = bench.acceptance(draft, p, r, args.new_tokens, args.k)
            acc, prop, steps = acc + a, prop + q, steps + s
        rows.append(row(os.path.basename(os.path.normpath(d)), acc, prop, steps,
                        seconds=round(time.time() - t1, 1)))

    if args.head:
        t1 = time.time()
        head = load_eagle_head(args.head, dtype)
        tp = load_target_parts(args.target, dtype)
        hook = FeatureHook(target)
        acc = prop = steps = 0
        depth = [0] * args.k
        for p, r in zip(prompts, refs):
            f = target_features(target, hook, p + r)
            a, q, s = head_acceptance(head, tp, f, p, r, args.new_tokens, args.k, depth)
            acc, prop, steps = acc + a, prop + q, steps + s
        hook.remove()
        rows.append(row(os.path.basename(os.path.normpath(args.head)), acc, prop, steps,
                        seconds=round(time.time() - t1, 1),
                        accept_at_depth=[round(c / steps, 3) for c in depth]))

    print(f"{args.prompts} held-out prompts x {args.prompt_len} tokens, "
          f"{args.new_tokens} target tokens each, k={args.k}, greedy, {args.dtype}")
    print(f"| drafter | accepted / proposed | acceptance rate | mean accepted length (of {args.k}) "
          f"| tokens per target step |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['drafter']}` | {r['accepted']} / {r['proposed']} | {r['rate']:.3f} "
              f"| {r['mean_accepted']:.3f} | {r['tokens_per_target_step']:.3f} |")
    for r in rows:
        if "accept_at_depth" in r:
            print(f"{r['drafter']}: P(step accepts >= i tokens), i=1..{args.k}: {r['accept_at_depth']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
