"""Whole requests on top of the engine's add / step / abort: what `splitserve generate`, the tests
and the benchmarks call (`LLMEngine.stream`, `LLMEngine.generate`). Nothing here touches the
engine's internals; a request left unfinished (an exception, a consumer that stops) is aborted."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence as Seq

from cluster.types import Completion, SamplingParams, TokenDelta


def stream(engine, prompt: str | Seq[int], sampling: SamplingParams | None = None) -> Iterator[TokenDelta]:
    rid = engine.add_request(prompt, sampling)
    finished = False
    try:
        while not finished:
            deltas = engine.step()
            if engine.idle_step:
                engine.wait_for_tiers()
            for delta in deltas:
                if delta.request_id == rid:
                    yield delta
                    if delta.finished:
                        finished = True
                        break
    finally:
        if not finished:
            engine.abort(rid)


def generate(engine, prompts: Iterable[str | Seq[int]],
             sampling: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
    prompts = list(prompts)
    if sampling is None or isinstance(sampling, SamplingParams):
        sampling = [sampling or SamplingParams()] * len(prompts)
    if len(sampling) != len(prompts):
        raise ValueError("give one SamplingParams, or one per prompt")
    ids = [engine.add_request(p, s) for p, s in zip(prompts, sampling)]
    seqs = {rid: engine.sequence(rid) for rid in ids}
    texts = {rid: [] for rid in ids}
    prompt_lps: dict[str, tuple] = {}
    done: dict[str, TokenDelta] = {}
    try:
        while len(done) < len(ids):
            deltas = engine.step()
            if engine.idle_step:
                engine.wait_for_tiers()
            for d in deltas:
                if d.request_id in texts:
                    texts[d.request_id].append(d.text)
                    if d.prompt_logprobs:
                        prompt_lps[d.request_id] = d.prompt_logprobs
                    if d.finished:
                        done[d.request_id] = d
    finally:
        for rid in ids:
            if rid not in done:
                engine.abort(rid)
    return [Completion(rid, seqs[rid].prompt_token_ids, tuple(seqs[rid].output_token_ids),
                       "".join(texts[rid]), done[rid].finish_reason, tuple(seqs[rid].logprobs),
                       seqs[rid].num_cached_tokens, prompt_lps.get(rid, ())) for rid in ids]


WARM_UP_PROMPT = 2048   # tokens: prefill tunes on a chunk of this size, not on launch overhead


def warm_up_prompt_len(engine) -> int:
    """A prompt as long as a real one (WARM_UP_PROMPT), within the context, one step's token
    budget and half the pool, so the autotuner picks the prefill config long prompts run."""
    bs = engine.config.cache.block_size
    return max(1, min(WARM_UP_PROMPT, engine.max_model_len - 4, engine.config.scheduler.max_num_batched_tokens,
                      engine.pool.num_blocks // 2 * bs))


def warm_up(engine) -> None:
    """One request through prefill and decode before the engine reports ready (CUDA with
    Triton), so Triton compiles and autotunes on it rather than on a live request; its blocks and
    prefix-cache entries are dropped. Decode (verification too) is tuned by the decode graphs'
    warm-up runs over a long context; without graphs, verification widths tune at their first use."""
    prompt = [int(engine.tokenizer.token_to_id(" ") or 1)] * warm_up_prompt_len(engine)
    generate(engine, [prompt], SamplingParams(max_tokens=3, ignore_eos=True, speculative="off"))
    engine.pool.reset_prefix_cache()
