"""The `splitserve` command line's parser: the settings' flags come from the config tree
(cluster/launch/settings.py); the command's own options (prompts, files, sampling) are here."""
from __future__ import annotations

import argparse

from cluster.config import EngineConfig, secret_file_from_env
from cluster.launch.cluster_config import ClusterConfig
from cluster.launch.planner_parser import add_plan, add_simulate
from cluster.launch.settings import UNSET, add_setting_flags
from cluster.version import splitserve_version

# The group a setting's flag is listed under, by the first element of its path in the tree.
ENGINE_TITLES = {"cache": "KV cache", "scheduler": "batching", "speculative": "speculative decoding"}
CLUSTER_TITLES = {"engine": "engine (model, KV cache, batching, speculative decoding)",
                  "data_plane": "data plane (KV transfer between workers, token streams)",
                  "router": "routing and failover",
                  "bounds": "request bounds (a request past one gets 400 naming it)",
                  "admission": "admission (in-flight slots, per tenant)",
                  "connections": "connections (HTTP and gRPC timeouts and limits)",
                  "planner": "SLA planner (sizes the prefill and decode pools; docs/planner.md)"}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class Parser(argparse.ArgumentParser):
    """Errors in one line (argparse prints its usage first), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's default in its help (the settings' help says its own)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or action.nargs == 0 or not action.option_strings or \
                any(default is x for x in (UNSET, argparse.SUPPRESS)):
            return text
        return f"{text} (default: {'none' if default is None or default == [] else '%(default)s'})"


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.upper()


def build_parser() -> Parser:
    parser = Parser(prog="splitserve", description="Disaggregated prefill/decode LLM serving",
                    formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"splitserve {splitserve_version()}")
    parser.add_argument("--log-level", default="INFO", type=_log_level, help="log level of splitserve's own logs "
                                                                              "(stderr)")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{generate,serve,chat,scale,export-hf,simulate,plan}")
    parser.commands = {}

    def command(name: str, help_text: str) -> Parser:
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        # Also after the subcommand (`splitserve serve --log-level DEBUG`); SUPPRESS keeps the global one.
        p.add_argument("--log-level", default=argparse.SUPPRESS, type=_log_level,
                       help="log level of splitserve's own logs (stderr; default INFO)")
        parser.commands[name] = p
        p.settings = []
        return p

    _add_generate(command("generate", "generate a completion with the engine in-process, or from a running server"))
    _add_serve(command("serve", "serve the gRPC API (and the OpenAI HTTP API) from a disaggregated prefill/decode "
                                "cluster on Ray"))
    _add_chat(command("chat", "a conversation in the terminal: a local cluster, or --server's OpenAI API"))
    _add_scale(command("scale", "a running cluster's workers: list them, add or remove (drain) workers of a role, "
                                "or switch one's role"))
    exp = command("export-hf", "write a GGUF file's model as a Hugging Face directory (for transformers, vLLM)")
    exp.add_argument("gguf", help="the .gguf file")
    exp.add_argument("out", help="the directory to write (must not exist, or be empty)")
    add_simulate(command("simulate", "the planner and the router's policy on a simulated cluster (docs/planner.md)"))
    add_plan(command("plan", "the P:D split, workers and memory per worker for a rate and SLOs (docs/planner.md)"))
    return parser


def _add_generate(gen: Parser) -> None:
    gen.settings = add_setting_flags(gen, EngineConfig, ENGINE_TITLES)
    gen.root = EngineConfig
    _add_sampling_args(gen)
    gen.add_argument("--json", action="store_true",
                     help='print one JSON object {"token_ids", "text", "finish_reason"} instead of streaming text')
    gen.add_argument("--server", default=None, metavar="HOST:PORT",
                     help="stream from a running `splitserve serve` instead of running the engine in-process (then "
                          "only --model, --speculative and --num-speculative-tokens of the engine's flags apply: "
                          "the first picks the chat template, the others go with the request)")
    gen.add_argument("--api-key", default=None, help="API key for --server (sent as 'authorization: Bearer')")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is (default: as a user message through the model's chat template, "
                          "when it has one; with --server, when the server serves the --model this command names)")
    gen.add_argument("prompt", help="the prompt")


def _add_scale(scale: Parser) -> None:
    scale.add_argument("--server", required=True, metavar="HOST:PORT", help="the running `splitserve serve` (gRPC)")
    scale.add_argument("--api-key", default=None, help="API key for --server (sent as 'authorization: Bearer')")
    scale.add_argument("--prefill", type=int, default=None, metavar="N", help="the prefill workers to have")
    scale.add_argument("--decode", type=int, default=None, metavar="M", help="the decode workers to have")
    scale.add_argument("--switch", default=None, metavar="WORKER", help="switch this worker's role (its name in the "
                                                                      "metrics' `worker` label, e.g. decode-1)")
    scale.add_argument("--to", choices=("prefill", "decode"), default=None, help="the role --switch gives it")
    scale.add_argument("--no-wait", action="store_true", help="answer at once instead of when the action is done")


def _add_serve(srv: Parser) -> None:
    _add_cluster_args(srv)
    srv.add_argument("--request", default=None, metavar="PROMPT",
                     help="answer this one prompt through the gRPC API (streamed to stdout), then shut down")
    srv.add_argument("--raw", action="store_true",
                     help="send --request as is (default: as a user message through the model's chat template)")
    _add_sampling_args(srv, for_reading=True)
    _add_verbose(srv, "with --request: ")


def _add_chat(chat: Parser) -> None:
    _add_cluster_args(chat)
    _add_sampling_args(chat, for_reading=True)
    _add_verbose(chat, "")
    chat.add_argument("--server", default=None, metavar="URL",
                      help="chat with a running server's OpenAI API (e.g. http://127.0.0.1:8000) instead")


# What `chat` and `serve --request` say of an unset sampling flag (cluster/launch/chat_sampling.py).
FOR_READING = "the model's own default, else a chat default; --temperature 0 alone is plain greedy"


def _add_sampling_args(p: argparse.ArgumentParser, for_reading: bool = False) -> None:
    """`generate`'s sampling flags default to greedy decoding; `for_reading` (the commands a
    person reads) leaves them unset: the model's sampling defaults fill them."""
    def default(value):
        return None if for_reading else value
    g = p.add_argument_group("sampling (the request's)" + (f"; unset: {FOR_READING}" if for_reading else ""))
    g.add_argument("--max-tokens", type=int, default=None if for_reading else 128,
                   help="tokens to generate at most" + (" (default: the room left in the context)" if for_reading
                                                         else ""))
    g.add_argument("--temperature", type=float, default=default(0.0),
                   help="0 is greedy" + ("" if for_reading else ", the default here and in the gRPC API (the OpenAI "
                                                                "HTTP API's default is OpenAI's and vLLM's, 1)"))
    g.add_argument("--top-p", type=float, default=default(1.0), help="nucleus sampling: the smallest set of tokens "
                                                                      "this probable")
    g.add_argument("--top-k", type=int, default=default(0), help="sample from the k most probable tokens (0: all)")
    g.add_argument("--min-p", type=float, default=default(0.0), help="drop tokens less probable than this times the "
                                                                      "top one")
    g.add_argument("--repetition-penalty", type=float, default=default(1.0),
                   help="divide the logits of tokens already seen by this (1: none)")
    g.add_argument("--seed", type=int, default=None,
                   help="a random one per session, shown at the start (turn i uses seed + i)" if for_reading else
                   "the request's seed (default: the engine's --default-seed)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")


def _add_verbose(p: argparse.ArgumentParser, when: str) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help=f"{when}logs (ours, Ray's) on stderr as they come (default: one status line while starting, "
                        "then only the conversation; the logs go to a file under the cache, named at the start)")


def _add_cluster_args(p: Parser) -> None:
    p.root = ClusterConfig
    p.add_argument("--config", default=None, metavar="YAML",
                   help="YAML file of settings (`key: value`, keys as the flags without '--', with '_' or '-'); "
                        "flags given on the command line win")
    p.settings = add_setting_flags(p, ClusterConfig, CLUSTER_TITLES)
    # The YAML's `models:` list (several models, cluster/launch/model_specs.py) arrives here; on the
    # command line --model and --served-model-name repeat instead.
    p.add_argument("--models", default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("secrets and TLS (files)")
    g.add_argument("--api-key", action="append", default=[],
                   help="require this API key (repeatable; visible in `ps`: prefer --api-key-file)")
    g.add_argument("--api-key-file", default=secret_file_from_env("SPLITSERVE_API_KEY_FILE"), metavar="FILE",
                   help="API keys, one per line: TENANT:KEY (keys sharing a tenant name share its requests and "
                        "prefix cache) or KEY alone (its own tenant); default $SPLITSERVE_API_KEY_FILE")
    g.add_argument("--cluster-secret-file", default=secret_file_from_env("SPLITSERVE_CLUSTER_SECRET_FILE"),
                   metavar="FILE", help="the secret that authenticates the KV plane between workers (default "
                                        "$SPLITSERVE_CLUSTER_SECRET_FILE; without one, a random one per cluster)")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="PEM certificate chain: serve gRPC and HTTP over "
                                                                   "TLS")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="PEM private key for --tls-cert")
    g.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="mutual TLS: require client certificates signed by this CA (gRPC and HTTP)")
