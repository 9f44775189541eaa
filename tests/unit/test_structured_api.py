"""The router's side of structured output and tool calls: which body fields ask for a constraint
(and the exact param of each error), the tool-call prompt, and taking replies apart into content
and calls, whole and streamed in any split."""
from __future__ import annotations

import json

import pytest

from cluster.types import StructuredKind
from proto.splitserve.v1 import inference_pb2 as pb
from router.openai.tool_calls import ToolCallParser, ToolChoice, ToolError, parse_text, parse_tools, prepare_messages
from router.structured import ConstraintError, from_proto, openai_constraint
from router.validation import ValidationError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


@pytest.mark.parametrize("body,field,value", [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json_schema",
     json.dumps(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", json.dumps(SCHEMA)),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
    ({"guided_regex": "a+"}, "regex", "a+"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"guided_grammar": 'start: "a"'}, "lark", 'start: "a"'),
    ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
])
def test_each_field_becomes_its_proto_constraint(body, field, value):
    msg = openai_constraint(body)
    assert msg.WhichOneof("constraint") == field and getattr(msg, field) == value


def test_choice_and_no_constraint():
    assert list(openai_constraint({"guided_choice": ["a", "b"]}).choice.choices) == ["a", "b"]
    assert openai_constraint({}) is None
    assert openai_constraint({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_malformed_or_clashing_fields_name_their_param(body, param):
    with pytest.raises(ConstraintError) as err:
        openai_constraint(body)
    assert err.value.param == param


def test_proto_constraints_compile_or_name_what_is_wrong():
    spec = from_proto(pb.StructuredOutput(choice=pb.ChoiceList(choices=["x", "y"])))
    assert spec.kind is StructuredKind.CHOICE and json.loads(spec.spec) == ["x", "y"]
    for msg, field in ((pb.StructuredOutput(regex="("), "sampling.structured.regex"),
                       (pb.StructuredOutput(json_schema='{"type": 5}'), "sampling.structured.json_schema"),
                       (pb.StructuredOutput(grammar="root ::= missing"), "sampling.structured.grammar"),
                       (pb.StructuredOutput(json_object=False), "sampling.structured.json_object"),
                       (pb.StructuredOutput(), "sampling.structured"),
                       (pb.StructuredOutput(regex="a" * 70000), "sampling.structured.regex")):
        with pytest.raises(ValidationError) as err:
            from_proto(msg)
        assert err.value.field == field, (msg, err.value)


def test_tools_and_tool_choice():
    assert parse_tools({}) is None
    assert parse_tools({"tools": [TOOL]}).choice is ToolChoice.AUTO
    spec = parse_tools({"tools": [TOOL, {**TOOL, "function": {"name": "g"}}], "tool_choice": "required"})
    forced = json.loads(spec.constraint().tool_call)
    assert [f["name"] for f in forced] == ["f", "g"] and forced[1]["parameters"] == {"type": "object",
                                                                                     "properties": {}}
    named = parse_tools({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert [f["name"] for f in json.loads(named.constraint().tool_call)] == ["f"]
    assert parse_tools({"tools": [TOOL], "tool_choice": "none"}).constraint() is None
    for body, param in (({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
                        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
                        ({"tools": [TOOL, TOOL]}, "tools"),
                        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
                         "tool_choice.function.name"),
                        ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice")):
        with pytest.raises(ToolError) as err:
            parse_tools(body)
        assert err.value.param == param


def test_tools_are_written_into_a_template_that_does_not_render_them():
    spec = parse_tools({"tools": [TOOL]})
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    out = prepare_messages(msgs, spec, template_handles_tools=False)
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "f"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>"}
    assert prepare_messages(msgs, spec, template_handles_tools=True) is msgs
    bare = prepare_messages([{"role": "user", "content": "a?"}], spec, False)
    assert bare[0]["role"] == "system" and bare[1] == {"role": "user", "content": "a?"}


REPLY = ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
         '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


def test_a_whole_reply_is_taken_apart():
    content, calls = parse_text(REPLY)
    assert content == "Let me check."
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(0, "f", {"a": 1}), (1, "g", {})]
    assert parse_text("no calls <tool_call> here") == ("no calls <tool_call> here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_text(broken) == (broken, [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50])
def test_a_streamed_reply_gives_the_same_content_and_calls_in_any_split(size):
    parser, content, calls = ToolCallParser(), "", []
    for i in range(0, len(REPLY), size):
        text, got = parser.feed(REPLY[i:i + size])
        content += text
        calls += got
    content += parser.finish()
    assert content.strip() == "Let me check."
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "f"), (1, "g")]
    # Text that only looks like the start of a tag is released once it cannot be one.
    parser = ToolCallParser()
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("s> b") == ("<tools> b", [])
