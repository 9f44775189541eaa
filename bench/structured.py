"""Structured output's cost, on the default model (SmolLM2-135M-Instruct), side by side in one run.

1. In-process, per decode step at batch 1/8/32: the step's time with every row unconstrained and
   with every row under a JSON schema (the masks are filled on a helper thread while the forward
   runs, then applied), the exposed overhead, and the fill time itself as a share of the step.
   Both runs decode exactly --tokens tokens per request (a schema that cannot end earlier; the
   free run ignores eos), so every measured step has the full batch.
2. The two grammar libraries on the same schema and the same tokens: compile time and time per
   token (fill the next mask, accept the token) of xgrammar and llguidance.
3. Served (1 prefill + 1 decode, OpenAI HTTP): completion tokens per second with and without a
   response_format json_schema, at each --concurrency.

    PYTHONPATH=. python bench/structured.py [--batches 1 8 32] [--concurrency 1 8] [--skip-served]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "minItems": 40, "maxItems": 40,
                                                     "items": {"type": "string", "maxLength": 24}}},
          "required": ["notes"], "additionalProperties": False}
PROMPT = ("<|im_start|>user\nWrite forty short notes about the history of Lisbon as a JSON object."
          "<|im_end|>\n<|im_start|>assistant\n")


def step_costs(engine, batch: int, tokens: int, constrained: bool) -> tuple[float, float, float]:
    """Median decode-step seconds with `batch` rows; mask-fill and mask-apply seconds per step."""
    from cluster.types import SamplingParams, StructuredKind, StructuredOutput
    spec = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA)) if constrained else None
    for i in range(batch):
        engine.add_request(PROMPT + " " * (i % 3), SamplingParams(max_tokens=tokens, structured=spec,
                                                                  ignore_eos=not constrained, cache_salt=str(i)))
    times, fills, applies = [], [], []
    runtime = engine.grammar
    while engine.has_unfinished():
        full = len(engine.scheduler.running) == batch and not engine.scheduler.waiting
        fill0, apply0 = runtime.mask_seconds, runtime.apply_seconds
        t0 = time.perf_counter()
        engine.step()
        if full and all(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running):
            times.append(time.perf_counter() - t0)
            fills.append(runtime.mask_seconds - fill0)
            applies.append(runtime.apply_seconds - apply0)
    return tuple(statistics.median(v[2:] or v) for v in (times, fills, applies))


def in_process(batches: list[int], tokens: int) -> list[int]:
    from cluster.config import CacheConfig, EngineConfig, default_model_file
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams, StructuredKind, StructuredOutput
    engine = LLMEngine(EngineConfig(model=default_model_file(), dtype="bfloat16", cache=CacheConfig(num_blocks=2048)))
    print(f"1. in-process decode steps, {engine.layout.dtype}, {tokens} tokens per request")
    print("   (free/json: median step, best of 3 alternating runs; fill: on the mask thread beside the forward;"
          " apply: on the step's path)")
    print(f"{'batch':>5} {'free ms':>9} {'json ms':>9} {'exposed':>8} {'fill ms':>8} {'apply ms':>9} {'apply/step':>10}")
    for b in batches:
        step_costs(engine, b, 8, True)     # warm: compile once, caches
        runs = [(step_costs(engine, b, tokens, False), step_costs(engine, b, tokens, True)) for _ in range(3)]
        free = min(f[0] for f, _ in runs)
        constrained, fill, apply = min(c for _, c in runs)
        print(f"{b:>5} {free * 1e3:>9.2f} {constrained * 1e3:>9.2f} {constrained / free - 1:>+8.1%} "
              f"{fill * 1e3:>8.2f} {apply * 1e3:>9.2f} {apply / free:>10.1%}", flush=True)
    spec = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=tokens, structured=spec))[0]
    return list(out.token_ids)


def libraries(tokens: list[int]) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    import transformers
    import xgrammar as xgr
    from cluster.config import default_model_dir
    from cluster.engine.grammar import tokenizer_info
    from cluster.model.loader import load_tokenizer
    model_dir = default_model_dir()
    tok = load_tokenizer(model_dir)
    vocab = 49152
    text = json.dumps(SCHEMA)
    print(f"\n2. grammar libraries, the same schema and {len(tokens)} tokens")
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(tokenizer_info(tok, vocab, (2,)), max_threads=1, cache_enabled=False)
    info_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_grammar(xgr.Grammar.from_json_schema(text, any_whitespace=False))
    xg_compile = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    t0 = time.perf_counter()
    for t in tokens:
        m.fill_next_token_bitmask(mask)
        assert m.accept_token(t)
    xg_tok = (time.perf_counter() - t0) / len(tokens)

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    ll_info = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False, "item_separator": ", ",
                                                                         "key_separator": ": "})
    matcher = llguidance.LLMatcher(ll_tok, grammar)
    ll_compile = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llt.allocate_token_bitmask(1, vocab)
    t0 = time.perf_counter()
    ok = 0
    for t in tokens:
        llt.fill_next_token_bitmask(matcher, bitmask, 0)
        ok += bool(matcher.consume_token(t))
    ll_per = (time.perf_counter() - t0) / len(tokens)
    print(f"{'library':<11} {'tokenizer s':>11} {'compile ms':>10} {'us/token':>9}  tokens accepted")
    print(f"{'xgrammar':<11} {info_s:>11.2f} {xg_compile * 1e3:>10.1f} {xg_tok * 1e6:>9.0f}  {len(tokens)}/{len(tokens)}")
    print(f"{'llguidance':<11} {ll_info:>11.2f} {ll_compile * 1e3:>10.1f} {ll_per * 1e6:>9.0f}  {ok}/{len(tokens)}")


def served(concurrency: list[int], tokens: int, requests: int) -> None:
    import openai
    from bench.servers import SERVED_NAME, start_splitserve
    from cluster.config import default_model_file
    log = Path(tempfile.mkdtemp(prefix="structured-")) / "serve.log"
    server = start_splitserve("pd-http", default_model_file(), log, threads=None)
    print(f"\n3. served, 1 prefill + 1 decode, OpenAI HTTP, {requests} requests of {tokens} tokens per level")
    print(f"{'conc':>4} {'free tok/s':>10} {'json tok/s':>10} {'ratio':>6}")
    try:
        client = openai.OpenAI(base_url=f"{server.target}/v1", api_key="none", max_retries=0, timeout=600)

        def one(i: int, constrained: bool) -> int:
            extra = ({"response_format": {"type": "json_schema", "json_schema": {"name": "notes", "schema": SCHEMA}}}
                     if constrained else {"ignore_eos": True})
            out = client.chat.completions.create(
                model=SERVED_NAME, max_tokens=tokens, temperature=0, extra_body={**extra, "cache_salt": str(i)},
                messages=[{"role": "user", "content": "Write forty short notes about the history of Lisbon "
                                                      f"as a JSON object. ({i})"}])
            return out.usage.completion_tokens

        for c in concurrency:
            rates = []
            for constrained in (False, True):
                one(0, constrained)          # warm
                t0 = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    n = sum(pool.map(lambda i: one(i, constrained), range(1, requests + 1)))
                rates.append(n / (time.perf_counter() - t0))
            print(f"{c:>4} {rates[0]:>10.1f} {rates[1]:>10.1f} {rates[1] / rates[0]:>6.2f}", flush=True)
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--skip-served", action="store_true")
    args = ap.parse_args()
    tokens = in_process(args.batches, args.tokens)
    libraries(tokens)
    if not args.skip_served:
        served(args.concurrency, args.tokens, args.requests)


if __name__ == "__main__":
    main()
