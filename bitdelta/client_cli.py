"""`bitdelta generate | models | workers`: talk to a running router (the public API);
`bitdelta store list | put | rm`: manage the deltas of a running delta store.

    bitdelta generate --router 127.0.0.1:50051 --model coder "def fibonacci(n):"
    bitdelta models --router 127.0.0.1:50051
    bitdelta workers --router 127.0.0.1:50051
    bitdelta store put data/deltas/coder.bitdelta.safetensors --store 127.0.0.1:50052   # servable at once
    bitdelta store list --store 127.0.0.1:50052
    bitdelta store rm coder --store 127.0.0.1:50052

Torch-free: only the shared RPC layer's clients. A service with TLS and tokens on (README
"Security") is reached with the variables BITDELTA_TLS_CA (turns TLS on), BITDELTA_TLS_CERT and
BITDELTA_TLS_KEY (a client certificate of that CA, for mutual TLS) and BITDELTA_TOKEN (the bearer
token; a variable, not a flag, so it never shows in the process list; `store put` and `rm` need
an admin token when the store checks tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from bitdelta.cli_error import CliError

DEFAULT_ROUTER = os.environ.get("BITDELTA_ROUTER", "127.0.0.1:50051")
DEFAULT_STORE = os.environ.get("BITDELTA_STORE", "127.0.0.1:50052")


def _client(cls, target: str):
    """A client of `cls`, with TLS and a token when the BITDELTA_TLS_* / BITDELTA_TOKEN variables say so."""
    from bitdelta.rpc.security import TlsFiles

    ca = os.environ.get("BITDELTA_TLS_CA")
    creds = None
    if ca:
        creds = TlsFiles.load(
            ca, os.environ.get("BITDELTA_TLS_CERT") or None, os.environ.get("BITDELTA_TLS_KEY") or None
        ).channel_credentials()
    return cls(target, credentials=creds, token=os.environ.get("BITDELTA_TOKEN", ""))


def _router(a: argparse.Namespace):
    from bitdelta.rpc.clients.router import RouterClient

    return _client(RouterClient, a.router)


def _fail(e) -> None:

    raise CliError(f"{e.code.name}: {e.details}") from None


async def _generate(a: argparse.Namespace) -> None:
    from bitdelta.generation import Sampling
    from bitdelta.router.v1 import router_pb2 as pb
    from bitdelta.rpc.clients.router import RouterCallError

    sampling = Sampling(
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        stop=tuple(a.stop or ()),
        seed=a.seed,
        top_k=a.top_k,
        min_p=a.min_p,
        repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        min_tokens=a.min_tokens,
        ignore_eos=a.ignore_eos,
    )
    request = pb.GenerateRequest(model_id=a.model, prompt=a.prompt, sampling=sampling.to_pb())
    async with _router(a) as r:
        try:
            last = None
            async for m in r.generate_request(request, timeout_s=a.timeout):
                if m.worker:
                    t = m.ttft
                    state = pb.ArrivalState.Name(m.arrival_state).removeprefix("ARRIVAL_STATE_").lower()
                    print(
                        f"[{a.model or 'base'} on {m.worker}, {state}: ttft {t.total_ms:.1f} ms = queue "
                        f"{t.queue_ms:.1f} + delta load {t.delta_load_ms:.1f} + schedule {t.schedule_ms:.1f} "
                        f"+ prefill {t.prefill_ms:.1f} + hops]",
                        file=sys.stderr,
                    )
                    print(a.prompt, end="", flush=True)
                print("".join(t.text for t in m.tokens), end="", flush=True)
                last = m.tokens[-1] if m.tokens else last
            print()
            if last is not None:
                reason = last.finish_reason
                from bitdelta.common.v1 import generation_pb2 as gen_pb

                print(
                    f"[{last.usage.completion_tokens} tokens, "
                    f"{gen_pb.FinishReason.Name(reason).removeprefix('FINISH_REASON_').lower()}, "
                    f"{last.elapsed_ms:.0f} ms]",
                    file=sys.stderr,
                )
        except RouterCallError as e:
            _fail(e)


async def _ask(a: argparse.Namespace, method: str) -> list:
    """One listing call (`list_models`, `list_workers`) to the router; a failure is a CLI error."""
    from bitdelta.rpc.clients.router import RouterCallError

    async with _router(a) as r:
        try:
            return await getattr(r, method)()
        except RouterCallError as e:
            _fail(e)


async def _models(a: argparse.Namespace) -> None:
    from bitdelta.units import human_bytes

    models = await _ask(a, "list_models")
    print(f"{'model':24s} {'delta':>10s} {'in flight':>9s}  resident on")
    for m in models:
        size = "base" if m.is_base else human_bytes(m.delta_bytes)
        where = ", ".join(m.resident_on) or "-"
        if m.loading_on:
            where += f" (loading on {', '.join(m.loading_on)})"
        line = f"{m.model_id:24s} {size:>10s} {m.in_flight:9d}  {where}"
        print(line if m.servable else f"{m.model_id:24s} {size:>10s} {'':9s}  NOT SERVABLE: {m.reason}")


async def _workers(a: argparse.Namespace) -> None:
    from bitdelta.units import human_bytes

    workers = await _ask(a, "list_workers")
    for w in workers:
        state = f"up ({w.device})" if w.up else f"DOWN: {w.reason}"
        print(
            f"{w.address:22s} {state:24s} {w.in_flight}/{w.capacity} in flight, "
            f"deltas {human_bytes(w.delta_used_bytes)} of {human_bytes(w.delta_budget_bytes)}: "
            f"{', '.join(w.resident) or '-'}"
        )


async def _store(a: argparse.Namespace) -> None:
    """`store list | put | rm`: one call to the delta store; a failure is a CLI error."""
    from bitdelta.rpc.clients.delta_store import DeltaStoreClient, DeltaStoreError
    from bitdelta.units import human_bytes

    async with _client(DeltaStoreClient, a.store) as st:
        try:
            if a.store_command == "list":
                deltas = await st.list()
                print(f"{'name':24s} {'size':>10s}  {'base':24s} version")
                for d in deltas:
                    print(f"{d.name:24s} {human_bytes(d.size_bytes):>10s}  {d.base_model[:24]:24s} {d.version}")
            elif a.store_command == "put":
                await _put(st, a)
            else:
                await st.delete(a.name)
                print(f"deleted {a.name}")
        except DeltaStoreError as e:
            _fail(e)


async def _put(st, a: argparse.Namespace) -> None:
    from pathlib import Path

    from tqdm import tqdm

    from bitdelta.units import human_bytes

    path = Path(a.file)
    if not path.is_file():
        raise CliError(f"{path}: no such file")
    name = a.name or path.name.removesuffix(".safetensors").removesuffix(".bitdelta")  # torch-free: no bitdelta.format
    with tqdm(total=path.stat().st_size, desc=f"put {name}", unit="B", unit_scale=True, file=sys.stderr) as bar:
        info = await st.put(name, path, overwrite=a.overwrite, on_sent=bar.update)
    print(
        f"stored {info.name}: {human_bytes(info.size_bytes)}, base {info.base_model}, version {info.version} "
        "(verified: every tensor's sha256, the header, the size)"
    )


def register(sub) -> None:
    help_router = f"router HOST:PORT (default $BITDELTA_ROUTER or {DEFAULT_ROUTER})"
    c = sub.add_parser("generate", help="stream an answer from a running router")
    c.add_argument("prompt")
    c.add_argument("--router", default=DEFAULT_ROUTER, help=help_router)
    c.add_argument("--model", default="", help="variant name; empty: the base")
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1: no truncation")
    c.add_argument("--stop", action="append", help="stop string (repeatable)")
    c.add_argument("--seed", type=int, default=None, help="same seed, same tokens; default: random")
    c.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: all")
    c.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this × as likely as the top one")
    c.add_argument("--repetition-penalty", type=float, default=1.0, help="prompt and output tokens (1: none)")
    c.add_argument("--presence-penalty", type=float, default=0.0, help="-2 to 2 (OpenAI's)")
    c.add_argument("--frequency-penalty", type=float, default=0.0, help="-2 to 2 (OpenAI's)")
    c.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens")
    c.add_argument("--ignore-eos", action="store_true", help="EOS does not end the answer")
    c.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    c.set_defaults(func=lambda a: asyncio.run(_generate(a)))

    c = sub.add_parser("models", help="list the base and every variant a running router serves")
    c.add_argument("--router", default=DEFAULT_ROUTER, help=help_router)
    c.set_defaults(func=lambda a: asyncio.run(_models(a)))

    c = sub.add_parser("workers", help="list the workers behind a running router")
    c.add_argument("--router", default=DEFAULT_ROUTER, help=help_router)
    c.set_defaults(func=lambda a: asyncio.run(_workers(a)))

    c = sub.add_parser("store", help="list, upload (put) or delete (rm) the deltas of a running delta store")
    store_sub = c.add_subparsers(dest="store_command", required=True, metavar="list|put|rm")
    help_store = f"delta store HOST:PORT (default $BITDELTA_STORE or {DEFAULT_STORE})"
    p = store_sub.add_parser("list", help="every delta the store holds")
    p.add_argument("--store", default=DEFAULT_STORE, help=help_store)
    p = store_sub.add_parser("put", help="upload a delta file; visible (and servable) once the store verified it")
    p.add_argument("file", help="a BitDelta file (bitdelta compress)")
    p.add_argument("--name", default="", help="variant name (default: the file name without .bitdelta.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace a delta of the same name")
    p.add_argument("--store", default=DEFAULT_STORE, help=help_store)
    p = store_sub.add_parser("rm", help="delete a delta")
    p.add_argument("name")
    p.add_argument("--store", default=DEFAULT_STORE, help=help_store)
    c.set_defaults(func=lambda a: asyncio.run(_store(a)))
