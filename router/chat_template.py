"""Chat templates for the OpenAI-compatible chat API: messages → one prompt string.

Rendering follows Hugging Face transformers' `apply_chat_template` (same sandbox, filters, globals and
variables), so a checkpoint's template produces here exactly the prompt it was trained on. Templates come
from the operator (the checkpoint or `--chat-template FILE`); messages come from clients, so they are
checked before rendering and every failure names the field an HTTP 400 should blame.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


_RENDER_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "tools"})   # the renderer's own


class ChatTemplateError(ValueError):
    """A chat request or template that cannot be rendered; `field` is what to name in the 400."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class _Sandbox(ImmutableSandboxedEnvironment):
    # Jinja's sandbox turns a single unsafe lookup (`''.__class__`) into an Undefined that prints as "";
    # raising at once makes any escape attempt an error rather than a quietly wrong prompt. Legitimate
    # templates never read unsafe attributes, so this changes nothing for them.
    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message):
    # Templates call this to reject a conversation they cannot express (e.g. roles out of order).
    raise ChatTemplateError("messages", str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes and takes no ensure_ascii; transformers overrides it like this.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


_ENV = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    # Keyed by source: a server has one or two templates, each compiled once for its lifetime.
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError("chat_template", f"line {e.lineno}: {e.message}") from None


def _token(value) -> str:
    # tokenizer_config.json writes a special token as "<s>" or as an AddedToken dict {"content": "<s>", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _pick(template, origin: str) -> str | None:
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):   # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError("chat_template", f"{origin} has no 'default' template (has {sorted(map(str, named))})")
    raise ChatTemplateError("chat_template", f"{origin}: expected a string or a list, got {type(template).__name__}")


def _content(content, role: str, field: str):
    """A message's content as the template sees it: a string, or None (the key is then left out)."""
    if isinstance(content, str):
        return content
    if content is None:
        if role != "assistant":   # only an assistant turn (one that just calls tools) may be empty
            raise ChatTemplateError(field, f"is required for role {role!r}")
        return None
    if not isinstance(content, list):
        raise ChatTemplateError(field, f"must be a string or a list of parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        if not isinstance(part, dict):
            raise ChatTemplateError(where, "must be an object")
        if part.get("type") != "text":   # this server serves text models: images, audio, files have no place
            raise ChatTemplateError(f"{where}.type", f"unsupported content part type {part.get('type')!r}; only 'text'")
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where}.text", "must be a string")
        texts.append(part["text"])
    # Joined here so every template, including those that only handle strings, sees plain text.
    return "\n".join(texts)


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages", "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatTemplateError(where, "must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError(f"{where}.role", "is required and must be a string")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role", f"unknown role {role!r}; expected one of {sorted(ROLES)}")
        content = _content(message.get("content"), role, f"{where}.content")
        # A shallow copy without None values, as transformers does: templates test `is defined`, and a
        # None would render as the text "None". Other keys (tool_calls, name, ...) pass through.
        copy = {k: v for k, v in message.items() if v is not None}
        if content is not None:
            copy["content"] = content
        out.append(copy)
    return out


@dataclass(frozen=True)
class ChatTemplate:
    source: str       # the Jinja text
    bos_token: str
    eos_token: str
    origin: str       # where the template came from, for logs and errors

    @classmethod
    def load(cls, model_dir, override=None) -> ChatTemplate | None:
        """The model's template: `override` (a file), else chat_template.jinja, else tokenizer_config.json.

        None when the model has none (a base model): the chat API is then refused, not guessed at.
        """
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ChatTemplateError("chat_template", f"cannot read {config_path}: {e}") from None
        if override is not None:
            origin = str(override)
            try:
                source = Path(override).read_text(encoding="utf-8")
            except OSError as e:
                raise ChatTemplateError("chat_template", f"cannot read {origin}: {e}") from None
        elif (model_dir / "chat_template.jinja").is_file():
            origin = str(model_dir / "chat_template.jinja")
            source = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            origin = f"{config_path}:chat_template"
            source = _pick(config.get("chat_template"), origin)
            if source is None:
                return None
        try:
            _compile(source)   # fail at startup, not on the first request
        except ChatTemplateError as e:
            raise ChatTemplateError("chat_template", f"{origin}: {e.message}") from None
        return cls(source=source, bos_token=_token(config.get("bos_token")),
                   eos_token=_token(config.get("eos_token")), origin=origin)

    def render(self, messages, add_generation_prompt: bool = True, tools=None, extra: dict | None = None,
               continue_final_message: bool = False) -> str:
        """The prompt for `messages`; ChatTemplateError (naming the field) when it cannot be made.
        `extra`: the request's chat_template_kwargs (template variables); `continue_final_message`:
        the prompt ends inside the last message, for the model to go on with it."""
        checked = _check_messages(messages)
        extra = extra or {}
        taken = sorted(set(extra) & _RENDER_ARGUMENTS)
        if taken:
            raise ChatTemplateError("chat_template_kwargs", f"may not set {', '.join(taken)}: give them as the request's "
                                                            "own fields")
        if tools is not None and not isinstance(tools, list):
            raise ChatTemplateError("tools", "must be a list")
        template = _compile(self.source)
        # Special tokens first so a caller's extra may override them, as in transformers.
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        try:
            text = template.render(variables, messages=checked, add_generation_prompt=add_generation_prompt,
                                   tools=tools)
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError("messages", f"chat template {self.origin} did something unsafe: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as e:
            # A template that breaks on this conversation (e.g. a shape it does not expect) is the
            # request's 400 with the reason, not a 500 without one.
            raise ChatTemplateError("messages", f"chat template {self.origin} failed: {e}") from None
        return _open_final_message(text, checked[-1]) if continue_final_message else text


def _open_final_message(rendered: str, final: dict) -> str:
    """`rendered` cut just after the final message's content, as transformers'
    `continue_final_message` cuts it: what the template closes a turn with (an end-of-turn marker, a
    newline) is dropped, so the model continues the message instead of starting a new one."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message", "the final message has no text to continue")
    core = content.strip()
    at = rendered.rfind(core)
    if at < 0:
        raise ChatTemplateError("continue_final_message", "the chat template does not render the final "
                                                          "message's text as it is, so it cannot be continued")
    kept = content.lstrip()       # its trailing whitespace too, where the template kept it
    return rendered[:at + len(kept)] if rendered.startswith(kept, at) else rendered[:at + len(core)]
