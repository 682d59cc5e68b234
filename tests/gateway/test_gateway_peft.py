"""The README's recipe for vLLM multi-LoRA users, as typed: PEFT adapters (made and saved by PEFT
itself, with a trained LM head and embedding LoRA on a tied base) imported by `bitdelta import-lora`
into the store's directory, one more put into the running store by `bitdelta store put`, and an
unchanged `openai` client asking for each by name through the whole system (store, worker,
router, gateway as processes). Each answer's tokens are PEFT's own greedy tokens. vLLM's runtime
routes too: /v1/load_lora_adapter and /v1/unload_lora_adapter, as a vLLM client calls them."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import pytest_asyncio

from bitdelta.testing.cluster import Cluster
from tests.gpu_worker.test_worker_peft_adapters import greedy, make_adapter, peft_model
from tests.support.archs import make_hf_base
from tests.support.cli import run_cli
from tests.support.gateway import http

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
RUNTIME = ("runtime", dict(target_modules=["k_proj", "up_proj"]))  # loaded through the gateway


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_gateway")
    base = make_hf_base(root / "base", "llama-3.2", seed=7)
    adapters = {
        name: make_adapter(base, root / "adapters" / name, 40 + i, **config)
        for i, (name, config) in enumerate([*IMPORTED.items(), PUT, RUNTIME])
    }
    bad = root / "adapters" / "broken"  # an adapter_config.json that is not one
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": "eight"}')
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
        lora = ("--lora-base", str(base), "--lora-root", str(root / "adapters"), "--delta-store", c.st.address)
        c.g = c.gateway(c.r.address, extra=lora)
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


async def test_vllm_runtime_routes_load_and_unload_an_adapter(family, cluster, client):
    """A vLLM client's calls, as vLLM answers them: a load answers once the adapter is served (its
    tokens PEFT's), a second load of the name is refused, an unload answers once it is gone (404
    for it after); bad paths, names and adapters are refused with nothing put, and the other
    variants keep serving."""
    root, base, adapters = family
    name = RUNTIME[0]
    want = greedy(peft_model(base, adapters[name]), PROMPT, N)
    sql = greedy(peft_model(base, adapters["sql"]), PROMPT, N)

    async def post(route: str, **body) -> tuple[int, object]:  # (status, JSON or text), off the loop
        return await asyncio.to_thread(http, cluster.g, "POST", f"/v1/{route}_lora_adapter", json.dumps(body).encode())

    async def refused(status: int, words: str, route: str = "load", **body) -> None:
        code, got = await post(route, **body)
        assert code == status and words in got["error"]["message"], (body, got)

    await refused(400, "not under this server's adapter directory", lora_name="x", lora_path=str(root / "base"))
    await refused(400, "not under this server's adapter directory", lora_name="x", lora_path="../base")
    await refused(404, "No adapter found", lora_name="x", lora_path="nowhere")
    await refused(400, "is not a model name", lora_name="../x", lora_path=name)
    await refused(400, "Both 'lora_name' and 'lora_path'", lora_name=name)
    await refused(400, "load_inplace is not supported", lora_name=name, lora_path=name, load_inplace=True)
    code, got = await post("load", lora_name="broken", lora_path=str(root / "adapters" / "broken"))
    assert code == 400 and "cannot load the adapter" in got["error"]["message"], got
    assert str(base) not in json.dumps(got)  # the server's own paths stay out of the answer
    assert not {name, "broken", "x"} & await listed(client, set())  # nothing was put

    loading = asyncio.ensure_future(post("load", lora_name=name, lora_path=str(adapters[name])))
    assert await answer(client, "sql") == sql  # the gateway serves while an import runs
    assert await loading == (200, f"Success: LoRA adapter '{name}' added successfully.")
    assert name in {m.id for m in (await client.models.list()).data}  # the answer came once the router listed it
    assert await answer(client, name) == want
    await refused(400, "has already been loaded", lora_name=name, lora_path=str(adapters[name]))

    assert await post("unload", lora_name=name) == (200, f"Success: LoRA adapter '{name}' removed successfully.")
    assert name not in {m.id for m in (await client.models.list()).data}
    with pytest.raises(openai.NotFoundError):
        await answer(client, name)
    await refused(404, "cannot be found", route="unload", lora_name=name)
    assert await answer(client, "sql") == sql

    # two loads of one name at once: one is served, the other refused
    twice = await asyncio.gather(*[post("load", lora_name="twin", lora_path=name) for _ in range(2)])
    assert sorted(code for code, _ in twice) == [200, 400], twice
    assert "has already been loaded" in str(twice)
    assert await answer(client, "twin") == want  # a relative lora_path is taken from --lora-root
    assert (await post("unload", lora_name="twin"))[0] == 200


async def test_vllm_runtime_routes_need_their_flags(family):
    """Without --lora-base the routes are not there (404, as vLLM's without runtime updating); the
    flags that go with it are refused alone, and it is refused without them."""
    from bitdelta.rpc.config import ConfigError
    from services.gateway.app import create_app
    from services.gateway.config import GatewayConfig

    root, base, _ = family
    router = ["--router", "127.0.0.1:1"]
    paths = {getattr(r, "path", "") for r in create_app(GatewayConfig.from_args(router, env={})).routes}
    assert "/v1/completions" in paths and not {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} & paths
    with pytest.raises(ConfigError, match="delta-store.*needs --lora-base"):
        GatewayConfig.from_args([*router, "--delta-store", "127.0.0.1:2"], env={})
    with pytest.raises(ConfigError, match="needs --lora-root"):
        GatewayConfig.from_args([*router, "--lora-base", str(base), "--delta-store", "127.0.0.1:2"], env={})
    with pytest.raises(ConfigError, match="needs --delta-store"):
        GatewayConfig.from_args([*router, "--lora-base", str(base), "--lora-root", str(root)], env={})
    with pytest.raises(ConfigError, match="no config.json"):
        GatewayConfig.from_args([*router, "--lora-base", str(root), "--lora-root", str(root)], env={})
    full = [*router, "--lora-base", str(base), "--lora-root", str(root), "--delta-store", "127.0.0.1:2"]
    paths = {getattr(r, "path", "") for r in create_app(GatewayConfig.from_args(full, env={})).routes}
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths


async def test_a_runtime_load_puts_with_the_callers_token(family, tmp_path):
    """Where the store checks tokens, a load carries the caller's own: a token without admin rights
    gets 403 and nothing is put; an admin's is put. (The routes' Adapters in process, a store
    process with a tokens file.)"""
    from bitdelta.rpc.clients.delta_store import DeltaStoreClient
    from services.gateway.adapters import Adapters, AdapterSettings
    from services.gateway.protocol import ApiError

    root, base, _ = family
    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        json.dumps({"user": {"name": "user", "variants": "*"}, "ops": {"name": "ops", "variants": "*", "admin": True}})
    )
    deltas = tmp_path / "deltas"
    deltas.mkdir()
    with Cluster(tmp_path / "cluster") as c:
        st = c.store(deltas, extra=("--tokens-file", str(tokens)))
        c.wait_serving(st)

        async def names(metadata) -> set[str]:  # the router's list stands in: the store's
            async with DeltaStoreClient(st.address, token="ops") as s:
                return {d.name for d in await s.list()}

        adapters = Adapters(AdapterSettings(base, root / "adapters", st.address, None, T), names)
        body = {"lora_name": "tok", "lora_path": RUNTIME[0]}
        with pytest.raises(ApiError) as e:
            await adapters.load(body, (("authorization", "Bearer user"),))
        assert e.value.status == 403, e.value.message
        assert not list(deltas.glob("*.safetensors"))
        assert await adapters.load(body, (("authorization", "Bearer ops"),)) == (
            "Success: LoRA adapter 'tok' added successfully."
        )
        assert [p.name for p in deltas.glob("*.safetensors")] == ["tok.bitdelta.safetensors"]
