"""What the command line sends a model: a chat model gets its chat template applied (the text as
one user message), a model without one gets the text as is; `--raw` sends the text as is always.
And `splitserve chat`, a conversation in the terminal, against a local cluster or a running server.
"""
from __future__ import annotations

import http.client
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cluster.model.tokenizer import load_tokenizer
from router.chat_template import ChatTemplate

STOP_WORDS = ("/exit", "/quit")


class PromptBuilder:
    """Token ids for a conversation, as the OpenAI chat endpoint makes them (the model's template,
    then the tokenizer without special tokens: the template writes its own)."""

    def __init__(self, model_dir: Path, chat_template: str | None = None):
        self.template = ChatTemplate.load(model_dir, chat_template)
        self.tokenizer = load_tokenizer(model_dir)

    @property
    def has_template(self) -> bool:
        return self.template is not None

    def conversation(self, messages: list[dict]) -> list[int]:
        text = self.template.render(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt(self, text: str, raw: bool = False) -> str | list[int]:
        """What to send for one prompt: its chat-formatted ids, or the text itself."""
        if raw or not self.has_template:
            return text
        return self.conversation([{"role": "user", "content": text}])


@dataclass(frozen=True)
class Cut:
    """What a `reply` yields last when a token limit ended the answer (not the model)."""
    max_tokens: int | None

    def line(self) -> str:
        limit = f"{self.max_tokens} tokens" if self.max_tokens else "the token limit"
        return f"[cut at {limit}: --max-tokens N gives more]"


def chat_loop(reply, out=sys.stdout, read=input, note=None) -> int:
    """Read a line, send the conversation so far, stream the answer; /exit or end of input stops.
    `reply(messages)` yields text pieces (and a `Cut` when a limit ended the answer, which
    `note(line)` is told in one line)."""
    messages: list[dict] = []
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        if line.strip() in STOP_WORDS:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        answer, cut = [], None
        for piece in reply(messages):
            if isinstance(piece, Cut):
                cut = piece
                continue
            answer.append(piece)
            out.write(piece)
            out.flush()
        out.write("\n")
        out.flush()
        if cut is not None and note is not None:
            note(cut.line())
        messages.append({"role": "assistant", "content": "".join(answer)})


def _sse_post(base_url: str, path: str, body: dict, api_key: str | None, piece):
    """POST a streamed request to a server's OpenAI API; yields `piece(choice)` of every event."""
    url = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    conn = (http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection)(
        url.hostname, url.port, timeout=600)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the server answered {resp.status}: {resp.read().decode(errors='replace')[:300]}")
    for line in resp:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                yield piece(choice)
    conn.close()


def _http_events(base_url, path, body, api_key, text_of, max_tokens):
    """Text pieces of a streamed OpenAI answer, a `Cut` after them when the length limit ended it."""
    def piece(choice):
        return [text_of(choice) or "", Cut(max_tokens) if choice.get("finish_reason") == "length" else None]
    for text, cut in _sse_post(base_url, path, body, api_key, piece):
        if text:
            yield text
        if cut is not None:
            yield cut


def http_reply(base_url: str, model: str | None, api_key: str | None, max_tokens: int | None, sampling: dict,
               seed: int | None = None):
    """A `reply` over a server's OpenAI API (/v1/chat/completions, streamed): its template applies.
    `sampling`: the request's sampling fields; turn i is seeded `seed + i`."""
    turns = itertools.count()

    def reply(messages):
        body = {"messages": messages, **sampling, **({"max_tokens": max_tokens} if max_tokens else {}),
                **({"model": model} if model else {}), **({"seed": seed + next(turns)} if seed is not None else {})}
        yield from _http_events(base_url, "/v1/chat/completions", body, api_key,
                                lambda choice: choice.get("delta", {}).get("content"), max_tokens)
    return reply


def http_completion(base_url: str, api_key: str | None, prompt: str | list[int], max_tokens: int | None,
                    sampling: dict | None = None, seed: int | None = None):
    """One prompt (text, or token ids rendered here) through /v1/completions, streamed: its text
    pieces (greedy unless `sampling` says otherwise), then a `Cut` if the limit ended it."""
    body = {"prompt": prompt, "temperature": 0.0, **(sampling or {}),
            **({"max_tokens": max_tokens} if max_tokens else {}), **({"seed": seed} if seed is not None else {})}
    yield from _http_events(base_url, "/v1/completions", body, api_key, lambda choice: choice.get("text"), max_tokens)


def room_left(max_model_len: int, prompt_len: int, max_tokens: int | None, bound: int) -> int:
    """The answer's limit: the tokens given, else the room left in the context (at most `bound`,
    the most a request may ask for: the server's --max-tokens-limit)."""
    return max_tokens if max_tokens else max(1, min(bound, max_model_len - prompt_len))
