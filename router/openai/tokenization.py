"""vLLM's utility routes beside the OpenAI ones, in vLLM's shapes and at vLLM's paths (the root,
not /v1):

  GET  /version      -> {"version": "<splitserve's>"}
  POST /tokenize     a completion's body {"prompt": str, "add_special_tokens": true}
                     or a chat's {"messages": [...], "add_generation_prompt": true,
                     "continue_final_message": false, "add_special_tokens": false,
                     "chat_template_kwargs": {...}, "tools": [...]}; both take "model" and
                     "return_token_strs": false
                     -> {"count", "max_model_len", "tokens": [ids], "token_strs": [str] or null}
  POST /detokenize   {"model"?, "tokens": [ids]} -> {"prompt": "text"}

The ids are the prompt the server would run: a completion's text through the tokenizer call
/v1/completions makes, a chat rendered as /v1/chat/completions renders it (`render_chat`) and
tokenized as it is (router/tokenization.py). The rules are every route's: the key (401), the body
bounded and parsed off the loop, the work in the validation pool, an unknown model 404, a bad
field 400 naming it, ids outside the vocabulary 400. They take no in-flight slot (no worker runs
them); the pool's own bounds hold them. /version is open without a key, as /health is and as
vLLM's is (a load balancer or a client checks it before it has a key); the version is all it says.
"""
from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.chat_template import ChatTemplate
from router.openai.protocol import ApiError, _err, _field, render_chat, served_model
from router.tokenization import TokenCodec
from router.validation import Limits, ValidationError


def tokenize_body(body, limits: Limits, template: ChatTemplate | None, codec: TokenCodec) -> dict:
    """/tokenize's answer to a body of either shape (the chat's when it has `messages`)."""
    served_model(body, limits)
    with_strs = bool(_field(body, "return_token_strs", bool, False))
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise _err("prompt", "give either prompt (a text) or messages (a chat), not both")
        text = render_chat(body, limits, template)
        add_special_tokens = _field(body, "add_special_tokens", bool, False)   # the template writes them
    else:
        text = _field(body, "prompt", str)
        if text is None:
            raise _err("prompt", "is required (or messages, to tokenize a chat)")
        add_special_tokens = _field(body, "add_special_tokens", bool, True)
    out = codec.tokenize(text, add_special_tokens, with_strs)
    return {"count": len(out.token_ids), "max_model_len": limits.max_model_len, "tokens": list(out.token_ids),
            "token_strs": None if out.token_strs is None else list(out.token_strs)}


def detokenize_body(body, limits: Limits, codec: TokenCodec) -> dict:
    served_model(body, limits)
    ids = body.get("tokens")
    if ids is None:
        raise _err("tokens", "is required")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _err("tokens", "expected an array of integers")
    try:
        codec.check_ids(ids, "tokens")
    except ValidationError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
    return {"prompt": codec.detokenize(ids)}


class TokenizationRoutes:
    """The routes, on the OpenAI server's plumbing (its key check, body reader and pool)."""

    def __init__(self, server, codec: TokenCodec, template: ChatTemplate | None, version: str):
        """`server`: the `OpenAIServer` (router/openai/http_server.py)."""
        self.server = server
        self.codec = codec
        self.template = template
        self.version_text = version

    def routes(self) -> list[Route]:
        return [Route("/version", self.version, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": self.version_text})

    async def tokenize(self, request: Request) -> Response:
        tenant = self.server._authorize(request)
        body = await self.server._body(request, tenant)
        return await self._answer(tenant, tokenize_body, body, self.server.limits, self.template, self.codec)

    async def detokenize(self, request: Request) -> Response:
        tenant = self.server._authorize(request)
        body = await self.server._body(request, tenant)
        return await self._answer(tenant, detokenize_body, body, self.server.limits, self.codec)

    async def _answer(self, tenant: str, fn, *args) -> Response:
        """`fn(*args)` as JSON, made and encoded in the pool: a prompt of megabytes is megabytes of
        ids, too much JSON to write on the event loop."""
        return Response(await self.server._offload(tenant, _as_json, fn, *args), media_type="application/json")


def _as_json(fn, *args) -> bytes:
    return json.dumps(fn(*args), ensure_ascii=False, separators=(",", ":")).encode()
