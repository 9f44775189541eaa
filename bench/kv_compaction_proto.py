"""A measured prototype of KV compaction of long prompts (not in the serving path yet): at equal
memory, how much continuation perplexity a compacted prompt cache keeps, for a window (sinks +
the last tokens, StreamingLLM), selection (SnapKV: the attention of the prompt's last queries
picks the kept keys per layer and KV head) and fitted values (attention matching: the selected
keys plus one log-mass bias per KV head, values fitted by ridge least squares so that the
attention outputs of the prompt's last queries over the compact set match the full cache's).

    python bench/kv_compaction_proto.py [--prompt 2048] [--continuation 256] [--contexts 3] [--ratio 4]

How it is simulated, exactly: one forward pass of prompt + continuation through transformers with
an attention function of our own. Prompt queries attend causally as a prefill would; each layer
then compacts its prompt keys/values from what that prefill computed (the compaction reads only
prompt positions), and continuation queries attend the compact prompt set, the last `--recent`
prompt tokens exact, and the continuation causally: what decoding the continuation on the
compacted cache computes. Memory per method: `prompt / ratio` entries per layer and KV head
(`--recent` of them exact). Held-out text: this repository's README.md and docs/*.md.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STATE = {"method": "full", "prompt": 0, "budget": 0, "recent": 128, "sinks": 4, "obs": 32, "pool": 7,
         "keep_sinks": False, "fit_bias": True}


def _select(q_obs, k_old, k_all_len, scale, m, g):
    """SnapKV: per KV head, the m old keys the observation queries attend most (pooled)."""
    hkv, old = k_old.shape[0], k_old.shape[1]
    logits = torch.einsum("hqd,hkd->hqk", q_obs, k_old.repeat_interleave(g, 0)) * scale
    votes = logits.softmax(-1).view(hkv, g * q_obs.shape[1], old).sum(1)
    votes = F.avg_pool1d(votes[:, None], STATE["pool"], 1, STATE["pool"] // 2)[:, 0]
    if STATE["keep_sinks"]:   # the first tokens always kept (the attention sinks)
        votes[:, :STATE["sinks"]] = float("inf")
    return votes.topk(m, dim=-1).indices.sort(-1).values


def _compact(q, k, v, scale, g):
    """The compact old part per KV head: keys [Hkv, m, D], values, additive log-mass bias [Hkv, m]."""
    P, r = STATE["prompt"], STATE["recent"]
    k_old, v_old = k[:, :P - r], v[:, :P - r]
    m = STATE["budget"] - r
    method = STATE["method"]
    if method == "window":
        s = STATE["sinks"]
        idx = torch.cat([torch.arange(s), torch.arange(P - r - (m - s), P - r)])[None].expand(k.shape[0], -1)
    else:
        idx = _select(q[:, P - STATE["obs"]:P], k_old, P, scale, m, g)
    gather = idx[..., None].expand(-1, -1, k.shape[-1])
    k_sel, v_sel = k_old.gather(1, gather), v_old.gather(1, gather)
    bias = torch.zeros(idx.shape)
    if method == "fit":
        v_sel, bias = _fit(q[:, P - r:P], k_old, v_old, k_sel, v_sel, scale, g)
    return k_sel, v_sel, bias


def _fit(q_s, k_old, v_old, k_sel, v_sel, scale, g):
    """Attention matching on sample queries (the prompt's last `recent`, every head of the group):
    a log-mass bias so the compact set carries the old part's softmax mass, and ridge least-squares
    values so its attention output matches the old part's."""
    hkv = k_old.shape[0]
    qs = q_s.reshape(hkv, g * q_s.shape[1], -1)                     # [Hkv, n, D]
    s_full = torch.einsum("hnd,hkd->hnk", qs, k_old) * scale
    s_sel = torch.einsum("hnd,hkd->hnk", qs, k_sel) * scale
    bias = (s_full.logsumexp(-1) - s_sel.logsumexp(-1)).mean(-1)   # [Hkv]
    if not STATE["fit_bias"]:   # values only: what the serving path fits (its kernels read no bias)
        bias = torch.zeros_like(bias)
    target = torch.einsum("hnk,hkd->hnd", s_full.softmax(-1), v_old)
    a = s_sel.softmax(-1)                                            # [Hkv, n, m]
    ata = a.transpose(1, 2) @ a
    lam = 1e-2 * ata.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None]
    eye = torch.eye(ata.shape[-1])[None]
    v_fit = torch.linalg.solve(ata + lam * eye, a.transpose(1, 2) @ target + lam * v_sel)
    return v_fit, bias[:, None].expand(-1, k_sel.shape[1])


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: q [1, Hq, T, D], k/v [1, Hkv, T, D] -> [1, T, Hq, D]."""
    q, k, v = query[0].float(), key[0].float(), value[0].float()
    g = q.shape[0] // k.shape[0]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = F.scaled_dot_product_attention(q[None], k.repeat_interleave(g, 0)[None], v.repeat_interleave(g, 0)[None],
                                         is_causal=True, scale=scale)[0]
    P = STATE["prompt"]
    if STATE["method"] != "full" and q.shape[1] > P:
        k_c, v_c, bias = _compact(q, k, v, scale, g)
        keys = torch.cat([k_c, k[:, P - STATE["recent"]:]], 1).repeat_interleave(g, 0)
        vals = torch.cat([v_c, v[:, P - STATE["recent"]:]], 1).repeat_interleave(g, 0)
        cont = q.shape[1] - P
        mask = torch.zeros(q.shape[0], cont, keys.shape[1])
        mask[:, :, :bias.shape[1]] = bias.repeat_interleave(g, 0)[:, None, :]
        tail = torch.ones(cont, cont, dtype=torch.bool).triu(1)     # continuation: causal among itself
        mask[:, :, -cont:] = mask[:, :, -cont:].masked_fill(tail, float("-inf"))
        out[:, P:] = F.scaled_dot_product_attention(q[None, :, P:], keys[None], vals[None], attn_mask=mask[None],
                                                    scale=scale)[0]
    return out.transpose(0, 1)[None].to(query.dtype), None


def contexts(tokenizer, n: int, size: int) -> list[list[int]]:
    docs = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "kv_compress.md"]   # not its own figures
    text = "\n\n".join(p.read_text() for p in [REPO / "README.md", *docs])
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    step = max(size, (len(ids) - size) // max(1, n - 1))
    return [ids[i:i + size] for i in range(0, len(ids) - size + 1, step)][:n]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--contexts", type=int, default=3)
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--recent", type=int, default=128)
    p.add_argument("--obs", type=int, default=32, help="observation queries (SnapKV's window)")
    p.add_argument("--keep-sinks", action="store_true", help="selection always keeps the first 4 tokens")
    p.add_argument("--methods", default="full,window,select,fit")
    p.add_argument("--no-fit-bias", action="store_true", help="fit values only (no log-mass bias), as served")
    args = p.parse_args()
    import transformers
    from transformers import AttentionInterface

    from cluster.config import default_model_dir
    from cluster.model.loader import load_tokenizer
    AttentionInterface.register("kv_compaction_proto", attention)
    path = default_model_dir()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="kv_compaction_proto").eval()
    texts = contexts(load_tokenizer(path), args.contexts, args.prompt + args.continuation)
    STATE.update(prompt=args.prompt, budget=args.prompt // args.ratio, recent=args.recent, obs=args.obs,
                 keep_sinks=args.keep_sinks, fit_bias=not args.no_fit_bias)
    print(f"{path.name}: {len(texts)} contexts, prompt {args.prompt}, continuation {args.continuation}, "
          f"ratio {args.ratio} ({STATE['budget']} entries per layer and KV head, {args.recent} exact)")
    full = None
    for method in args.methods.split(","):
        STATE["method"] = method
        nll, count, t0 = 0.0, 0, time.perf_counter()
        for ids in texts:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, args.prompt - 1:-1].float()
            target = torch.tensor(ids[args.prompt:])
            nll += F.cross_entropy(logits, target, reduction="sum").item()
            count += len(target)
        ppl = math.exp(nll / count)
        full = full or ppl    # the first method listed is the baseline (full attention by default)
        print(f"{method:>7}: continuation perplexity {ppl:.3f} ({100 * (ppl / full - 1):+.1f}% against the first), "
              f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
