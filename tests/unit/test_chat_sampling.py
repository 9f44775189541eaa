"""What `chat` and `serve --request` sample with (cluster/launch/chat_sampling.py), how a cut answer
is said (chat_cli.py `Cut`), and the quiet console (console.py) in a real process."""
import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

from cluster.launch import chat_sampling
from cluster.launch.chat_cli import Cut, chat_loop, room_left
from cluster.launch.chat_sampling import CHAT_DEFAULTS, GREEDY, SHIPPED, model_sampling
from cluster.launch.cli_parser import build_parser
from cluster.model.gguf_import import sampling_defaults


def _args(*argv):
    return build_parser().parse_args(["chat", *argv])


def test_the_model_states_its_defaults_and_the_flags_win(tmp_path):
    plain = tmp_path / "some-model"
    plain.mkdir()
    assert model_sampling(plain) == CHAT_DEFAULTS and model_sampling(None) == CHAT_DEFAULTS
    smol = tmp_path / "SmolLM2-135M-Instruct.Q4_1"
    smol.mkdir()
    (smol / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert model_sampling(smol) == SHIPPED["SmolLM2-135M-Instruct"]
    # Our penalties count the answer's tokens only; a model's own counts the prompt's too (transformers').
    assert SHIPPED["SmolLM2-135M-Instruct"].request()["penalize_prompt"] is False
    assert "repetition penalty 1.15 on the answer's tokens" in model_sampling(smol).describe()
    (smol / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3}))
    assert model_sampling(smol).penalize_prompt is True and "penalize_prompt" not in model_sampling(smol).request()
    (smol / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (plain / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    stated = model_sampling(plain)
    assert (stated.temperature, stated.top_p, stated.top_k) == (0.6, 0.95, 20)
    assert stated.repetition_penalty == CHAT_DEFAULTS.repetition_penalty and "generation_config" in stated.source
    (plain / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert model_sampling(plain).temperature == 0.0
    given = chat_sampling.session_sampling(_args("--top-p", "0.5", "--repetition-penalty", "1.3"), smol)
    assert (given.temperature, given.top_p, given.repetition_penalty) == (0.2, 0.5, 1.3)


def test_temperature_zero_alone_is_plain_greedy_and_generate_stays_greedy(tmp_path):
    greedy = chat_sampling.session_sampling(_args("--temperature", "0"), tmp_path)
    assert greedy == GREEDY and greedy.request() == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                                     "repetition_penalty": 1.0}
    penalized = chat_sampling.session_sampling(_args("--temperature", "0", "--repetition-penalty", "1.2"), tmp_path)
    assert penalized.repetition_penalty == 1.2
    gen = build_parser().parse_args(["generate", "hi"])
    assert (gen.temperature, gen.repetition_penalty, gen.max_tokens) == (0.0, 1.0, 128)
    chat = _args()
    assert chat.temperature is None and chat.max_tokens is None and chat.verbose is False
    assert chat_sampling.session_seed(_args("--seed", "7")) == 7 and 0 <= chat_sampling.session_seed(chat) < 2**31


def test_gguf_metadata_states_sampling_as_generation_config_names_it():
    stated = {"general.sampling.temp": 0.6, "general.sampling.penalty_repeat": 1.05}
    meta = SimpleNamespace(get=stated.get)
    assert sampling_defaults(meta) == {"temperature": 0.6, "repetition_penalty": 1.05}


def test_a_cut_answer_is_said_in_one_line_below_it():
    notes = []

    def reply(messages):
        yield "an answer that"
        yield Cut(12)
    lines = iter(["hi", "/exit"])
    out = SimpleNamespace(text="", write=lambda s: setattr(out, "text", out.text + s), flush=lambda: None)
    assert chat_loop(reply, out=out, read=lambda _: next(lines), note=notes.append) == 0
    assert out.text == "an answer that\n" and notes == ["[cut at 12 tokens: --max-tokens N gives more]"]
    assert room_left(8192, 100, None, 9000) == 8092 and room_left(8192, 100, 64, 9000) == 64
    assert room_left(8192, 100, None, 4096) == 4096


CONSOLE_CHILD = textwrap.dedent("""
    import logging, os, sys, time
    from pathlib import Path
    from cluster.launch.console import Console, PhaseHandler
    with Console(Path(sys.argv[1])) as console:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        logging.getLogger("cluster").addHandler(PhaseHandler(console))
        logging.getLogger("cluster.x").info("converting", extra={"phase": "converting x (first start only)"})
        print("a Ray warning", file=sys.stderr, flush=True)
        os.write(2, b"a C++ line\\n")
        console.done("ready")
        print("the conversation")
    print("after", file=sys.stderr)
""")


def test_the_quiet_console_shows_a_status_line_and_sends_the_logs_to_a_file(tmp_path):
    log = tmp_path / "logs" / "chat.log"
    run = subprocess.run([sys.executable, "-c", CONSOLE_CHILD, str(log)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "the conversation\n"
    lines = run.stderr.splitlines()
    assert lines[0] == f"splitserve: logs in {log} (-v shows them here)"
    assert lines[1].startswith("splitserve: converting x (first start only) ... ") and lines[1].endswith(" s")
    assert lines[2:] == ["ready", "after"]
    kept = log.read_text()
    assert "INFO:cluster.x:converting" in kept and "a Ray warning" in kept and "a C++ line" in kept


def test_serve_request_and_chat_are_quiet_unless_verbose():
    from cluster.launch.cli import _console
    parse = build_parser().parse_args
    assert _console(parse(["chat"])).log_path is not None
    assert _console(parse(["chat", "-v"])).log_path is None
    assert _console(parse(["chat", "--server", "http://x:1"])).log_path is None
    assert _console(parse(["serve", "--request", "hi"])).log_path is not None
    assert _console(parse(["serve"])).log_path is None
    assert _console(parse(["generate", "hi"])).log_path is None
