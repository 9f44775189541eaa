"""The `splitserve` command line. Output text goes to stdout; logs and errors to stderr.

`load(argv)` reads everything (flags, YAML, files) into the config tree and checks it against the
machine before anything starts; an error is one line naming the flag or YAML key, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass

from cluster.config import EngineConfig, default_model_dir
from cluster.launch.cli_parser import build_parser
from cluster.launch.preflight import check_device, check_model, check_ports_free, read_file
from cluster.launch.settings import UNSET, SettingError, Values, build, from_args, yaml_values
from cluster.version import splitserve_version

# With --server the server's engine answers: of the engine's settings only these mean something
# (the chat template's model, and the speculation a request may ask for).
REMOTE_ENGINE_SETTINGS = {("model",), ("speculative", "method"), ("speculative", "num_speculative_tokens")}


class CommandError(Exception):
    """A command failed for a reason outside the config (a server's answer): exit status 1."""


@dataclass
class Invocation:
    command: str
    args: argparse.Namespace
    values: Values          # the settings given, on the command line or in YAML
    config: object          # ClusterConfig (serve, chat), EngineConfig (generate); None when nothing runs here


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
    from cluster.launch.cluster_config import ClusterConfig  # noqa: PLC0415
    if getattr(args, "server", None):
        given = [s.flag for s in sub.settings if s.path in values.given]
        if given:
            raise SettingError(given[0], f"is a cluster setting; with --server that server's answer (drop "
                                         f"{', '.join(given)})")
        return None
    config = build(ClusterConfig, sub.settings, values, _file_settings(args))
    if check_machine:
        _check_machine(config, {path: values.source[path] for path in values.given})
    return config


def _file_settings(args) -> dict:
    """The derived fields read from the files and secrets the flags name."""
    from pathlib import Path  # noqa: PLC0415
    from cluster.secrets import read_secret_file  # noqa: PLC0415
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
    from cluster.secrets import as_api_keys, read_api_key_file  # noqa: PLC0415
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
    from cluster.launch.app import gpus_per_worker  # noqa: PLC0415
    from decode.spec.compat import check_speculative_models  # noqa: PLC0415
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


class StreamPrinter:
    """The one place a stream is printed: its text as it comes, or one JSON object at its end."""

    def __init__(self, as_json: bool = False, out=None):
        self.as_json, self.out = as_json, out or sys.stdout
        self.ids: list[int] = []
        self.text: list[str] = []
        self.reason: str | None = None

    def add(self, token_ids, text: str, finish_reason: str | None) -> None:
        self.ids.extend(token_ids)
        self.text.append(text)
        if not self.as_json and text:
            self.out.write(text)
            self.out.flush()
        if finish_reason:
            self.reason = finish_reason

    def close(self) -> int:
        if self.as_json:
            print(json.dumps({"token_ids": self.ids, "text": "".join(self.text), "finish_reason": self.reason}),
                  file=self.out)
        else:
            self.out.write("\n")
        return 0


def _sampling(args):
    from cluster.types import SamplingParams  # noqa: PLC0415
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def _remote_prompt(client, args):
    """The chat template applies when the server serves the model this command would load (the
    same name): the conversation is rendered and tokenized here; otherwise the text goes as is."""
    if args.raw:
        return args.prompt
    from cluster.config import resolve_model  # noqa: PLC0415
    from cluster.launch.chat_cli import PromptBuilder  # noqa: PLC0415
    from proto.splitserve.v1 import inference_pb2 as pb  # noqa: PLC0415
    from router.client import _metadata  # noqa: PLC0415
    model = getattr(args, "model", None)
    try:
        local = resolve_model(model) if model not in (None, UNSET) else default_model_dir()
    except FileNotFoundError:
        return args.prompt
    served = client.stub.ListModels(pb.ListModelsRequest(), metadata=_metadata(client.api_key)).models
    if not any(m.id == local.name for m in served):
        return args.prompt
    return PromptBuilder(local).prompt(args.prompt)


def cmd_generate_remote(inv: Invocation) -> int:
    import grpc  # noqa: PLC0415
    from router.client import Client  # noqa: PLC0415
    from router.finish_reasons import from_proto  # noqa: PLC0415
    args = inv.args
    client = Client(args.server, api_key=args.api_key)
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop,
                    ignore_eos=args.ignore_eos)
    if args.seed is not None:
        sampling["seed"] = args.seed
    method, k = (inv.values.given.get(("speculative", name)) for name in ("method", "num_speculative_tokens"))
    if method is not None:
        sampling["speculative"] = method
    if k == "auto":
        sampling["auto_lookahead"] = True
    elif k is not None:
        sampling["num_speculative_tokens"] = k
    printer = StreamPrinter(args.json)
    try:
        for msg in client.stream(_remote_prompt(client, args), **sampling):
            printer.add(msg.token_ids, msg.text, from_proto(msg.finish_reason).value if msg.finish_reason else None)
    except grpc.RpcError as exc:
        raise CommandError(f"{args.server} answered {exc.code().name}: {exc.details()}") from None
    return printer.close()


def cmd_generate(inv: Invocation) -> int:
    if inv.args.server:
        return cmd_generate_remote(inv)
    from cluster.engine.engine import LLMEngine  # noqa: PLC0415 (torch import is slow; keep --help fast)
    from cluster.launch.chat_cli import PromptBuilder  # noqa: PLC0415
    from decode.spec.speculator import make_speculator  # noqa: PLC0415
    engine = LLMEngine(inv.config, speculator_factory=make_speculator)
    printer = StreamPrinter(inv.args.json)
    prompt = PromptBuilder(inv.config.model).prompt(inv.args.prompt, raw=inv.args.raw)
    for delta in engine.stream(prompt, _sampling(inv.args)):
        printer.add(delta.token_ids, delta.text, delta.finish_reason.value if delta.finish_reason else None)
    return printer.close()


def endpoints(cfg, cluster):
    """Where a started cluster listens (cluster/launch/banner.py `Endpoints`), as bound."""
    from cluster.launch.banner import Endpoints  # noqa: PLC0415
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    scheme = "https" if cfg.tls else "http"
    metrics = None
    if cluster.metrics_server is not None:
        metrics_host = cfg.metrics_host or cfg.host
        metrics = f"http://{metrics_host}:{cluster.metrics_server[0].server_port}/metrics"
    return Endpoints(grpc=f"{host}:{cluster.port}" if cluster.port is not None else None,
                     http=f"{scheme}://{host}:{cluster.http_port}" if cluster.http_port is not None else None,
                     metrics=metrics)


async def _answer(cfg, at, args, builder) -> None:
    """`serve --request`: the prompt (through the chat template unless --raw) greedy, streamed to
    stdout, through the gRPC API (or the HTTP API's completions route when gRPC is off)."""
    from cluster.launch.chat_cli import http_completion  # noqa: PLC0415
    key = cfg.api_keys[0].key.decode() if cfg.api_keys else None
    prompt = builder.prompt(args.request, raw=args.raw)
    printer = StreamPrinter()
    if at.grpc is None:
        import asyncio  # noqa: PLC0415

        def relay() -> None:          # printed as the events arrive, off the event loop
            for piece in http_completion(at.http, key, prompt, args.max_tokens):
                printer.add((), piece, None)
        await asyncio.to_thread(relay)
    else:
        from router.client import AsyncClient  # noqa: PLC0415
        client = AsyncClient(at.grpc, api_key=key)
        async for msg in client.stream(prompt, max_tokens=args.max_tokens):
            printer.add(msg.token_ids, msg.text, None)
        await client.close()
    printer.close()


def cmd_serve(inv: Invocation) -> int:
    import asyncio  # noqa: PLC0415
    import signal  # noqa: PLC0415
    from cluster.launch.app import start_cluster  # noqa: PLC0415
    from cluster.launch.banner import banner  # noqa: PLC0415
    from cluster.launch.chat_cli import PromptBuilder  # noqa: PLC0415
    cfg, args = inv.config, inv.args

    async def run() -> None:
        cluster = await start_cluster(cfg)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        at = endpoints(cfg, cluster)
        builder = PromptBuilder(cfg.engine.model, cfg.chat_template)
        lines = banner(cfg, cluster.model_name, splitserve_version(), at, builder.has_template, cluster.first_stats,
                       cluster.max_model_len)
        print("\n".join(lines), file=sys.stderr, flush=True)
        if args.request is not None:
            await _answer(cfg, at, args, builder)
            stop.set()
        await stop.wait()
        print("splitserve: shutting down", file=sys.stderr)
        await cluster.stop()
    asyncio.run(run())
    return 0


def cmd_chat(inv: Invocation) -> int:
    from cluster.launch.chat_cli import PromptBuilder, chat_loop, grpc_reply, http_reply  # noqa: PLC0415
    args = inv.args
    if args.server:
        keys = _api_keys(args)
        key = keys[0].key.decode() if keys else None
        try:
            return chat_loop(http_reply(args.server, None, key, args.max_tokens, args.temperature))
        except (OSError, RuntimeError) as exc:
            raise CommandError(f"{args.server}: {exc}") from None
    import asyncio  # noqa: PLC0415
    import threading  # noqa: PLC0415
    from cluster.launch.app import start_cluster  # noqa: PLC0415
    from router.client import Client  # noqa: PLC0415
    cfg = inv.config
    builder = PromptBuilder(cfg.engine.model, cfg.chat_template)
    if not builder.has_template:
        raise SettingError("--model", f"{cfg.engine.model.name} has no chat template; give --chat-template FILE")
    key = cfg.api_keys[0].key.decode() if cfg.api_keys else None
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cluster = asyncio.run_coroutine_threadsafe(start_cluster(cfg), loop).result()
    print(f"splitserve: chatting with {cluster.model_name}; /exit to stop", file=sys.stderr)
    at = endpoints(cfg, cluster)
    try:
        if at.grpc is None:         # only the HTTP API is served: its chat route renders the same template
            return chat_loop(http_reply(at.http, None, key, args.max_tokens, args.temperature))
        return chat_loop(grpc_reply(Client(at.grpc, api_key=key), builder, args.max_tokens, args.temperature))
    finally:
        asyncio.run_coroutine_threadsafe(cluster.stop(), loop).result(120)


def cmd_export_hf(inv: Invocation) -> int:
    from pathlib import Path  # noqa: PLC0415
    from cluster.model.gguf_import import export_hf  # noqa: PLC0415
    out = Path(inv.args.out)
    if out.exists() and any(out.iterdir()):
        raise SettingError("out", f"{out} exists and is not empty")
    export_hf(Path(inv.args.gguf), out)
    print(f"wrote {out} (config.json, model.safetensors in float32, tokenizer, chat template)", file=sys.stderr)
    return 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat, "export-hf": cmd_export_hf}


def _error(exc: BaseException) -> str:
    """One line, whatever the exception's text holds."""
    return "splitserve: error: " + " ".join(str(exc).split())


def main(argv: list[str] | None = None) -> int:
    try:
        inv = load(argv)
    except (ValueError, FileNotFoundError) as exc:      # SettingError, and the model's own refusals
        print(_error(exc), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for ours in ("cluster", "prefill", "decode", "router"):
        logging.getLogger(ours).setLevel(inv.args.log_level)
    try:
        return COMMANDS[inv.command](inv)
    except CommandError as exc:
        print(_error(exc), file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as exc:
        print(_error(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
