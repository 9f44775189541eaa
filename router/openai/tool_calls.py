"""Tool calls in chat: OpenAI's `tools` and `tool_choice` in, `tool_calls` out.

The format is Hermes / Qwen's: a call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
in the assistant's text. A model whose chat template renders `tools` itself gets them that way;
for one whose template does not (SmolLM2's), `prepare_messages` writes them into the system
message in that format and turns earlier turns' calls and results into text the model reads
(assistant calls as <tool_call> blocks, tool results as <tool_response> in a user turn).

`tool_choice`: `none` (the tools are not shown), `auto` (the model decides; calls it makes are
parsed out of its text), `required` or a named function: a grammar then forces exactly one call
of one of the tools (or of the named one) whose arguments match the function's JSON schema, so
the call always parses (router/structured.py carries it as the `tool_call` constraint).
`ToolCallParser` takes the text apart, whole or as it streams: text before a call is content;
a call leaves as one `tool_calls` delta once its closing tag has arrived.
"""
from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass

from proto.splitserve.v1 import inference_pb2 as pb

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_TOOLS = 128


class ToolError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: str          # its JSON schema, as JSON text


@dataclass(frozen=True)
class ToolSpec:
    functions: tuple[Function, ...]
    choice: ToolChoice
    named: str = ""          # the function of a NAMED choice

    @property
    def parses_calls(self) -> bool:
        return self.choice is not ToolChoice.NONE and bool(self.functions)

    def constraint(self) -> pb.StructuredOutput | None:
        """The grammar of a `required` or named choice: one call of one allowed function."""
        if self.choice not in (ToolChoice.REQUIRED, ToolChoice.NAMED):
            return None
        allowed = [f for f in self.functions if self.choice is ToolChoice.REQUIRED or f.name == self.named]
        return pb.StructuredOutput(tool_call=json.dumps(
            [{"name": f.name, "parameters": json.loads(f.parameters)} for f in allowed]))


def parse_tools(body: dict) -> ToolSpec | None:
    """`tools` and `tool_choice` of a chat body, checked; None when it has no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "needs `tools` (no function to call was given)")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools", "function names must be unique")
    return _choice(choice, functions)


def _function(tool, i: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(f"{where}.type", "only {\"type\": \"function\", \"function\": {...}} tools are supported")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"{where}.function.name", "must be 1-64 letters, digits, underscores or dashes")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ToolError(f"{where}.function.parameters", "must be a JSON schema (an object)")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise ToolError(f"{where}.function.description", "must be a string")
    return Function(name, description, json.dumps(params))


def _choice(choice, functions: tuple[Function, ...]) -> ToolSpec:
    if choice is None or choice == "auto":
        return ToolSpec(functions, ToolChoice.AUTO)
    if choice in ("none", "required"):
        return ToolSpec(functions, ToolChoice(choice))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {f.name for f in functions}:
            raise ToolError("tool_choice.function.name", f"names no function of `tools`: {str(name)[:64]!r}")
        return ToolSpec(functions, ToolChoice.NAMED, name)
    raise ToolError("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}")


# --- the prompt ---------------------------------------------------------------------------------
def system_text(functions: tuple[Function, ...]) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": {
        "name": f.name, "description": f.description, "parameters": json.loads(f.parameters)}}) for f in functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def prepare_messages(messages, spec: ToolSpec | None, template_handles_tools: bool):
    """The messages as the template should see them (see the module's docstring)."""
    if template_handles_tools or not isinstance(messages, list):
        return messages
    out = [_as_text(m) for m in messages]
    if spec is None or spec.choice is ToolChoice.NONE:
        return out
    tools = system_text(spec.functions)
    if out and isinstance(out[0], dict) and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        return [{**out[0], "content": f"{out[0]['content']}\n\n{tools}"}, *out[1:]]
    return [{"role": "system", "content": tools}, *out]


def _as_text(message):
    if not isinstance(message, dict):
        return message
    if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
        calls = message["tool_calls"]
        blocks = [f"{OPEN}\n{json.dumps(_call_json(c))}\n{CLOSE}" for c in calls if isinstance(c, dict)]
        text = "\n".join(([message["content"]] if isinstance(message.get("content"), str) and message["content"]
                          else []) + blocks)
        return {"role": "assistant", "content": text}
    if message.get("role") == "tool" and isinstance(message.get("content"), str):
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    return message


def _call_json(call: dict) -> dict:
    fn = call.get("function") if isinstance(call.get("function"), dict) else {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else (args or {})
    except ValueError:
        pass
    return {"name": fn.get("name"), "arguments": args}


# --- the output ---------------------------------------------------------------------------------
def openai_call(obj, index: int) -> dict | None:
    """One parsed call as OpenAI's `tool_calls` item; None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_text(text: str) -> tuple[str | None, list[dict]]:
    """A whole reply: its content (None when only calls) and its calls. A block that is not a
    well-formed call stays in the content."""
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        try:
            call = openai_call(json.loads(m.group(1)), len(calls))
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[at:])
    return "".join(kept).strip() or None, calls


class ToolCallParser:
    """The streaming side: feed text as it comes; content is released as soon as it cannot be the
    start of a call, a call once it is complete."""

    def __init__(self):
        self.buffer = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return content, calls
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                return content, calls
            block = self.buffer[start:end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE):]
            _, parsed = parse_text(block)
            if parsed:
                calls.append({**parsed[0], "index": self.calls})
                self.calls += 1
            else:
                content += block

    def finish(self) -> str:
        """What is left when the reply ends (an unfinished call is content)."""
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
