"""Commands against a running server over gRPC: `splitserve generate --server` (a prompt streamed,
the chat template applied here when the server serves the model this command would load) and
`splitserve scale` (the Admin RPCs: list, scale, switch a role)."""
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


def cmd_scale(inv: Invocation) -> int:
    """Lists the workers (no action given), or scales / switches and prints what was done."""
    args = inv.args
    if (args.switch is None) != (args.to is None):
        raise CommandError("--switch WORKER and --to ROLE go together")
    if args.switch is not None and (args.prefill is not None or args.decode is not None):
        raise CommandError("--switch is one action of its own: give --prefill/--decode in another call")
    client = Client(args.server, api_key=args.api_key)
    try:
        if args.switch is not None:
            reply = client.admin("SwitchRole", pb.SwitchRoleRequest(worker=args.switch, to=args.to, no_wait=args.no_wait))
        elif args.prefill is not None or args.decode is not None:
            reply = client.admin("Scale", pb.ScaleRequest(prefill=args.prefill, decode=args.decode, no_wait=args.no_wait))
        else:
            reply = client.admin("ListWorkers", pb.ListWorkersRequest())
    except grpc.RpcError as exc:
        raise CommandError(f"{args.server} answered {exc.code().name}: {exc.details()}") from None
    for action in getattr(reply, "actions", ()):
        print(f"{'started' if args.no_wait else 'done'}: {action}")
    print(f"{'WORKER':<14} {'ROLE':<8} {'STATE':<10} RUNNING")
    for w in reply.workers:
        print(f"{w.name:<14} {w.role:<8} {w.state:<10} {w.running}")
    return 0
