"""The `splitserve` command line. Output text goes to stdout; logs go to stderr."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from cluster.config import CacheConfig, EngineConfig, default_model_dir


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default: the built-in model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype (default: the checkpoint's own)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-prefix-caching", action="store_true")


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
    gen.add_argument("prompt")
    return parser


def _engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model or default_model_dir(),
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching),
    )


def _sampling(args):
    from cluster.types import SamplingParams  # noqa: PLC0415
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def cmd_generate(args) -> int:
    from cluster.engine.engine import LLMEngine  # noqa: PLC0415 (torch import is slow; keep --help fast)
    sampling = _sampling(args)
    engine = LLMEngine(_engine_config(args))
    token_ids: list[int] = []
    text: list[str] = []
    reason = None
    for delta in engine.stream(args.prompt, sampling):
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for ours in ("cluster", "prefill", "decode", "router"):
        logging.getLogger(ours).setLevel(args.log_level.upper())
    try:
        return cmd_generate(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
