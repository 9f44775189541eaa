"""The commands that run here: `generate` (an engine in this process), `serve` and `chat` (a
cluster on Ray), `export-hf` (a GGUF file converted), `plan` (plan_command.py). They import torch
and Ray, so `cli.py` imports this module only when one of them runs."""
from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

from cluster.engine.engine import LLMEngine
from cluster.launch.models import start_models
from cluster.launch.banner import Endpoints, banner, models_lines
from cluster.launch.chat_cli import Cut, PromptBuilder, chat_loop, http_completion, http_reply, room_left
from cluster.launch.chat_sampling import GREEDY, given_sampling, session_sampling, session_seed
from cluster.launch.invocation import Invocation, StreamPrinter
from cluster.launch.plan_command import cmd_plan
from cluster.launch.settings import SettingError
from cluster.model.gguf_import import export_hf
from cluster.types import FinishReason, SamplingParams
from cluster.version import splitserve_version
from decode.spec.speculator import make_speculator
from router.client import AsyncClient, Client
from router.finish_reasons import from_proto

log = logging.getLogger(__name__)


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


def _request_sampling(cfg, args, builder) -> tuple[dict, int | None, str]:
    """`serve --request`'s sampling: a question sent through the chat template samples as the model's
    chat does (cluster/launch/chat_sampling.py); a raw prompt, or a model without a template, is
    completed greedily unless flags say otherwise. Returns the fields, the seed, and a description."""
    chat = builder.has_template and not args.raw
    sampling = session_sampling(args, cfg.engine.model) if chat else \
        replace(GREEDY, source="a completion, not a chat", **given_sampling(args))
    seed = session_seed(args) if sampling.temperature > 0 else args.seed
    described = sampling.describe() + (f"; seed {seed}" if seed is not None else "")
    return {**sampling.request(), **_stops(args)}, seed, described


def _stops(args) -> dict:
    """--stop and --ignore-eos, as the request's fields (when given)."""
    return {**({"stop": list(args.stop)} if args.stop else {}), **({"ignore_eos": True} if args.ignore_eos else {})}


async def _answer(cfg, at, args, builder, max_model_len: int, console) -> None:
    """`serve --request`: the prompt (through the chat template unless --raw), streamed to stdout,
    through the gRPC API (or the HTTP API's completions route when gRPC is off); a limit that cut
    the answer is said in one line on stderr."""
    key = cfg.api_keys[0].key.decode() if cfg.api_keys else None
    prompt = builder.prompt(args.request, raw=args.raw)
    sampling, seed, described = _request_sampling(cfg, args, builder)
    console.note(f"splitserve: sampling: {described}")
    printer, cut = StreamPrinter(), None
    if at.grpc is None:
        def relay():          # printed as the events arrive, off the event loop
            for piece in http_completion(at.http, key, prompt, args.max_tokens or cfg.max_tokens_limit, sampling, seed):
                if isinstance(piece, Cut):
                    return piece
                printer.add((), piece, None)
            return None
        cut = await asyncio.to_thread(relay)
    else:
        client = AsyncClient(at.grpc, api_key=key)
        prompt_len = len(prompt) if isinstance(prompt, list) else 0
        limit = room_left(max_model_len, prompt_len, args.max_tokens, cfg.max_tokens_limit)
        async for msg in client.stream(prompt, max_tokens=limit, seed=seed, **sampling):
            printer.add(msg.token_ids, msg.text, from_proto(msg.finish_reason) if msg.finish_reason else None)
        await client.close()
        cut = Cut(limit) if printer.reason is FinishReason.LENGTH else None
    printer.close()
    if cut is not None:
        console.note(cut.line())


def cmd_serve(inv: Invocation) -> int:
    cfg, args, console = inv.config, inv.args, inv.console

    async def run() -> None:
        cluster = await start_models(cfg)
        signals = ShutdownSignals(asyncio.get_running_loop())
        at = endpoints(cfg, cluster)
        builder = PromptBuilder(cfg.engine.model, cfg.chat_template)
        lines = banner(cfg, cluster.model_name, splitserve_version(), at, builder.has_template, cluster.first_stats,
                       cluster.max_model_len)
        lines += models_lines([(c.config, c.model_name) for c in cluster.models], cfg.skill_routes)
        console.done()
        print("\n".join(lines), file=console.err, flush=True)
        if args.request is not None:
            await _answer(cfg, at, args, builder, cluster.max_model_len, console)
            signals.now.set()
        await signals.first()
        if signals.graceful.is_set() and not signals.now.is_set():
            await _drain(cluster, cfg.drain_timeout_s, signals, console)
        log.info("shutting down")
        if args.request is None:
            print("splitserve: shutting down", file=console.err)
        await cluster.stop()
    console.phase("starting")
    asyncio.run(run())
    return 0


class ShutdownSignals:
    """SIGTERM (Kubernetes, systemd, an operator) is a graceful shutdown: drain, then stop.
    SIGINT (Ctrl-C at a terminal), or a second signal during a drain, stops at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.graceful = asyncio.Event()
        self.now = asyncio.Event()
        loop.add_signal_handler(signal.SIGINT, self.now.set)
        loop.add_signal_handler(signal.SIGTERM, self._term)

    def _term(self) -> None:
        (self.now if self.graceful.is_set() else self.graceful).set()

    async def first(self) -> None:
        waits = [asyncio.ensure_future(e.wait()) for e in (self.graceful, self.now)]
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()


async def _drain(cluster, timeout_s: float, signals: ShutdownSignals, console) -> None:
    """New requests refused, those in flight finished (or cut at `timeout_s`, or by a second signal)."""
    print(f"splitserve: SIGTERM: finishing the requests in flight (up to {timeout_s:.0f}s; "
          "a second signal stops at once)", file=console.err, flush=True)
    drain = asyncio.ensure_future(cluster.drain(timeout_s))
    interrupt = asyncio.ensure_future(signals.now.wait())
    await asyncio.wait([drain, interrupt], return_when=asyncio.FIRST_COMPLETED)
    interrupt.cancel()
    if not drain.done():
        drain.cancel()
        log.warning("drain interrupted by a second signal")
    elif drain.result():
        log.warning("drain timed out after %.0fs: %d in-flight slots end now", timeout_s, drain.result())


def _read_line(prompt: str) -> str:
    """`input`, its prompt on stdout: on a terminal `input` writes it to stderr, which a quiet
    console sends to the log file."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    return input()


def cmd_chat(inv: Invocation) -> int:
    args, cfg, console = inv.args, inv.config, inv.console
    builder = PromptBuilder(cfg.engine.model, cfg.chat_template)
    if not builder.has_template:
        raise SettingError("--model", f"{cfg.engine.model.name} has no chat template; give --chat-template FILE")
    key = cfg.api_keys[0].key.decode() if cfg.api_keys else None
    sampling, seed = session_sampling(args, cfg.engine.model), session_seed(args)
    request = {**sampling.request(), **_stops(args)}
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    console.phase("starting")
    cluster = asyncio.run_coroutine_threadsafe(start_models(cfg), loop).result()
    console.done(f"splitserve: chatting with {cluster.model_name}; {sampling.describe()}; seed {seed} "
                 f"(--seed {seed} repeats it); /exit to stop")
    at = endpoints(cfg, cluster)
    try:
        if at.grpc is None:         # only the HTTP API is served: its chat route renders the same template
            reply = http_reply(at.http, None, key, args.max_tokens or cfg.max_tokens_limit, request, seed)
        else:
            reply = grpc_reply(Client(at.grpc, api_key=key), builder, args.max_tokens, request, seed,
                               (cluster.max_model_len, cfg.max_tokens_limit))
        return chat_loop(reply, read=_read_line, note=console.note)
    finally:
        asyncio.run_coroutine_threadsafe(cluster.stop(), loop).result(120)


def grpc_reply(client, builder: PromptBuilder, max_tokens: int | None, sampling: dict, seed: int,
               room: tuple[int, int]):
    """A `reply` through a local cluster's gRPC API, the conversation rendered here; turn i is
    seeded `seed + i`; without `max_tokens`, an answer may fill the context (`room`: its length, and
    the most a request may ask for)."""
    turns = itertools.count()

    def reply(messages):
        ids = builder.conversation(messages)
        limit = room_left(room[0], len(ids), max_tokens, room[1])
        reason = ""
        for msg in client.stream(ids, max_tokens=limit, seed=seed + next(turns), **sampling):
            reason = msg.finish_reason or reason
            yield msg.text
        if reason and from_proto(reason) is FinishReason.LENGTH:
            yield Cut(limit)
    return reply


def cmd_export_hf(inv: Invocation) -> int:
    out = Path(inv.args.out)
    if out.exists() and any(out.iterdir()):
        raise SettingError("out", f"{out} exists and is not empty")
    export_hf(Path(inv.args.gguf), out)
    print(f"wrote {out} (config.json, model.safetensors in float32, tokenizer, chat template)", file=sys.stderr)
    return 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat, "export-hf": cmd_export_hf,
            "plan": cmd_plan}
