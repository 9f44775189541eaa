import json

import pytest

from router.chat_template import ChatTemplate, ChatTemplateError
from tiny_models import CHATML_TEMPLATE, make_chat_model

CONVERSATIONS = {
    "system+user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    "multi-turn": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"},
                   {"role": "user", "content": "Grüße — ünïcödé ✓ 日本語"}],
    "text-parts": [{"role": "developer", "content": "Be kind."},
                   {"role": "user", "content": [{"type": "text", "text": "first"},
                                                {"type": "text", "text": "second"}]}],
    "tool-call": [{"role": "user", "content": "6*7?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"type": "function", "function": {"name": "mul", "arguments": "{}"}}]},
                  {"role": "tool", "content": "42"}],
}
TOOLS = [{"type": "function", "function": {"name": "mul", "description": "multiplie ×",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def hf_tokenizer(chat_dir):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(chat_dir)


def _template(source, bos="<s>", eos="</s>"):
    return ChatTemplate(source=source, bos_token=bos, eos_token=eos, origin="test")


def _write_config(d, **config):
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", **config}))
    return d


# --- parity with transformers -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(chat_dir, hf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = ChatTemplate.load(chat_dir).render(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_matches_transformers_with_tools(chat_dir, hf_tokenizer):
    messages = CONVERSATIONS["system+user"]
    ours = ChatTemplate.load(chat_dir).render(messages, tools=TOOLS)
    theirs = hf_tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours == theirs and "multiplie ×" in ours   # tojson keeps non-ASCII as is


def test_exact_chatml_text(chat_dir):
    t = ChatTemplate.load(chat_dir)
    assert t.render(CONVERSATIONS["text-parts"], add_generation_prompt=False) == (
        "<|im_start|>developer\nBe kind.<|im_end|>\n<|im_start|>user\nfirst\nsecond<|im_end|>\n")
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")


def test_render_leaves_messages_untouched(chat_dir):
    messages = json.loads(json.dumps(CONVERSATIONS["text-parts"] + CONVERSATIONS["tool-call"]))
    before = json.dumps(messages)
    ChatTemplate.load(chat_dir).render(messages)
    assert json.dumps(messages) == before


# --- load ------------------------------------------------------------------------------------------------

def test_load_none_without_template(tiny_model_dir):
    assert ChatTemplate.load(tiny_model_dir("llama")) is None


def test_load_prefers_override_then_jinja_file(tmp_path):
    d = _write_config(tmp_path / "m", chat_template="from-config")
    assert ChatTemplate.load(d).source == "from-config"
    (d / "chat_template.jinja").write_text("from-jinja-file")
    assert ChatTemplate.load(d).source == "from-jinja-file"
    override = tmp_path / "override.jinja"
    override.write_text("{{ bos_token }}override")
    t = ChatTemplate.load(d, override=override)
    assert t.source == "{{ bos_token }}override" and t.origin == str(override)
    assert t.render([{"role": "user", "content": "x"}]) == "<s>override"


def test_load_override_without_model_template(tiny_model_dir, tmp_path):
    override = tmp_path / "t.jinja"
    override.write_text(CHATML_TEMPLATE)
    t = ChatTemplate.load(tiny_model_dir("llama"), override=str(override))
    assert t.render([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.load(tiny_model_dir("llama"), override=tmp_path / "missing.jinja")
    assert e.value.field == "chat_template"


def test_load_picks_default_from_list(tmp_path):
    d = _write_config(tmp_path / "m", chat_template=[{"name": "tool_use", "template": "tools"},
                                                      {"name": "default", "template": "plain"}])
    assert ChatTemplate.load(d).source == "plain"
    d = _write_config(tmp_path / "n", chat_template=[{"name": "tool_use", "template": "tools"}])
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.load(d)
    assert e.value.field == "chat_template" and "default" in str(e.value)


def test_load_tokens_as_dicts_or_missing(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ bos_token }}|{{ eos_token }}",
        "bos_token": {"content": "<|begin|>", "lstrip": False, "special": True}}))
    t = ChatTemplate.load(d)
    assert (t.bos_token, t.eos_token) == ("<|begin|>", "")
    assert t.render([{"role": "user", "content": "x"}]) == "<|begin|>|"


def test_syntax_error_at_load(tmp_path):
    d = _write_config(tmp_path / "m", chat_template="{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.load(d)
    assert e.value.field == "chat_template" and "line 2" in str(e.value)
    with pytest.raises(ChatTemplateError) as e:   # built directly: the same error at render
        _template("{% if %}").render([{"role": "user", "content": "x"}])
    assert e.value.field == "chat_template"


# --- sandbox and template behaviour ---------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append(1) }}",
    "{% set d = {} %}{{ d.update(a=1) }}",
    "{{ 'x'.format.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
])
def test_sandbox_escape_refused(source):
    with pytest.raises(ChatTemplateError) as e:
        _template(source).render([{"role": "user", "content": "x"}])
    assert e.value.field == "messages" and "unsafe" in str(e.value)


def test_raise_exception_message():
    t = _template("{% if messages[0].role != 'system' %}{{ raise_exception('System first, please!') }}{% endif %}ok")
    with pytest.raises(ChatTemplateError) as e:
        t.render([{"role": "user", "content": "x"}])
    assert e.value.field == "messages" and "System first, please!" in str(e.value)
    assert t.render([{"role": "system", "content": "x"}]) == "ok"


def test_runtime_error_becomes_chat_template_error():
    with pytest.raises(ChatTemplateError) as e:
        _template("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    assert e.value.field == "messages"


def test_globals_filters_and_extra():
    t = _template("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
                  "|{{ {'é': [1]} | tojson }}|{{ {'a': 1} | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}"
                  "|{{ enable_thinking }}|{{ tools | length }}")
    out = t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                   tools=[{"n": 1}], extra={"enable_thinking": False})
    assert out == 'a|{"é": [1]}|{\n  "a": 1\n}|4|False|1'


# --- message validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hello", "messages"),
    (None, "messages"),
    (["hello"], "messages[0]"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": 3, "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}], "messages[1].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": {"text": "x"}}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": "s"},
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
     "messages[1].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}], "messages[0].content[1].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": ["a"]}], "messages[0].content[0]"),
])
def test_bad_messages_name_the_field(chat_dir, messages, field):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.load(chat_dir).render(messages)
    assert e.value.field == field and str(e.value).startswith(field + ":")
    assert isinstance(e.value, ValueError)


def test_bad_tools(chat_dir):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.load(chat_dir).render([{"role": "user", "content": "x"}], tools={"a": 1})
    assert e.value.field == "tools"


# --- continue_final_message -------------------------------------------------------------------------------

@pytest.mark.parametrize("final", ["The answer is", "The answer is ", "Grüße — ✓"])
def test_continue_final_message_matches_transformers(chat_dir, hf_tokenizer, final):
    messages = [*CONVERSATIONS["system+user"], {"role": "assistant", "content": final}]
    ours = ChatTemplate.load(chat_dir).render(messages, add_generation_prompt=False, continue_final_message=True)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                              continue_final_message=True)
    assert ours == theirs and ours.endswith("<|im_start|>assistant\n" + final)      # no end of turn after it


def test_continue_final_message_needs_text_the_template_renders(chat_dir):
    t = ChatTemplate.load(chat_dir)
    for messages in ([{"role": "assistant", "content": None}], [{"role": "user", "content": "  "}]):
        with pytest.raises(ChatTemplateError) as e:
            t.render(messages, add_generation_prompt=False, continue_final_message=True)
        assert e.value.field == "continue_final_message"
    hidden = _template("{% for m in messages %}[{{ m.content | upper }}]{% endfor %}")
    with pytest.raises(ChatTemplateError) as e:
        hidden.render([{"role": "user", "content": "quiet"}], continue_final_message=True)
    assert e.value.field == "continue_final_message"
