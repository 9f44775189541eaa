"""Greedy acceptance rate of each draft model against the target.

For each held-out prompt the target's greedy continuation is computed once.
Greedy speculative decoding always reproduces exactly that continuation, so
verification reduces to a comparison: at each step the draft greedily proposes
``k`` tokens from the accepted context; the target accepts the longest prefix
that matches its own greedy tokens, then contributes one token itself (the
correction, or the bonus token when all ``k`` match).

Reported per draft: accepted / proposed, mean accepted length per step (0..k),
and tokens produced per target forward (accepted + 1).

Prompts: ``--prompts`` windows of ``--prompt-len`` tokens, evenly spaced over
the held-out token stream (files with sha1(relpath) % 20 == 0; see
bench/spec_training/corpus.py). Uses transformers models; no engine needed.

    python bench/draft_acceptance.py            # defaults: 50 prompts, k=4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from transformers import AutoModelForCausalLM  # noqa: E402

from bench.spec_training.evaluate import heldout_windows  # noqa: E402

WEIGHTS = os.path.join(REPO, "cluster", "model", "weights")


@torch.no_grad()
def greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """n greedy tokens after ids ([1, T]), with a KV cache; ignores EOS."""
    out = model(input_ids=ids, use_cache=True)
    toks = []
    for _ in range(n):
        nxt = out.logits[:, -1:].argmax(-1)
        toks.append(int(nxt))
        if len(toks) == n:
            break
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return toks


def acceptance(draft, prompt: list[int], ref: list[int], n_new: int, k: int) -> tuple[int, int, int]:
    """(accepted, proposed, steps) for one prompt; ref has >= n_new + k tokens."""
    accepted = proposed = steps = 0
    pos = 0
    while pos < n_new:
        ctx = torch.tensor([prompt + ref[:pos]])
        guess = greedy(draft, ctx, k)
        a = 0
        while a < k and guess[a] == ref[pos + a]:
            a += 1
        accepted += a
        proposed += k
        steps += 1
        pos += a + 1  # accepted tokens + the target's own token
    return accepted, proposed, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.path.join(WEIGHTS, "stdlib-coder"))
    ap.add_argument("--drafts", nargs="+", default=[
        os.path.join(WEIGHTS, "stdlib-coder-draft"),
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "spec_training", "weights", "stdlib-coder-draft-nodistill")])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64, help="target tokens per prompt")
    ap.add_argument("-k", type=int, default=4, help="draft tokens proposed per step")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    prompts = heldout_windows(args.target, args.prompts, args.prompt_len, args.new_tokens + args.k)

    t0 = time.time()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    refs = [greedy(target, torch.tensor([p]), args.new_tokens + args.k) for p in prompts]
    print(f"target greedy continuations: {time.time() - t0:.1f}s", file=sys.stderr)

    rows = []
    for d in args.drafts:
        draft = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
        acc = prop = steps = 0
        for p, r in zip(prompts, refs):
            a, q, s = acceptance(draft, p, r, args.new_tokens, args.k)
            acc, prop, steps = acc + a, prop + q, steps + s
        rows.append({"draft": os.path.basename(os.path.normpath(d)), "accepted": acc,
                     "proposed": prop, "rate": acc / prop, "mean_accepted": acc / steps,
                     "tokens_per_target_step": (acc + steps) / steps, "steps": steps})

    print(f"{args.prompts} held-out prompts x {args.prompt_len} tokens, "
          f"{args.new_tokens} target tokens each, k={args.k}, greedy, {args.dtype}")
    print(f"{'draft':32} {'accepted/proposed':>19} {'rate':>6} {'mean acc len':>12} {'tok/target step':>15}")
    for r in rows:
        print(f"{r['draft']:32} {r['accepted']:>8}/{r['proposed']:<10} {r['rate']:6.3f} "
              f"{r['mean_accepted']:12.3f} {r['tokens_per_target_step']:15.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
