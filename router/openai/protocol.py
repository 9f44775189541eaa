"""OpenAI's completions and chat bodies in, its response and chunk shapes out.

A body becomes one `splitserve.v1.GenerateRequest` proto per sample and goes through the gRPC
path's `validate` (router/validation.py), so both APIs check a field the same way; only the field
names of the errors are OpenAI's. `n` samples of a prompt become one group (the router computes
the prompt once, `Router.generate(req, forks)`); with a `seed`, sample j gets seed + j, so the
samples differ and the whole response is reproducible. Extensions beside OpenAI's fields, as
vLLM's: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, return_token_ids,
cache_salt, speculative and num_speculative_tokens (an integer or "auto"), and ours,
penalize_prompt (false: repetition_penalty counts the output's tokens only), kv_window and
kv_sink_tokens (attention sinks with a window, docs/kv_compress.md), kv_compaction ({"ratio": 4,
"method": "select"}: KV compaction of the prompt, docs/kv_compress.md); for a chat,
add_generation_prompt, continue_final_message and chat_template_kwargs (`render_chat`, which
/tokenize shares).
"""
from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass

from cluster.types import GenerateRequest, TokenDelta, TokenLogprob
from proto.splitserve.v1 import inference_pb2 as pb
from router.chat_template import ChatTemplate, ChatTemplateError
from router.finish_reasons import to_openai
from router.openai.tool_calls import ToolError, ToolSpec, parse_tools, prepare_messages
from router.structured import ConstraintError, openai_constraint
from router.test_time_policy import TestTimeSpec
from router.validation import Limits, ValidationError, clip, cut_message, validate

COMPLETIONS_DEFAULT_MAX_TOKENS = 16     # OpenAI's documented default for /v1/completions
INT32_MAX = 2**31 - 1


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        message = cut_message(message)     # never a client's value at length
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Endpoint(enum.Enum):
    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"


@dataclass(frozen=True)
class PromptGroup:
    """One prompt's `n` samples; choice index of sample j is `first_index + j`."""
    requests: tuple[GenerateRequest, ...]
    first_index: int
    echo_text: str = ""


@dataclass(frozen=True)
class Job:
    """One HTTP request's work, validated."""
    endpoint: Endpoint
    id: str
    created: int
    model: str
    groups: tuple[PromptGroup, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None          # top-N per token (completions' `logprobs`, chat's `top_logprobs`)
    echo: bool
    return_token_ids: bool
    tools: ToolSpec | None = None  # chat with tools: calls are parsed out of the replies (router/openai/tool_calls.py)
    test_time: TestTimeSpec | None = None  # its samples run, one is chosen (router/openai/test_time.py)

    @property
    def num_requests(self) -> int:
        return sum(len(g.requests) for g in self.groups)


def _err(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _field(body: dict, name: str, types, default=None, *, nullable: bool = True):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _err(name, f"expected {_type_names(types)}, got a boolean")
    if not isinstance(value, types):
        raise _err(name, f"expected {_type_names(types)}, got {type(value).__name__}")
    return value


def _int(body: dict, name: str, lo: int, hi: int, default=None):
    value = _field(body, name, int, default)
    if value is not None and not lo <= value <= hi:
        raise _err(name, f"must be in [{lo}, {hi}], got {clip(value)}")
    return value


def _number(body: dict, name: str, default=None):
    value = _field(body, name, (int, float), default)
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:
        raise _err(name, f"is out of range: {clip(value)}") from None


def _type_names(types) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in (types if isinstance(types, tuple) else (types,)))


_UNSUPPORTED = ("presence_penalty", "frequency_penalty", "logit_bias", "suffix")


def _neutral(name: str, value) -> bool:
    """An unsupported field left at a value that asks for nothing (as clients often send it)."""
    if value is None or value in ("", {}, []):
        return True
    if name in ("presence_penalty", "frequency_penalty"):
        return value == 0
    return False


def _refuse_unsupported(body: dict) -> None:
    for name in _UNSUPPORTED:
        if not _neutral(name, body.get(name)):
            hint = " (repetition_penalty is the penalty this server has)" if "penalty" in name else ""
            raise _err(name, f"is not supported by this server; leave it unset{hint}")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise _err("best_of", "is not supported (only best_of == n)")


def _constraint(body: dict) -> pb.StructuredOutput | None:
    """response_format, structured_outputs or guided_* (router/structured.py), as the proto field."""
    try:
        return openai_constraint(body)
    except ConstraintError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def _sampling(body: dict, max_tokens_default: int | None, logprobs: int | None, limits: Limits,
              constraint: pb.StructuredOutput | None = None):
    sp = pb.SamplingParams(
        temperature=_number(body, "temperature", 1.0), top_k=_int(body, "top_k", -1, INT32_MAX, 0),
        min_p=_number(body, "min_p", 0.0), ignore_eos=bool(_field(body, "ignore_eos", bool, False)),
        cache_salt=_field(body, "cache_salt", str, ""), speculative=_field(body, "speculative", str, ""))
    if (top_p := _number(body, "top_p")) is not None:
        sp.top_p = top_p
    if (rp := _number(body, "repetition_penalty")) is not None:
        sp.repetition_penalty = rp
    if (penalize_prompt := _field(body, "penalize_prompt", bool)) is not None:
        sp.penalize_prompt = penalize_prompt
    max_tokens = _field(body, "max_completion_tokens", int)
    max_tokens = _field(body, "max_tokens", int, max_tokens_default) if max_tokens is None else max_tokens
    if max_tokens is not None:
        if max_tokens < 1:
            raise _err("max_tokens", f"must be at least 1, got {clip(max_tokens)}")
        sp.max_tokens = min(max_tokens, INT32_MAX)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _err("stop", "expected a string or an array of strings")
    sp.stop.extend(stop or [])
    stop_ids = _field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise _err("stop_token_ids", "expected an array of integers")
    if not all(0 <= t < limits.vocab_size for t in stop_ids):
        raise _err("stop_token_ids", f"ids must be in [0, {limits.vocab_size})")
    sp.stop_token_ids.extend(stop_ids)
    if logprobs is not None:
        sp.logprobs = logprobs
    k = body.get("num_speculative_tokens")
    if k == "auto":
        sp.auto_lookahead = True
    elif k is not None:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= limits.max_speculative_tokens:
            raise _err("num_speculative_tokens", f"expected an integer in [1, {limits.max_speculative_tokens}] "
                                                 "or \"auto\"")
        sp.num_speculative_tokens = k
    if (seed := _field(body, "seed", int)) is not None:
        if not 0 <= seed < 2**63:
            raise _err("seed", f"must be a non-negative 63-bit integer, got {clip(seed)}")
        sp.seed = seed
    if constraint is not None:
        sp.structured.CopyFrom(constraint)
    for name in ("kv_window", "kv_sink_tokens"):   # attention sinks with a window (docs/kv_compress.md)
        if (value := _int(body, name, 0, INT32_MAX)) is not None:
            setattr(sp, name, value)
    if (kvc := _field(body, "kv_compaction", dict)) is not None:   # {"ratio": 4, "method": "select"}
        try:
            sp.kv_compaction.CopyFrom(pb.KVCompaction(**kvc))
        except (TypeError, ValueError) as exc:
            raise _err("kv_compaction", str(exc)[:200]) from None
    return sp


_PARAMS = {"prompt.text": "prompt", "prompt.token_ids": "prompt", "prompt": "prompt"}
_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "tools")


def _constraint_param(body: dict) -> str:
    """The body's field a constraint the grammar library refuses came from."""
    return next((name for name in _CONSTRAINT_FIELDS if body.get(name) not in (None, [])), "response_format")


def _validated(proto, limits: Limits, tokenize, prompt_param: str, tenant: str,
               constraint_param: str = "response_format") -> GenerateRequest:
    try:
        return validate(proto, limits, tokenize, tenant)
    except ValidationError as exc:
        param = exc.field.removeprefix("sampling.")
        param = prompt_param if _PARAMS.get(param) == "prompt" else param
        param = constraint_param if param.startswith("structured") else param
        raise ApiError(400, f"{param}{str(exc)[len(exc.field):]}", param=param) from None


def _prompts(value, vocab_size: int) -> list[str | list[int]]:
    """OpenAI's prompt: a string, an array of strings, an array of token ids, or an array of those."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            prompts = [value]
        elif all(isinstance(p, str) for p in value):
            return list(value)
        elif all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                 for p in value):
            prompts = list(value)
        else:
            prompts = None
        if prompts is not None:
            if not all(0 <= t < vocab_size for p in prompts for t in p):
                raise _err("prompt", f"token ids must be in [0, {vocab_size})")
            return prompts
    raise _err("prompt", "expected a non-empty string, array of strings, array of token ids, or array of those")


def samples_needed(body, limits: Limits, endpoint: Endpoint) -> int:
    """The in-flight slots a body asks for (prompts x n), checked against the request bounds:
    cheap, so that admission comes before any tokenization."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    prompts = 1
    if endpoint is Endpoint.COMPLETIONS:
        value = body.get("prompt")
        if isinstance(value, list) and value and not isinstance(value[0], int):
            prompts = len(value)
    return prompts * _samples_per_prompt(body, prompts, limits)


def _samples_per_prompt(body: dict, prompts: int, limits: Limits) -> int:
    """`n`, checked: in range, and prompts x n within the request's share of the slots."""
    b = limits.bounds
    n = _int(body, "n", 1, b.max_n, 1)
    if prompts * n > b.max_samples_per_request:
        raise _err("n" if prompts == 1 else "prompt",
                   f"{prompts} prompt(s) x n={n} is {prompts * n} samples; a request may have at most "
                   f"{b.max_samples_per_request} (--max-samples-per-request)")
    return n


def _memo(tokenize):
    """Tokenize each distinct text once (a prompt's `n` samples share it)."""
    done: dict[str, list[int]] = {}

    def once(text: str) -> list[int]:
        if text not in done:
            done[text] = tokenize(text)
        return done[text]
    return once


def _groups(body: dict, prompts: list, limits: Limits, tokenize, detokenize,
            max_tokens_default, logprobs, echo: bool, prompt_param: str, tenant: str,
            constraint: pb.StructuredOutput | None = None) -> tuple[PromptGroup, ...]:
    # test_time's samples are made from the one request (router/test_time.py `sample_requests`).
    n = 1 if body.get("test_time") is not None else _samples_per_prompt(body, len(prompts), limits)
    base = _sampling(body, max_tokens_default, logprobs, limits, constraint)
    tokenize = _memo(tokenize) if tokenize is not None else None
    rid = uuid.uuid4().hex
    groups = []
    for p, prompt in enumerate(prompts):
        reqs = []
        for j in range(n):
            sp = pb.SamplingParams()
            sp.CopyFrom(base)
            if base.HasField("seed"):
                sp.seed = (base.seed + j) % 2**63
            proto = pb.GenerateRequest(request_id=f"{rid}-{p}-{j}", model=limits.model_id, sampling=sp)
            if isinstance(prompt, str):
                proto.text = prompt
            else:
                proto.token_ids.ids.extend(prompt)
            if echo and logprobs is not None and j == 0:   # the prompt's are the same for every sample
                proto.sampling.prompt_logprobs = logprobs
            reqs.append(_validated(proto, limits, tokenize, prompt_param, tenant, _constraint_param(body)))
        echo_text = (prompt if isinstance(prompt, str) else detokenize(prompt)) if echo else ""
        groups.append(PromptGroup(tuple(reqs), p * n, echo_text))
    return tuple(groups)


def check_body(body, max_depth: int) -> None:
    """A parsed JSON body holds no lone surrogate (JSON's "\\ud800" escape, which no UTF-8 text can
    hold) in any key or string, and nests at most `max_depth` deep; the 400 names the first place."""
    stack = [(body, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > max_depth:
            raise _err(_path(path) or "body", f"nests deeper than {max_depth} levels")
        if isinstance(value, str):
            _utf8(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _utf8(k, path)
                if isinstance(v, (str, dict, list)):
                    stack.append((v, depth + 1, (*path, k)))
        elif isinstance(value, list):
            stack.extend((v, depth + 1, (*path, i)) for i, v in enumerate(value) if isinstance(v, (str, dict, list)))


def _utf8(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _err(_path(path) or "body", "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); "
                                          "send valid Unicode") from None


def _path(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


def served_model(body, limits: Limits) -> str:
    """The body's `model` (the served one when it names none): a JSON object's, or the 400 or 404."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = _field(body, "model", str, limits.model_id)
    if model != limits.model_id:
        raise ApiError(404, f"The model {clip(model)} does not exist; this server serves `{limits.model_id}`",
                       param="model", code="model_not_found")
    return model


def _common(body: dict, limits: Limits) -> tuple[str, bool, bool]:
    model = served_model(body, limits)
    _refuse_unsupported(body)
    stream = bool(_field(body, "stream", bool, False))
    options = _field(body, "stream_options", dict, {})
    return model, stream, bool(options.get("include_usage", False))


def parse_completion(body, limits: Limits, tokenize, detokenize, tenant: str = "") -> Job:
    model, stream, usage = _common(body, limits)
    if "prompt" not in body:
        raise _err("prompt", "is required")
    logprobs = _int(body, "logprobs", 0, limits.bounds.max_logprobs)
    echo = bool(_field(body, "echo", bool, False))
    groups = _groups(body, _prompts(body["prompt"], limits.vocab_size), limits, tokenize, detokenize,
                     min(COMPLETIONS_DEFAULT_MAX_TOKENS, limits.max_tokens_limit), logprobs, echo, "prompt", tenant,
                     _constraint(body))
    return Job(Endpoint.COMPLETIONS, f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, groups, stream, usage,
               logprobs, echo, bool(_field(body, "return_token_ids", bool, False)))


def render_chat(body: dict, limits: Limits, template: ChatTemplate | None) -> str:
    """A chat body's prompt text, the model's template over its messages (/v1/chat/completions and
    /tokenize alike), or the 400 naming the field."""
    if template is None:
        raise ApiError(400, f"model `{limits.model_id}` has no chat template (none in its tokenizer_config.json "
                            "or chat_template.jinja); start the server with --chat-template FILE, or use "
                            "/v1/completions", param="messages", code="no_chat_template")
    generation_prompt = bool(_field(body, "add_generation_prompt", bool, True))
    continue_final = bool(_field(body, "continue_final_message", bool, False))
    if generation_prompt and continue_final:
        raise _err("continue_final_message", "cannot be used with add_generation_prompt (set it to false)")
    tools = chat_tools(body)
    own = "tools" in template.source      # the template renders tools itself; else router/openai/tool_calls.py does
    messages = prepare_messages(body.get("messages"), tools, own)
    try:
        return template.render(messages, add_generation_prompt=generation_prompt,
                               tools=body.get("tools") if own and tools is not None and tools.parses_calls else None,
                               extra=_field(body, "chat_template_kwargs", dict, {}),
                               continue_final_message=continue_final)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None


def chat_tools(body: dict) -> ToolSpec | None:
    try:
        return parse_tools(body)
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


def parse_chat(body, limits: Limits, template: ChatTemplate | None, tokenize_rendered, tenant: str = "") -> Job:
    model, stream, usage = _common(body, limits)
    text = render_chat(body, limits, template)
    if limits.surely_too_long(text):
        raise _err("messages", f"the conversation has {len(text)} characters, more than the model's context of "
                               f"{limits.max_model_len} tokens can hold")
    top = _int(body, "top_logprobs", 0, limits.bounds.max_logprobs)
    logprobs = (top or 0) if _field(body, "logprobs", bool, False) else None
    if top is not None and logprobs is None:
        raise _err("top_logprobs", "needs logprobs: true")
    tools = chat_tools(body)
    constraint = _constraint(body)
    if tools is not None and (forced := tools.constraint()) is not None:
        if constraint is not None:
            raise _err("tool_choice", "a required or named tool call cannot be combined with response_format "
                                      "or another output constraint")
        constraint = forced
    groups = _groups(body, [tokenize_rendered(text)], limits, None, None, None, logprobs,
                     False, "messages", tenant, constraint)
    return Job(Endpoint.CHAT, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, groups, stream, usage,
               logprobs, False, bool(_field(body, "return_token_ids", bool, False)),
               tools if tools is not None and tools.parses_calls else None)


# --- responses ------------------------------------------------------------------------------------
class Choice:
    """What has streamed for one sample: its text, tokens, logprobs and finish reason."""

    __slots__ = ("index", "text", "token_ids", "logprobs", "prompt_logprobs", "finish_reason", "offset",
                 "started", "num_prompt_tokens", "num_cached_tokens")

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()
        self.finish_reason: str | None = None
        self.offset = 0            # text offset of the next token (completions' logprobs.text_offset)
        self.started = False
        self.num_prompt_tokens = self.num_cached_tokens = 0

    def add(self, d: TokenDelta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        self.prompt_logprobs = self.prompt_logprobs or d.prompt_logprobs
        self.num_prompt_tokens = d.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        if d.finish_reason is not None:
            self.finish_reason = to_openai(d.finish_reason)


def usage(job: Job, choices: dict[int, Choice]) -> dict:
    """Prompt tokens once per prompt (its samples share them), completion tokens of every sample."""
    leads = [choices[g.first_index] for g in job.groups]
    prompt = sum(c.num_prompt_tokens for c in leads)
    completion = sum(len(c.token_ids) for c in choices.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in leads)}}


class LogprobFormatter:
    """Token logprobs in the completions shape (tokens / token_logprobs / top_logprobs /
    text_offset) or the chat shape (content: [{token, logprob, bytes, top_logprobs}])."""

    def __init__(self, token_text):
        self.token_text = token_text

    def completion(self, entries: list[TokenLogprob | None], ids: list[int], offset: int) -> tuple[dict, int]:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lp in zip(ids, entries):
            text = self.token_text(tok)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else {self.token_text(t): v for t, v in lp.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    def chat(self, entries: list[TokenLogprob]) -> dict:
        def one(tok: int, logprob: float) -> dict:
            text = self.token_text(tok)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}
                            for lp in entries]}
