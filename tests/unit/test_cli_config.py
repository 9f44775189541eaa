"""The command line as a new user tries it: every setting reachable from flags and YAML, each
refusal one line naming the flag or YAML key (exit status 2), found before anything starts."""
import argparse
import json
import re
import socket
from concurrent import futures
from dataclasses import fields

import pytest

from cluster.config import EngineConfig
from cluster.launch import app, cli
from router.workers import WorkerRoster
from cluster.launch.cli import load, main
from cluster.launch.cli_parser import build_parser
from cluster.launch.cluster_config import ClusterConfig
from cluster.launch.settings import tree_settings

MODEL = "stdlib-coder"


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    """A refusal must come before Ray or a model: either would be a failure here."""
    async def no_cluster(cfg):
        raise AssertionError("start_cluster was reached")

    def no_engine(*a, **k):
        raise AssertionError("an engine was built")
    monkeypatch.setattr(app, "start_cluster", no_cluster)
    monkeypatch.setattr("cluster.engine.engine.LLMEngine", no_engine)
    monkeypatch.setattr(cli, "build_in_background", lambda folder: None)   # a first start's C build: not here


def test_a_first_start_builds_the_c_ops_beside_it_only_where_they_will_run(monkeypatch):
    """serve, chat and generate running here on CPU start the C ops' build at once (in a child
    process, kernels/cpu_build.py); against a server, on another device or with torch ops, none."""
    asked = []
    monkeypatch.setattr(cli, "build_in_background", asked.append)
    parse = build_parser().parse_args
    for argv in (["serve", "--request", "hi"], ["chat"], ["generate", "hi"], ["serve", "--device", "cpu"]):
        cli._start_first_build(parse(argv))
    assert len(asked) == 4 and asked[0] == cli.cache_dir()
    for argv in (["chat", "--server", "http://x:1"], ["generate", "hi", "--server", "x:1"], ["serve", "--device", "cuda"],
                 ["serve", "--kernels", "torch"], ["export-hf", "a.gguf", "out"]):
        cli._start_first_build(parse(argv))
    assert len(asked) == 4


def _refused(capsys, *argv) -> str:
    """The one line `splitserve ARGV` prints, after asserting exit status 2 and one line."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:           # argparse's own refusals
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("flag", ["--port", "--grpc-port", "--http-port", "--metrics-port"])
@pytest.mark.parametrize("port", ["70000", "-1"])
def test_ports_outside_the_range_are_refused_by_flag(capsys, flag, port):
    err = _refused(capsys, "serve", "--model", MODEL, flag, port)
    assert f"{flag} must be a port in 0..65535" in err and port in err


@pytest.mark.parametrize("argv,words", [
    (("--decode", "0"), "--decode must be >= 1"),
    (("--colocated", "--decode", "0"), "--decode must be >= 1"),
    (("--prefill", "-1"), "--prefill must be >= 1 (or give --colocated)"),
    (("--prefill", "0"), "--prefill must be >= 1"),
    (("--frontends", "0"), "--frontends must be >= 1"),
    (("--block-size", "24"), "--block-size must be a positive power of two"),
    (("--max-speculative-tokens", "17"), "--max-speculative-tokens must be in [1, 16]"),
    (("--ngram-min", "5"), "--ngram-min must be >= 1 and <= ngram_max (4)"),
    (("--unavailable-wait", "0"), "--unavailable-wait must be > 0"),
    (("--lease-seconds", "-3"), "--lease-seconds must be > 0"),
    (("--queue-timeout", "0"), "--queue-timeout must be > 0"),
    (("--prefill-resources", "[1]"), "--prefill-resources"),
    (("--tls-cert", "c.pem"), "--tls-cert and --tls-key"),
    (("--api-key-file", "/nonexistent/keys"), "--api-key-file cannot read /nonexistent/keys"),
])
def test_impossible_clusters_are_refused_before_ray(capsys, argv, words):
    assert words in _refused(capsys, "serve", "--model", MODEL, *argv)


def test_a_colocated_cluster_needs_no_prefill_worker():
    cfg = load(["serve", "--model", MODEL, "--colocated", "--prefill", "0"], check_machine=False).config
    assert cfg.colocated and cfg.num_decode == 1


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_a_port_in_use_is_found_before_ray_and_named(capsys, busy_port, flag):
    argv = ["serve", "--model", MODEL, "--port", "0", flag, str(busy_port)]
    err = _refused(capsys, *argv)
    assert f"{flag} 127.0.0.1:{busy_port} is in use" in err


def test_two_flags_on_one_port_are_refused(capsys):
    err = _refused(capsys, "serve", "--model", MODEL, "--port", "18123", "--http-port", "18123")
    assert "--http-port is 18123, the port --port serves on" in err


def test_cuda_on_a_cpu_build_is_one_line(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    for argv in (("serve", "--model", MODEL, "--device", "cuda"), ("generate", "--model", MODEL, "--device", "cuda",
                                                                    "hi")):
        err = _refused(capsys, *argv)
        assert "--device is 'cuda' but this torch" in err and "sees no CUDA device" in err


def test_a_missing_model_is_named(capsys, tmp_path):
    assert f"--model {tmp_path / 'nope'} does not exist" in _refused(capsys, "serve", "--model", str(tmp_path / "nope"))


def test_a_bad_lookahead_names_the_flag_and_what_it_takes(capsys):
    err = _refused(capsys, "generate", "--num-speculative-tokens", "many", "x")
    assert "argument --num-speculative-tokens: expected an integer or 'auto', got 'many'" in err
    assert "parse_lookahead" not in err


def test_a_bad_choice_lists_the_registrys_choices(capsys):
    err = _refused(capsys, "serve", "--transport", "pigeon")
    assert "--transport" in err and "nixl" in err and "loopback" not in err


# --- YAML ---------------------------------------------------------------------------------------

def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_broken_yaml_names_file_and_line(capsys, tmp_path):
    path = _yaml(tmp_path, "prefill: 1\ndecode: [1, 2\nport: 3\n")
    err = _refused(capsys, "serve", "--config", path)
    assert re.search(rf"{re.escape(path)}:\d+:\d+: not valid YAML", err), err


def test_a_yaml_list_is_refused_by_name(capsys, tmp_path):
    err = _refused(capsys, "serve", "--config", _yaml(tmp_path, "- prefill: 1\n- decode: 1\n"))
    assert "the top level must be a mapping of setting: value" in err and "not a list" in err


def test_a_yaml_typo_gets_the_nearest_key(capsys, tmp_path):
    err = _refused(capsys, "serve", "--config", _yaml(tmp_path, "port: 0\nunavailable_wiat: 3\n"))
    assert "c.yaml:2: unknown option 'unavailable_wiat' (did you mean 'unavailable-wait'?)" in err


def test_a_bad_yaml_value_names_its_line_and_key(capsys, tmp_path):
    err = _refused(capsys, "serve", "--model", MODEL, "--config", _yaml(tmp_path, "decode: 1\nport: 70000\n"))
    assert "c.yaml:2: port: must be a port in 0..65535" in err
    err = _refused(capsys, "serve", "--config", _yaml(tmp_path, "decode: two\n"))
    assert "c.yaml:1: decode: expected an integer, got 'two'" in err


def test_the_documented_yaml_example_loads(tmp_path):
    from cluster.launch.settings_doc import DOC
    example = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S).group(1)
    cfg = load(["serve", "--config", _yaml(tmp_path, example)], check_machine=False).config
    assert (cfg.router.unavailable_wait_s, cfg.engine.speculative.ngram_max, cfg.num_decode) == (30.0, 3, 2)


# --- every setting reachable -------------------------------------------------------------------

NAMED = {   # the settings the issue names, with a value that differs from the default
    ("router", "unavailable_wait_s"): ("--unavailable-wait", "7", 7.0),
    ("engine", "scheduler", "enable_chunked_prefill"): ("--no-enable-chunked-prefill", None, False),
    ("engine", "speculative", "ngram_min"): ("--ngram-min", "1", 1),
    ("engine", "speculative", "ngram_max"): ("--ngram-max", "6", 6),
    ("data_plane", "lease_seconds"): ("--lease-seconds", "12.5", 12.5),
    ("data_plane", "transfer_timeout_s"): ("--transfer-timeout", "3", 3.0),
    ("admission", "max_in_flight_per_tenant"): ("--max-in-flight-per-tenant", "3", 3),
    ("metrics_host",): ("--metrics-host", "0.0.0.0", "0.0.0.0"),
    ("http_port",): ("--http-port", "0", 0),
    ("port",): ("--grpc-port", "none", None),
    ("engine", "cache", "kv_cache_memory_bytes"): ("--kv-cache-memory", "8GiB", 8 << 30),
}


def _get(cfg, path):
    for name in path:
        cfg = getattr(cfg, name)
    return cfg


@pytest.mark.parametrize("path", list(NAMED), ids=lambda p: ".".join(p))
def test_named_settings_reach_the_tree_from_flags_and_yaml(tmp_path, path):
    flag, text, want = NAMED[path]
    argv = ["serve", flag] if text is None else ["serve", flag, text]
    assert _get(load(argv, check_machine=False).config, path) == want
    key = flag.removeprefix("--no-").removeprefix("--").replace("-", "_")
    value = "false" if text is None else text
    assert _get(load(["serve", "--config", _yaml(tmp_path, f"{key}: {value}\n")], check_machine=False).config,
                path) == want


def test_kv_cache_memory_takes_sizes_and_byte_counts_from_flags_and_yaml(tmp_path):
    def kv(argv):
        return load(["serve", *argv], check_machine=False).config.engine.cache.kv_cache_memory_bytes
    assert kv([]) is None                       # the plan's default: 4 GiB on CPU, a share of the GPU on CUDA
    assert kv(["--kv-cache-memory", "1.5GB"]) == 1_500_000_000
    assert kv(["--kv-cache-memory-bytes", "2147483648"]) == 2 << 30        # vLLM's spelling, a byte count
    assert kv(["--config", _yaml(tmp_path, "kv-cache-memory: 512MiB\n")]) == 512 << 20
    assert kv(["--config", _yaml(tmp_path, "kv_cache_memory: 1073741824\n")]) == 1 << 30  # YAML's integer


def test_a_bad_kv_cache_memory_is_refused_by_flag_and_yaml_key(capsys, tmp_path):
    err = _refused(capsys, "serve", "--model", MODEL, "--kv-cache-memory", "4G")
    assert "argument --kv-cache-memory/--kv-cache-memory-bytes: expected a byte count or a size such as 4GiB, 512MiB or 2GB" in err
    assert "got '4G'" in err
    err = _refused(capsys, "serve", "--model", MODEL, "--kv-cache-memory", "0")
    assert "--kv-cache-memory must be a positive number of bytes, got 0" in err
    err = _refused(capsys, "serve", "--model", MODEL, "--config", _yaml(tmp_path, "port: 0\nkv-cache-memory: lots\n"))
    assert "c.yaml:2: kv-cache-memory: expected a byte count or a size such as 4GiB" in err


def test_the_command_line_wins_over_yaml(tmp_path):
    cfg = load(["serve", "--config", _yaml(tmp_path, "stall_timeout: 5\nlease-seconds: 9\n"), "--stall-timeout", "6"],
               check_machine=False).config
    assert (cfg.router.stall_timeout_s, cfg.data_plane.lease_seconds) == (6.0, 9.0)


def test_every_field_of_the_tree_is_a_setting_or_derived_and_every_setting_a_flag():
    settings = list(tree_settings(ClusterConfig))        # raises on a field that is neither
    flags = [s.flag for s in settings]
    assert len(flags) == len(set(flags)), "two settings share a flag"
    serve = build_parser().commands["serve"]
    options = {o for a in serve._actions for o in a.option_strings}
    assert set(flags) <= options
    # The YAML key of every setting, each at its default, builds the default tree.
    text = "".join(f"{s.key}: {_yaml_scalar(s.default)}\n" for s in settings if _yaml_scalar(s.default) is not None)
    assert text.count("\n") > 60
    default = ClusterConfig(engine=EngineConfig(model=MODEL))
    got = load(["serve", "--model", MODEL, "--config", _yaml_file(text)], check_machine=False).config
    assert got == default


def _yaml_scalar(value):
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):      # quoted: a default such as "*" is YAML syntax unquoted
        return json.dumps(value)
    return None


def _yaml_file(text: str) -> str:
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    return f.name


def test_the_frontend_and_workers_are_told_the_trees_settings():
    cfg = load(["serve", "--model", MODEL, "--unavailable-wait", "7", "--block-size", "32", "--colocated",
                "--transport", "tcp", "--stream-interval", "3"], check_machine=False).config
    fcfg = app._frontend_config(cfg, limits=None, info=None, roster=WorkerRoster(), stream_host="127.0.0.1")
    assert (fcfg.router.unavailable_wait_s, fcfg.router.block_size, fcfg.router.colocated) == (7.0, 32, True)
    assert fcfg.transport == "tcp" and cfg.data_plane.stream_interval == 3


def test_the_docs_list_every_setting():
    from cluster.launch.settings_doc import DOC, render
    assert DOC.read_text() == render(), "docs/configuration.md is stale: python -m cluster.launch.settings_doc"


# --- help and version --------------------------------------------------------------------------

def test_every_flag_has_help_and_shows_its_default():
    parser = build_parser()
    for name, sub in parser.commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            if action.nargs != 0:
                assert "default" in formatter._get_help_string(action), f"{name} {action.option_strings[0]}"


def test_version(capsys):
    import importlib.metadata
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"splitserve {importlib.metadata.version('splitserve')}"


# --- generate --server -------------------------------------------------------------------------

def test_generate_server_refuses_engine_flags_by_name(capsys):
    err = _refused(capsys, "generate", "--server", "127.0.0.1:1", "--dtype", "float32", "--block-size", "8", "hi")
    assert "--dtype is an engine setting; with --server the server's engine answers (drop --dtype, --block-size)" in err
    err = _refused(capsys, "chat", "--server", "http://127.0.0.1:1", "--decode", "2")
    assert "--decode is a cluster setting" in err


def test_generate_server_prints_the_servers_refusal_in_one_line(capsys):
    import grpc
    from proto.splitserve.v1 import inference_pb2_grpc as pb_grpc

    class Refusing(pb_grpc.InferenceServicer):
        def Generate(self, request, context):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be <= 64, got 100")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_InferenceServicer_to_server(Refusing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        rc = main(["generate", "--server", f"127.0.0.1:{port}", "--raw", "--max-tokens", "100",
                   "--speculative", "ngram", "hi"])
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert f"127.0.0.1:{port} answered INVALID_ARGUMENT: max_tokens: must be <= 64, got 100" in err


def test_stream_printer_prints_text_or_one_json_object():
    import io
    import json
    out = io.StringIO()
    printer = cli.StreamPrinter(out=out)
    printer.add([1], "a", None)
    printer.add([2], "b", "stop")
    printer.close()
    assert out.getvalue() == "ab\n"
    out = io.StringIO()
    printer = cli.StreamPrinter(as_json=True, out=out)
    printer.add([1, 2], "ab", "length")
    printer.close()
    assert json.loads(out.getvalue()) == {"token_ids": [1, 2], "text": "ab", "finish_reason": "length"}


def test_tree_fields_are_all_declared():
    """Each config class of the tree declares every field with setting(...) or derived(...)."""
    from cluster.config import CacheConfig, DataPlaneConfig, SchedulerConfig, SpeculativeConfig
    from router.admission import AdmissionConfig
    from router.connections import ConnectionLimits
    from router.router import RouterConfig
    from router.validation import RequestBounds
    for cls in (CacheConfig, SchedulerConfig, SpeculativeConfig, DataPlaneConfig, RouterConfig, AdmissionConfig,
                ConnectionLimits, RequestBounds):
        for f in fields(cls):
            assert "help" in f.metadata or "derived" in f.metadata, f"{cls.__name__}.{f.name}"


# --- what a vLLM user expects ------------------------------------------------------------------

def test_both_apis_are_served_by_default_on_the_usual_ports():
    cfg = load(["serve", "--model", MODEL], check_machine=False).config
    assert (cfg.port, cfg.http_port) == (50051, 8000)       # gRPC's usual port, vLLM's HTTP port
    assert ClusterConfig(engine=EngineConfig(model=MODEL)).http_port == 8000


@pytest.mark.parametrize("argv,path", [(("--port", "0"), ("port",)), (("--grpc-port", "0"), ("port",))])
def test_port_is_the_grpc_port_under_either_name(argv, path, tmp_path):
    assert _get(load(["serve", *argv], check_machine=False).config, path) == 0
    for key in ("port", "grpc_port", "grpc-port"):
        assert load(["serve", "--config", _yaml(tmp_path, f"{key}: 0\n")], check_machine=False).config.port == 0


def test_either_api_turns_off_but_not_both(capsys):
    assert load(["serve", "--http-port", "none"], check_machine=False).config.http_port is None
    assert load(["serve", "--grpc-port", "none"], check_machine=False).config.port is None
    err = _refused(capsys, "serve", "--model", MODEL, "--port", "none", "--http-port", "none")
    assert "--port is none and so is --http-port: nothing would be served" in err


def test_a_vllm_users_port_8000_is_explained(capsys):
    """`--port 8000` as vLLM's users type it: told that --port is gRPC here and what to give."""
    err = _refused(capsys, "serve", "--model", MODEL, "--port", "8000")
    assert "--port 8000 is the gRPC API's port" in err and "give --http-port 8000" in err
    assert "is in use" not in err


def test_one_setting_twice_in_yaml_is_refused(capsys, tmp_path):
    err = _refused(capsys, "serve", "--config", _yaml(tmp_path, "port: 0\ngrpc_port: 1\n"))
    assert "c.yaml:2: grpc_port: sets what port already set" in err


def test_help_names_the_grpc_port_and_its_old_name(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--grpc-port PORT, --port PORT the gRPC API's port" in out
    assert "the OpenAI-compatible HTTP API's port, as vLLM's" in out and "(default: 8000)" in out
