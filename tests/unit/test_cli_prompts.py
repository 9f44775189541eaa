"""What the command line sends: a chat model's template for a user message, the text as is with
--raw or for a model without a template, and over --server only when the server serves the same
model (asked with ListModels; the server here is a stand-in answering that one call)."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

from cluster.launch.chat_cli import PromptBuilder, chat_loop
from cluster.launch.remote_commands import _remote_prompt
from proto.splitserve.v1 import inference_pb2 as pb
from tiny_models import make_chat_model, make_model


class _Stub:
    def __init__(self, served: str):
        self.served = served

    def ListModels(self, request, metadata=None):
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=self.served)])


def test_prompts_follow_the_template_and_the_server(tmp_path):
    chat = make_chat_model(tmp_path / "chatty", "llama")
    plain = make_model(tmp_path / "plain", "llama")
    builder = PromptBuilder(chat)
    ids = builder.prompt("hi")
    assert ids == builder.tokenizer.encode(builder.template.render([{"role": "user", "content": "hi"}]),
                                           add_special_tokens=False).ids
    assert builder.prompt("hi", raw=True) == "hi" and PromptBuilder(plain).prompt("hi") == "hi"
    args = argparse.Namespace(raw=False, model=str(chat), prompt="hi")
    assert _remote_prompt(SimpleNamespace(stub=_Stub("chatty"), api_key=None), args) == ids
    assert _remote_prompt(SimpleNamespace(stub=_Stub("another"), api_key=None), args) == "hi"


def test_chat_loop_keeps_the_conversation():
    seen = []

    def reply(messages):
        seen.append([m["content"] for m in messages])
        yield f"<{len(messages)}>"
    lines = iter(["a", "", "b", "/exit"])
    out = SimpleNamespace(text="", write=lambda s: setattr(out, "text", out.text + s), flush=lambda: None)
    assert chat_loop(reply, out=out, read=lambda _: next(lines)) == 0
    assert seen == [["a"], ["a", "<1>", "b"]] and out.text == "<1>\n<3>\n"
