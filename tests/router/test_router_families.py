"""Families end to end, as a user runs them: a base (built by transformers), a random full
fine-tune (every weight, bias and norm moved), `bitdelta compress` and `bitdelta apply`; a delta
store, the worker and the router as processes on loopback. The router's greedy tokens for the
variant, and for the base, equal transformers' greedy tokens on the applied (dense) checkpoint,
asked one at a time and all at once (one mixed batch).

As processes: one member of each kind of checkpoint and step (SERVED); every member is covered
by the chain of the same equalities in process: `apply`'s checkpoint in transformers equals the
compact model with the delta attached (tests/core/test_arch.py), which equals the worker's mixed
step with several variants and the base (tests/gpu_worker/test_worker_families.py).

The prompt plus the answer run past the rope's original context (llama3, LongRoPE) and past the
sliding windows (Gemma 3)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from bitdelta import cli
from bitdelta.generation import Sampling
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.rpc.clients.router import RouterClient
from bitdelta.testing.cluster import Cluster
from bitdelta.testing.family import make_finetune
from tests.support.archs import FAMILY_MEMBERS, ORIGINAL, hf_greedy, make_hf_base

# llama3 rope; LongRoPE's switch with length; a multimodal checkpoint's names with local and global
# layers; a sparse MoE; a parallel block with a biased head
SERVED = ("llama-3.1", "phi3-longrope", "gemma3-mm", "qwen3-moe", "phi")
assert set(SERVED) <= set(FAMILY_MEMBERS)

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = "Family ties."  # 12 bytes: 12 tokens of the byte tokenizer
N = 22  # new tokens: 34 in all, past ORIGINAL (16) and the 8-token windows
T = 120  # deadline (s) of a call: the machine may be busy


def family(root, deltas, name: str):
    """(base, {model id: dense checkpoint}) of one member: a compressed fine-tune in `deltas`."""
    base = make_hf_base(root / "base", name, seed=7)
    dense = {"": base}
    for i in range(1):
        ft = make_finetune(base, root / f"ft{i}", seed=20 + i, scale=0.02)
        variant = f"{name}-v{i}"
        delta = deltas / f"{variant}.bitdelta.safetensors"
        assert not cli.main(
            ["compress", "--base", str(base), "--finetuned", str(ft), "--out", str(delta), "--variant", variant]
        )
        shutil.rmtree(ft)
        assert not cli.main(["apply", "--base", str(base), "--delta", str(delta), "--out", str(root / variant)])
        dense[variant] = root / variant
    return base, dense


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One delta store holding every family's deltas; per family a worker on its base and a router
    in front of it (all started at once: the processes start in parallel)."""
    root = tmp_path_factory.mktemp("families")
    deltas = root / "deltas"
    members = {name: family(root / name, deltas, name) for name in SERVED}
    with Cluster(root / "cluster") as c:
        store = c.store(deltas)
        workers = {
            n: c.worker(base, store.address, name=f"worker-{n}", delta_budget="2MiB")
            for n, (base, _) in members.items()
        }
        routers = {n: c.router([w.address], store.address, name=f"router-{n}") for n, w in workers.items()}
        c.wait_serving(store, *workers.values(), *routers.values())
        yield {n: (routers[n].address, members[n][1]) for n in members}


async def tokens(router: RouterClient, model: str) -> list[int]:
    sampling = Sampling(max_new_tokens=N, ignore_eos=True).to_pb()  # N tokens whatever EOS comes
    req = pb.GenerateRequest(model_id=model, prompt=PROMPT, sampling=sampling)
    return [t.token_id async for m in router.generate_request(req) for t in m.tokens]


@pytest.mark.parametrize("name", SERVED)
async def test_router_serves_each_family_like_transformers(served, name):
    address, dense = served[name]
    prompt = list(PROMPT.encode())
    assert len(prompt) + N > ORIGINAL + 8
    want = {m: hf_greedy(ckpt, prompt, N, stop_at_eos=False) for m, ckpt in dense.items()}
    assert len({tuple(w) for w in want.values()}) == 2  # the variant answers differently from the base
    async with RouterClient(address, generate_timeout_s=T) as r:
        for _ in range(300):  # until the router has seen the store's deltas and its worker
            if {m.model_id for m in await r.list_models()} >= set(dense) - {""} and all(
                w.up for w in await r.list_workers()
            ):
                break
            await asyncio.sleep(0.1)
        for model in dense:  # one at a time
            assert await tokens(r, model) == want[model], (name, model, "alone")
        models = list(dense) * 2  # all at once: the variant and the base, twice each, in one batch
        got = await asyncio.gather(*[tokens(r, m) for m in models])
        for model, toks in zip(models, got):
            assert toks == want[model], (name, model, "mixed")
