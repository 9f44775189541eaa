"""`splitserve generate --server`: a prompt streamed from a running server over gRPC (the chat
template applied here when the server serves the model this command would load)."""
from __future__ import annotations

import grpc

from cluster.config import default_model_dir, resolve_model
from cluster.launch.chat_cli import PromptBuilder
from cluster.launch.invocation import CommandError, Invocation, StreamPrinter
from cluster.launch.settings import UNSET
from proto.splitserve.v1 import inference_pb2 as pb
from router.client import Client, _metadata
from router.finish_reasons import from_proto


def _remote_prompt(client, args):
    """The chat template applies when the server serves the model this command would load (the
    same name): the conversation is rendered and tokenized here; otherwise the text goes as is."""
    if args.raw:
        return args.prompt
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
