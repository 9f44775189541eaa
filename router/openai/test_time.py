"""The `test_time` vendor extension of /v1/completions and /v1/chat/completions (router/test_time.py
runs it): `{"strategy": "majority" | "best_of", "samples": N, "early_stop": bool,
"answer_pattern": REGEX, "scorer": "logprob"}` in, the chosen sample as the one choice out, with
`test_time: {candidates: [{text, answer, tokens, score, finish_reason}], chosen, stopped_early,
samples_run}` beside it and `usage` counting every sample's tokens.

Refused with a 400 naming the field: `n` > 1 (the samples are `test_time.samples`), `stream`
(the choice is known only when the samples end; streaming the final choice alone would only delay
the first byte), `echo`, and more than one prompt.
"""
from __future__ import annotations

from proto.splitserve.v1 import inference_pb2 as pb
from router.errors import ValidationError
from router.openai.protocol import ApiError, Endpoint
from router.test_time import TestTimeOutcome
from router.test_time_policy import TestTimeSpec, spec_from_proto
from router.validation import Limits, clip

_STRATEGIES = {"majority": pb.TEST_TIME_STRATEGY_MAJORITY, "best_of": pb.TEST_TIME_STRATEGY_BEST_OF}
_TYPES = {"strategy": str, "samples": int, "early_stop": bool, "answer_pattern": str, "scorer": str}


def _err(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def parse_test_time(body: dict, limits: Limits, endpoint: Endpoint) -> TestTimeSpec | None:
    """The body's `test_time`, validated (None without one), or the 400 naming the field."""
    value = body.get("test_time")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _err("test_time", "expected an object")
    unknown = sorted(set(value) - set(_TYPES))
    if unknown:
        raise _err(f"test_time.{clip(unknown[0])}", f"unknown field; expected some of {', '.join(_TYPES)}")
    for name, kind in _TYPES.items():
        v = value.get(name)
        if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
            raise _err(f"test_time.{name}", f"expected {kind.__name__}, got {type(v).__name__}")
    if value.get("strategy") not in _STRATEGIES:
        raise _err("test_time.strategy", "expected \"majority\" or \"best_of\"")
    samples = value.get("samples", 1)
    msg = pb.TestTime(strategy=_STRATEGIES[value["strategy"]], samples=max(0, min(samples, 2**32 - 1)),
                      early_stop=bool(value.get("early_stop", False)),
                      answer_pattern=value.get("answer_pattern") or "", scorer=value.get("scorer") or "")
    try:
        spec = spec_from_proto(msg, limits.bounds, (limits.model_id,))
    except ValidationError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
    _refuse_combinations(body, endpoint)
    return spec


def _refuse_combinations(body: dict, endpoint: Endpoint) -> None:
    if body.get("n") not in (None, 1):
        raise _err("n", "cannot be combined with test_time; ask for test_time.samples instead")
    if body.get("stream"):
        raise _err("stream", "test_time's answer is chosen once every sample ends: ask without stream")
    if body.get("echo"):
        raise _err("echo", "cannot be combined with test_time")
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
    if endpoint is Endpoint.COMPLETIONS and several:
        raise _err("prompt", "test_time takes one prompt")


def test_time_body(outcome: TestTimeOutcome) -> dict:
    """The response's `test_time` object."""
    return {"candidates": [{"text": c.text, "answer": c.answer, "tokens": len(c.token_ids),
                            "score": c.score if c.score != float("-inf") else None,
                            "finish_reason": c.finish_reason.value}     # "abort": cut short by early stop
                           for c in outcome.candidates],
            "chosen": outcome.chosen, "stopped_early": outcome.stopped_early, "samples_run": outcome.samples_run}


def test_time_usage(outcome: TestTimeOutcome) -> dict:
    """The prompt once, every sample's tokens (those cut short included)."""
    completion = outcome.completion_tokens
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": completion,
            "total_tokens": outcome.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}
