"""/tokenize and /detokenize bodies (router/openai/tokenization.py) and the Tokenize and Detokenize
messages (router/tokenization.py) on a real byte-level BPE tokenizer with a BOS: the ids are the
generation routes' own, and every bad field is named."""
from __future__ import annotations

import pytest

from cluster.model.loader import load_tokenizer
from proto.splitserve.v1 import inference_pb2 as pb
from router.chat_template import ChatTemplate
from router.openai.protocol import ApiError
from router.openai.tokenization import detokenize_body, tokenize_body
from router.tokenization import TokenCodec, detokenize_message, tokenize_message
from router.validation import Limits, ValidationError
from tiny_models import CHATML_TEMPLATE, VOCAB, make_tokenizer

LIMITS = Limits(model_id="m", vocab_size=VOCAB, max_model_len=64, max_tokens_limit=32)
TEMPLATE = ChatTemplate(source=CHATML_TEMPLATE, bos_token="<s>", eos_token="</s>", origin="test")
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "def add(a, b):"}]
BOS = 0


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d, bos=True)
    return TokenCodec(load_tokenizer(d), LIMITS.vocab_size)


def _tokenize(codec, **body) -> dict:
    return tokenize_body({"model": "m", **body}, LIMITS, TEMPLATE, codec)


def test_a_text_is_tokenized_as_a_completions_prompt(codec):
    text = "for i in range(10):"
    r = _tokenize(codec, prompt=text)
    assert r["tokens"] == codec.prompt(text) and r["tokens"][0] == BOS
    assert (r["count"], r["max_model_len"], r["token_strs"]) == (len(r["tokens"]), 64, None)
    bare = _tokenize(codec, prompt=text, add_special_tokens=False, return_token_strs=True)
    assert bare["tokens"] == r["tokens"][1:]
    assert bare["token_strs"] == [codec.tokenizer.id_to_token(i) for i in bare["tokens"]]
    assert "".join(bare["token_strs"]).replace("Ġ", " ") == text       # byte-level entries, as vLLM answers
    assert tokenize_body({"prompt": text}, LIMITS, TEMPLATE, codec) == r   # model may be omitted


def test_a_chat_is_rendered_and_tokenized_as_a_chat_completions_prompt(codec):
    r = _tokenize(codec, messages=CHAT)
    rendered = TEMPLATE.render(CHAT, add_generation_prompt=True)
    assert r["tokens"] == codec.rendered(rendered) and r["tokens"][0] != BOS   # the template writes specials
    assert _tokenize(codec, messages=CHAT, add_special_tokens=True)["tokens"] == [BOS, *r["tokens"]]
    no_prompt = _tokenize(codec, messages=CHAT, add_generation_prompt=False)["tokens"]
    assert no_prompt == codec.rendered(TEMPLATE.render(CHAT, add_generation_prompt=False))
    assert len(no_prompt) < len(r["tokens"])
    opened = _tokenize(codec, messages=[*CHAT, {"role": "assistant", "content": "return"}],
                       add_generation_prompt=False, continue_final_message=True)["tokens"]
    assert codec.detokenize(opened).endswith("<|im_start|>assistant\nreturn")


def test_detokenize_round_trips_with_special_tokens(codec):
    ids = codec.prompt("class Point:\n    def")
    assert detokenize_body({"tokens": ids}, LIMITS, codec) == {"prompt": "<s>class Point:\n    def"}
    assert detokenize_body({"tokens": []}, LIMITS, codec) == {"prompt": ""}


@pytest.mark.parametrize("body, status, param", [
    ({}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ["a"]}, 400, "prompt"),
    ({"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ({"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ({"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
    ({"prompt": "x", "model": 7}, 400, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": CHAT, "add_generation_prompt": "no"}, 400, "add_generation_prompt"),
    ({"messages": CHAT, "chat_template_kwargs": 3}, 400, "chat_template_kwargs"),
    ({"messages": CHAT, "add_special_tokens": 1}, 400, "add_special_tokens"),
])
def test_bad_tokenize_fields_are_named(codec, body, status, param):
    with pytest.raises(ApiError) as e:
        tokenize_body(body, LIMITS, TEMPLATE, codec)
    assert (e.value.status, e.value.param) == (status, param), e.value.message


@pytest.mark.parametrize("body, status, param", [
    ({}, 400, "tokens"),
    ({"tokens": "12"}, 400, "tokens"),
    ({"tokens": [1, "a"]}, 400, "tokens"),
    ({"tokens": [1, True]}, 400, "tokens"),
    ({"tokens": [1, 2.0]}, 400, "tokens"),
    ({"tokens": [VOCAB]}, 400, "tokens"),              # outside the vocabulary
    ({"tokens": [-1]}, 400, "tokens"),
    ({"tokens": [2**70]}, 400, "tokens"),
    ({"tokens": [1], "model": "other"}, 404, "model"),
])
def test_bad_detokenize_fields_are_named(codec, body, status, param):
    with pytest.raises(ApiError) as e:
        detokenize_body(body, LIMITS, codec)
    assert (e.value.status, e.value.param) == (status, param), e.value.message


def test_a_body_that_is_no_object_and_a_chat_without_template(codec):
    with pytest.raises(ApiError) as e:
        tokenize_body(["prompt"], LIMITS, TEMPLATE, codec)
    assert e.value.status == 400
    with pytest.raises(ApiError) as e:
        tokenize_body({"messages": CHAT}, LIMITS, None, codec)
    assert (e.value.status, e.value.code) == (400, "no_chat_template")
    assert tokenize_body({"prompt": "x"}, LIMITS, None, codec)["count"] == 2      # a text needs none


def test_grpc_messages_tokenize_as_generate_and_name_bad_ids(codec):
    text = "import os"
    r = tokenize_message(pb.TokenizeRequest(text=text), LIMITS, codec)          # unset: special tokens added
    assert list(r.token_ids) == codec.prompt(text) and r.count == len(r.token_ids) and r.max_model_len == 64
    assert not r.token_strs
    bare = tokenize_message(pb.TokenizeRequest(text=text, add_special_tokens=False, return_token_strs=True),
                            LIMITS, codec)
    assert list(bare.token_ids) == codec.prompt(text)[1:] and len(bare.token_strs) == bare.count
    assert detokenize_message(pb.DetokenizeRequest(token_ids=r.token_ids), LIMITS, codec).text == "<s>" + text
    with pytest.raises(ValidationError) as e:
        detokenize_message(pb.DetokenizeRequest(token_ids=[1, VOCAB + 5, -3]), LIMITS, codec)
    assert e.value.field == "token_ids" and str([VOCAB + 5, -3]) in str(e.value)
    for msg, fn in ((pb.TokenizeRequest(text="x", model="other"), tokenize_message),
                    (pb.DetokenizeRequest(token_ids=[1], model="other"), detokenize_message)):
        with pytest.raises(ValidationError) as e:
            fn(msg, LIMITS, codec)
        assert e.value.field == "model"
