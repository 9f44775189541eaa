"""Structured output at the router: the fields that ask for it, checked before any worker sees them.

Both APIs end in `splitserve.v1.StructuredOutput` (a oneof: json_schema, json_object, regex,
choice, grammar, lark, tool_call). OpenAI's `response_format` (json_object; json_schema with its
`schema`, strict or not: the output always matches), vLLM's `structured_outputs` ({json, regex,
choice, grammar, json_object}) and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` become one (`openai_constraint`); at most one of them may be set. `check`
compiles the constraint with the grammar library (without a tokenizer, so it is cheap) and turns
what the library refuses into the request's INVALID_ARGUMENT / 400, naming what is unsupported.
"""
from __future__ import annotations

import json

from cluster.types import StructuredKind, StructuredOutput
from proto.splitserve.v1 import inference_pb2 as pb
from router.errors import ValidationError

MAX_CONSTRAINT_CHARS = 65536       # a schema or grammar's text, as the server receives it
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_KINDS = {"json_schema": StructuredKind.JSON_SCHEMA, "json_object": StructuredKind.JSON_OBJECT,
          "regex": StructuredKind.REGEX, "choice": StructuredKind.CHOICE, "grammar": StructuredKind.GRAMMAR,
          "lark": StructuredKind.LARK, "tool_call": StructuredKind.TOOL_CALL}


class ConstraintError(ValueError):
    """A structured-output field the server cannot honour: `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def from_proto(msg) -> StructuredOutput:
    """The constraint of a `StructuredOutput` message, compiled once here to check it."""
    which = msg.WhichOneof("constraint")
    if which is None:
        raise ValidationError("sampling.structured", "set one of json_schema, json_object, regex, choice, grammar, "
                                                     "lark or tool_call")
    value = getattr(msg, which)
    if which == "json_object":
        if not value:
            raise ValidationError("sampling.structured.json_object", "must be true when set")
        spec = ""
    elif which == "choice":
        if not value.choices or not all(value.choices):
            raise ValidationError("sampling.structured.choice", "needs at least one non-empty string")
        spec = json.dumps(list(value.choices))
    else:
        spec = value
    if len(spec) > MAX_CONSTRAINT_CHARS:
        raise ValidationError(f"sampling.structured.{which}", f"has {len(spec)} characters; at most "
                                                              f"{MAX_CONSTRAINT_CHARS}")
    return check(StructuredOutput(_KINDS[which], spec), f"sampling.structured.{which}")


def check(spec: StructuredOutput, field: str) -> StructuredOutput:
    from cluster.engine.grammar import GrammarError, build_grammar  # noqa: PLC0415 - xgrammar loads torch
    try:
        build_grammar(spec)
    except GrammarError as exc:
        raise ValidationError(field, f"cannot be compiled: {exc}") from None
    return spec


def openai_constraint(body: dict) -> pb.StructuredOutput | None:
    """The constraint an OpenAI-style body asks for, as the proto field; ConstraintError names the
    field that is malformed or that clashes with another."""
    asked = [name for name in ("response_format", "structured_outputs", *_GUIDED) if _asks(name, body.get(name))]
    if len(asked) > 1:
        raise ConstraintError(asked[1], f"cannot be combined with {asked[0]}; give one constraint")
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        return _response_format(body[name])
    if name == "structured_outputs":
        return _structured_outputs(body[name])
    return _one(_GUIDED[name], body[name], name)


def _asks(name: str, value) -> bool:
    if value is None:
        return False
    if name == "response_format":
        return not (isinstance(value, dict) and value.get("type") == "text")
    return True


def _response_format(value) -> pb.StructuredOutput:
    if not isinstance(value, dict):
        raise ConstraintError("response_format", "must be an object with a `type`")
    kind = value.get("type")
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise ConstraintError("response_format.json_schema", "must be an object with the JSON schema under "
                                                                 "`schema` (and a `name`)")
        return pb.StructuredOutput(json_schema=json.dumps(inner["schema"]))
    raise ConstraintError("response_format.type", f"must be text, json_object or json_schema, got {str(kind)[:40]!r}")


def _structured_outputs(value) -> pb.StructuredOutput:
    if not isinstance(value, dict):
        raise ConstraintError("structured_outputs", "must be an object")
    keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if value.get(k) not in (None, False)]
    unknown = sorted(k for k in value if k not in ("json", "regex", "choice", "grammar", "json_object",
                                                   "disable_any_whitespace", "whitespace_pattern"))
    if unknown:
        raise ConstraintError(f"structured_outputs.{unknown[0]}", "is not supported by this server "
                                                                  "(json, regex, choice, grammar or json_object)")
    if len(keys) != 1:
        raise ConstraintError("structured_outputs", "must set exactly one of json, regex, choice, grammar, "
                                                    f"json_object; got {keys or 'none'}")
    if keys[0] == "json_object":
        return pb.StructuredOutput(json_object=True)
    return _one(keys[0], value[keys[0]], f"structured_outputs.{keys[0]}")


def _one(kind: str, value, param: str) -> pb.StructuredOutput:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ConstraintError(param, "is not valid JSON") from None
        if not isinstance(value, dict):
            raise ConstraintError(param, "must be a JSON schema (an object)")
        return pb.StructuredOutput(json_schema=json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ConstraintError(param, "must be a non-empty list of non-empty strings")
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=value))
    if not isinstance(value, str) or not value:
        raise ConstraintError(param, "must be a non-empty string")
    if kind == "regex":
        return pb.StructuredOutput(regex=value)
    # EBNF (GBNF) has `::=` rules; anything else is read as Lark, as vLLM's backends do.
    return pb.StructuredOutput(grammar=value) if "::=" in value else pb.StructuredOutput(lark=value)
