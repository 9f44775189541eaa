"""The `splitserve` command line. Output text goes to stdout; logs and errors to stderr.

`load(argv)` reads everything (flags, YAML, files) into the config tree and checks it against the
machine before anything starts; an error is one line naming the flag or YAML key, exit status 2.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import replace
from pathlib import Path

from cluster.config import EngineConfig, cache_dir
from cluster.launch.chat_cli import chat_loop, http_reply
from cluster.launch.chat_sampling import session_sampling, session_seed
from cluster.launch.cli_parser import build_parser
from cluster.launch.cluster_config import ClusterConfig, gpus_per_worker
from cluster.launch.console import Console, PhaseHandler, log_file
# Imported from here too (tests, scripts): what a command is, how it fails and prints.
from cluster.launch.invocation import CommandError, Invocation, StreamPrinter  # noqa: F401
from cluster.launch.model_specs import several_models
from cluster.launch.preflight import check_device, check_model, check_ports_free, read_file
from cluster.launch.settings import UNSET, SettingError, Values, build, from_args, yaml_values
from cluster.launch.simulate_command import cmd_simulate
from cluster.secrets import as_api_keys, read_api_key_file, read_secret_file
from kernels.cpu_build import build_in_background
from router.skills import load_skill_routes

# With --server the server's engine answers: of the engine's settings only these mean something
# (the chat template's model, and the speculation a request may ask for).
REMOTE_ENGINE_SETTINGS = {("model",), ("speculative", "method"), ("speculative", "num_speculative_tokens")}


def load(argv: list[str] | None = None, check_machine: bool = True) -> Invocation:
    """Parse, read the YAML and the files the flags name, build the config tree and (with
    `check_machine`) check devices, model and ports. Raises SettingError (or SystemExit(2) from
    argparse); starts nothing."""
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = parser.commands[args.command]
    yaml_given = None
    if getattr(args, "config", None):
        own = {a.dest for a in sub._actions if a.option_strings} - {s.dest for s in sub.settings} - {"help", "config"}  # noqa: SLF001
        yaml_given, others = yaml_values(args.config, sub.settings, own)
        sub.set_defaults(**others)
        args = parser.parse_args(argv)
    values = from_args(sub.settings, args, yaml_given)
    config = None
    if args.command == "generate":
        config = _generate_config(args, sub, values, check_machine)
    elif args.command in ("serve", "chat"):
        config = _cluster_config(args, sub, values, check_machine)
    return Invocation(args.command, args, values, config)


def _generate_config(args, sub, values: Values, check_machine: bool) -> EngineConfig | None:
    if args.server:
        ignored = [s.flag for s in sub.settings if s.path in values.given and s.path not in REMOTE_ENGINE_SETTINGS]
        if ignored:
            raise SettingError(ignored[0], f"is an engine setting; with --server the server's engine answers "
                                           f"(drop {', '.join(ignored)})")
        return None
    config = build(EngineConfig, sub.settings, values)
    if check_machine:
        check_model(config.model)
        check_device(config.device)
    return config


def _cluster_config(args, sub, values: Values, check_machine: bool):
    if getattr(args, "server", None):
        given = [s.flag for s in sub.settings if s.path in values.given]
        if given:
            raise SettingError(given[0], f"is a cluster setting; with --server that server's answer (drop "
                                         f"{', '.join(given)})")
        return None
    config = build(ClusterConfig, sub.settings, values, {**_file_settings(args), **several_models(args, values)})
    if config.skill_routes:         # refused now, not once every model has loaded
        try:
            load_skill_routes(config.skill_routes)
        except (OSError, ValueError) as exc:
            raise SettingError(values.source.get(("skill_routes",), "--skill-routes"), str(exc)) from None
    if config.planner.mode != "off" and (config.colocated or config.frontends > 1):
        # The planner acts through the driver's admin operations (cluster/launch/admin.py).
        raise SettingError(values.source.get(("planner", "mode"), "--planner"),
                           f"{config.planner.mode}: sizes a disaggregated cluster's prefill and decode pools through "
                           "the admin operations, which need one frontend: drop --colocated / --frontends")
    if check_machine:
        _check_machine(config, {path: values.source[path] for path in values.given})
    return config


def _file_settings(args) -> dict:
    """The derived fields read from the files and secrets the flags name."""
    if bool(args.tls_cert) != bool(args.tls_key):
        given, missing = ("--tls-cert", "--tls-key") if args.tls_cert else ("--tls-key", "--tls-cert")
        raise SettingError(given, f"needs {missing}: --tls-cert and --tls-key go together")
    extra = {("api_keys",): _api_keys(args), ("tls_client_ca",): read_file("--tls-client-ca", args.tls_client_ca)}
    if args.tls_cert:
        extra[("tls",)] = (read_file("--tls-key", args.tls_key), read_file("--tls-cert", args.tls_cert))
    if args.cluster_secret_file:
        read_file("--cluster-secret-file", args.cluster_secret_file)
        try:
            extra[("cluster_secret",)] = read_secret_file(Path(args.cluster_secret_file))
        except ValueError as exc:
            raise SettingError("--cluster-secret-file", str(exc)) from None
    return extra


def _api_keys(args) -> tuple:
    keys = as_api_keys(args.api_key)
    if args.api_key_file:
        read_file("--api-key-file", args.api_key_file)
        try:
            keys += read_api_key_file(args.api_key_file)
        except ValueError as exc:
            raise SettingError("--api-key-file", str(exc)) from None
    return keys


def _check_machine(cfg, given: dict) -> None:
    """Before Ray: the model is there, the device exists, the speculative setup can work, and
    every port can be bound on its host. `given`: the path of each setting given -> the flag (or
    YAML key) it came from, so that an error names what the user wrote."""
    from decode.spec.compat import check_speculative_models  # noqa: PLC0415 - imports torch (the model's config)
    check_model(cfg.engine.model)
    check_device(cfg.engine.device)
    gpus_per_worker(cfg)
    check_speculative_models(cfg.engine, disaggregated=not cfg.colocated)
    grpc_flag, http_flag = given.get(("port",), "--grpc-port"), given.get(("http_port",), "--http-port")
    if cfg.port and cfg.port == cfg.http_port and ("http_port",) not in given:
        raise SettingError(grpc_flag, f"{cfg.port} is the gRPC API's port, and {cfg.http_port} is also the OpenAI HTTP "
                                      f"API's default (--http-port): for the OpenAI API on {cfg.port}, as vLLM's "
                                      f"--port, give --http-port {cfg.port} (gRPC stays on 50051) or move gRPC to "
                                      "another port")
    check_ports_free([(grpc_flag, cfg.host, cfg.port), (http_flag, cfg.host, cfg.http_port),
                      ("--metrics-port", cfg.metrics_host or cfg.host, cfg.metrics_port)])


def _chat_with_server(inv: Invocation) -> int:
    """`splitserve chat --server`: over the server's OpenAI HTTP API (no torch, no gRPC here); the
    server's model is not known here, so unset sampling flags take the chat defaults."""
    args = inv.args
    keys = _api_keys(args)
    key = keys[0].key.decode() if keys else None
    sampling, seed = session_sampling(args, None), session_seed(args)
    inv.console.done(f"splitserve: chatting with {args.server}; {sampling.describe()}; seed {seed}; /exit to stop")
    try:
        return chat_loop(http_reply(args.server, None, key, args.max_tokens, sampling.request(), seed),
                         note=inv.console.note)
    except (OSError, RuntimeError) as exc:
        raise CommandError(f"{args.server}: {exc}") from None


def run(inv: Invocation) -> int:
    """The command. Against a server: its client only; here: the engine or the cluster (torch and
    Ray, seconds to import, so neither `--help` nor a refused setting waits for them)."""
    if inv.command == "chat" and inv.args.server:
        return _chat_with_server(inv)
    if inv.command == "simulate":
        return cmd_simulate(inv)
    if (inv.command == "generate" and inv.args.server) or inv.command == "scale":
        from cluster.launch.remote_commands import cmd_generate_remote, cmd_scale  # noqa: PLC0415 - gRPC: only against a server
        return (cmd_scale if inv.command == "scale" else cmd_generate_remote)(inv)
    from cluster.launch.local_commands import COMMANDS  # noqa: PLC0415 - torch and Ray: only to run here
    return COMMANDS[inv.command](inv)


def _error(exc: BaseException) -> str:
    """One line, whatever the exception's text holds."""
    return "splitserve: error: " + " ".join(str(exc).split())


def _console(args) -> Console:
    """The commands a person reads, run here (`chat`, `serve --request`), get a quiet console
    unless -v: one status line while starting, the logs in a file under the cache."""
    quiet = not getattr(args, "verbose", True) and (
        (args.command == "chat" and not args.server) or (args.command == "serve" and args.request is not None))
    return Console(log_file(cache_dir(), args.command) if quiet else None)


def _setup_logging(args, console: Console) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    level = args.log_level
    if console.log_path is not None:     # the file keeps INFO; its phases make the status line
        level = min(logging.getLevelName(level), logging.INFO)
        for phased in ("cluster", "kernels"):
            logging.getLogger(phased).addHandler(PhaseHandler(console))
        logging.getLogger("kernels").setLevel(logging.INFO)
    for ours in ("cluster", "prefill", "decode", "router"):
        logging.getLogger(ours).setLevel(level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)      # a wrong flag: argparse's one line, exit 2
    console = _console(args)
    with console:
        _setup_logging(args, console)
        _start_first_build(args)
        return _load_and_run(argv, console)


def _start_first_build(args) -> None:
    """A command that runs the engine here on CPU builds the C ops on its first start: begun now, in a
    child process, beside the GGUF conversion and Ray's start (kernels/cpu_build.py)."""
    device = getattr(args, "device", UNSET)
    on_cpu = device is UNSET or str(device).startswith("cpu")
    runs_here = args.command in ("generate", "serve", "chat") and not getattr(args, "server", None)
    if runs_here and on_cpu and getattr(args, "kernels", UNSET) != "torch":
        build_in_background(cache_dir())


def _load_and_run(argv: list[str] | None, console: Console) -> int:
    try:
        inv = replace(load(argv), console=console)
    except (ValueError, FileNotFoundError) as exc:      # SettingError, and the model's own refusals
        console.done(_error(exc))
        return 2
    try:
        return run(inv)
    except CommandError as exc:
        console.done(_error(exc))
        return 1
    except (ValueError, FileNotFoundError) as exc:
        console.done(_error(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
