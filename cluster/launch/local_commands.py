"""The commands that run here: `generate` (an engine in this process), `serve` and `chat` (a
cluster on Ray), `export-hf` (a GGUF file converted). They import torch and Ray, so `cli.py`
imports this module only when one of them runs."""
from __future__ import annotations

import asyncio
import signal
import sys
import threading
from pathlib import Path

from cluster.engine.engine import LLMEngine
from cluster.launch.app import start_cluster
from cluster.launch.banner import Endpoints, banner
from cluster.launch.chat_cli import PromptBuilder, chat_loop, grpc_reply, http_completion, http_reply
from cluster.launch.invocation import Invocation, StreamPrinter
from cluster.launch.settings import SettingError
from cluster.model.gguf_import import export_hf
from cluster.types import SamplingParams
from cluster.version import splitserve_version
from decode.spec.speculator import make_speculator
from router.client import AsyncClient, Client


def _sampling(args):
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def cmd_generate(inv: Invocation) -> int:
    engine = LLMEngine(inv.config, speculator_factory=make_speculator)
    printer = StreamPrinter(inv.args.json)
    prompt = PromptBuilder(inv.config.model).prompt(inv.args.prompt, raw=inv.args.raw)
    for delta in engine.stream(prompt, _sampling(inv.args)):
        printer.add(delta.token_ids, delta.text, delta.finish_reason.value if delta.finish_reason else None)
    return printer.close()


def endpoints(cfg, cluster):
    """Where a started cluster listens (cluster/launch/banner.py `Endpoints`), as bound."""
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
    key = cfg.api_keys[0].key.decode() if cfg.api_keys else None
    prompt = builder.prompt(args.request, raw=args.raw)
    printer = StreamPrinter()
    if at.grpc is None:
        def relay() -> None:          # printed as the events arrive, off the event loop
            for piece in http_completion(at.http, key, prompt, args.max_tokens):
                printer.add((), piece, None)
        await asyncio.to_thread(relay)
    else:
        client = AsyncClient(at.grpc, api_key=key)
        async for msg in client.stream(prompt, max_tokens=args.max_tokens):
            printer.add(msg.token_ids, msg.text, None)
        await client.close()
    printer.close()


def cmd_serve(inv: Invocation) -> int:
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
    args, cfg = inv.args, inv.config
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
    out = Path(inv.args.out)
    if out.exists() and any(out.iterdir()):
        raise SettingError("out", f"{out} exists and is not empty")
    export_hf(Path(inv.args.gguf), out)
    print(f"wrote {out} (config.json, model.safetensors in float32, tokenizer, chat template)", file=sys.stderr)
    return 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat, "export-hf": cmd_export_hf}
