"""The README's recipe for vLLM multi-LoRA users, as typed: PEFT adapters (made and saved by PEFT
itself, with a trained LM head and embedding LoRA on a tied base) imported by `bitdelta import-lora`
into the store's directory, one more put into the running store by `bitdelta store put`, and an
unchanged `openai` client asking for each by name through the whole system (store, worker,
router, gateway as processes). Each answer's tokens are PEFT's own greedy tokens."""

from __future__ import annotations

import asyncio

import openai
import pytest
import pytest_asyncio

from bitdelta.testing.cluster import Cluster
from tests.gpu_worker.test_worker_peft_adapters import greedy, make_adapter, peft_model
from tests.support.archs import make_hf_base
from tests.support.cli import run_cli

pytestmark = pytest.mark.asyncio(loop_scope="module")

T = 120
N = 8
PROMPT = "SELECT name FROM"
# the `--lora-modules` of a vLLM command line: name -> the adapter's LoraConfig arguments
IMPORTED = {
    "sql": dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    "chat": dict(target_modules=["o_proj", "embed_tokens"]),
}
PUT = ("later", dict(target_modules=["gate_proj", "down_proj"]))  # joins the running system


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_gateway")
    base = make_hf_base(root / "base", "llama-3.2", seed=7)
    adapters = {
        name: make_adapter(base, root / "adapters" / name, 40 + i, **config)
        for i, (name, config) in enumerate([*IMPORTED.items(), PUT])
    }
    return root, base, adapters


@pytest.fixture(scope="module")
def cluster(family):
    root, base, adapters = family
    deltas = root / "deltas"
    for name in IMPORTED:
        code, text = run_cli(
            "import-lora", "--base", str(base), "--adapter", str(adapters[name]),
            "--out", str(deltas / f"{name}.bitdelta.safetensors"),
        )  # fmt: skip
        assert code == 0, text
    with Cluster(root / "cluster") as c:
        c.st = c.store(deltas)
        c.w = c.worker(base, c.st.address, kv_cache="16MiB")
        c.r = c.router([c.w.address], c.st.address)
        c.wait_serving(c.st, c.w, c.r)
        c.g = c.gateway(c.r.address)
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(cluster):
    c = openai.AsyncOpenAI(base_url=f"http://{cluster.g.address}/v1", api_key="k", max_retries=0, timeout=T)
    yield c
    await c.close()


async def listed(client, names: set[str]) -> set[str]:
    for _ in range(600):  # the router's registry reads the store after it starts, and after a Put
        ids = {m.id for m in (await client.models.list()).data}
        if names <= ids:
            return ids
        await asyncio.sleep(0.1)
    return ids


async def answer(client, model: str) -> list[int]:
    r = await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"return_token_ids": True}
    )
    return r.choices[0].token_ids


async def test_imported_and_put_adapters_answer_peft_s_tokens_by_name(family, cluster, client):
    root, base, adapters = family
    assert set(IMPORTED) <= await listed(client, set(IMPORTED))
    want = {name: greedy(peft_model(base, adapters[name]), PROMPT, N) for name in (*IMPORTED, PUT[0])}
    assert len({tuple(v) for v in want.values()}) == len(want), "every adapter answers its own tokens"
    for name in IMPORTED:
        assert await answer(client, name) == want[name], name
    # one more adapter while the system runs: imported, then put into the store
    later = root / f"{PUT[0]}.bitdelta.safetensors"
    code, text = run_cli("import-lora", "--base", str(base), "--adapter", str(adapters[PUT[0]]), "--out", str(later))
    assert code == 0, text
    code, text = run_cli("store", "put", str(later), "--store", cluster.st.address)
    assert code == 0, text
    assert PUT[0] in await listed(client, {PUT[0]})
    got = await asyncio.gather(*[answer(client, name) for name in want])  # all in one batch
    assert dict(zip(want, got)) == want
