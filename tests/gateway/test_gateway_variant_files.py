"""A fine-tune's own chat template and sampling defaults ride in its delta (`bitdelta compress`
records them where they are not the base's) through the store and the router to the gateway, which
serves the variant with them and no flag of its own: a chat to it is rendered with its template and
sampled with its defaults, a variant without its own gets the base's, the gateway's flags override
them, and a delta put again with another template is served with the new one. A fine-tune with its
own tokenizer is served with it (by the workers), and the gateway, which holds the base's only,
refuses to tokenize for it. Store, worker,
router and gateways run as processes; the reference is the router's Generate on the prompt rendered
by hand with the same sampling set explicitly.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest
import pytest_asyncio

from bitdelta.compress import compress
from bitdelta.rpc.clients.router import RouterClient
from bitdelta.testing.cluster import Cluster
from bitdelta.testing.family import SPECIALS, make_finetune
from tests.gpu_worker.test_worker_variant_tokenizers import OWN, write_own_tokenizer
from tests.support.cli import run_cli
from tests.support.gateway import http, oai, routers_text

aio = pytest.mark.asyncio(loop_scope="module")

T = 120
BASE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
OWN_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}<assistant>"
NEW_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}=> "
FLAG_TEMPLATE = "{% for m in messages %}{{ m['content'] | upper }} {% endfor %}:: "
MESSAGES = [{"role": "user", "content": "Hi there"}]
OWN_SAMPLING = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 7}


def own_files(ft, template: str) -> None:
    (ft / "chat_template.jinja").write_text(template)
    (ft / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (ft / "generation_config.json").write_text(json.dumps({**OWN_SAMPLING, "do_sample": False}))


@pytest.fixture(scope="module")
def cluster(family, tmp_path_factory):
    work = tmp_path_factory.mktemp("variant_files")
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    ft = make_finetune(family.base, work / "chatty-ft", seed=21)
    own_files(ft, OWN_TEMPLATE)
    compress(family.base, ft, root / "chatty.bitdelta.safetensors", variant="chatty", progress=False)
    lexicon = make_finetune(family.base, work / "lexicon-ft", seed=22)
    write_own_tokenizer(lexicon, [*SPECIALS[:-1], OWN])
    compress(family.base, lexicon, root / "lexicon.bitdelta.safetensors", variant="lexicon", progress=False)
    tok = work / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": BASE_TEMPLATE}))
    (work / "flag.jinja").write_text(FLAG_TEMPLATE)
    with Cluster(work) as c:
        c.work, c.ft, c.base = work, ft, family.base
        c.st = c.store(root)
        c.w = c.worker(family.base, c.st.address)
        c.r = c.router([c.w.address], c.st.address, extra=("--refresh-s", "0.5"))
        c.wait_serving(c.st, c.w, c.r)
        c.g = c.gateway(c.r.address, chat_template=tok, extra=("--model-refresh-s", "0.5"))
        c.g_tok = c.gateway(  # with the base's tokenizer: /tokenize
            c.r.address, name="gateway-tok", chat_template=tok, extra=("--tokenizer", str(family.base))
        )
        c.g_flag = c.gateway(
            c.r.address,
            name="gateway-flag",
            chat_template=tok,
            extra=("--variant-chat-templates", f"chatty={work / 'flag.jinja'}"),
        )
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(cluster):
    router = RouterClient(cluster.r.address, generate_timeout_s=T)
    own, flag = oai(cluster.g), oai(cluster.g_flag)
    yield own, flag, router
    for c in (own, flag, router):
        await c.close()


@aio
async def test_a_variant_is_served_with_its_own_template_and_sampling_defaults(clients):
    own, _, router = clients
    r = await own.chat.completions.create(model="chatty", messages=MESSAGES, seed=1)
    # OWN_TEMPLATE by hand, with the fine-tune's eos_token; its greedy, penalised, 7-token defaults
    want = await routers_text(
        router,
        "chatty",
        "<user>Hi there<|im_end|><assistant>",
        temperature=0.0,
        repetition_penalty=1.3,
        max_new_tokens=7,
        templated=True,
    )
    assert r.choices[0].message.content == want and r.usage.completion_tokens <= 7
    # a variant without its own: the base's template and neutral defaults
    r = await own.chat.completions.create(model="v0", messages=MESSAGES, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == await routers_text(
        router, "v0", "user: Hi there\nassistant: ", max_new_tokens=6, templated=True
    )
    # what the router lists for the gateway: chatty's own, v0 none
    listed = {m.model_id: m for m in await router.list_models()}
    assert listed["chatty"].chat_template.source == OWN_TEMPLATE
    assert listed["chatty"].sampling_defaults.repetition_penalty == pytest.approx(1.3)
    assert not listed["v0"].HasField("chat_template") and not listed["v0"].HasField("sampling_defaults")


@aio
async def test_the_gateways_flag_overrides_the_deltas_template(clients):
    _, flag, router = clients
    r = await flag.chat.completions.create(model="chatty", messages=MESSAGES)
    want = await routers_text(
        router, "chatty", "HI THERE :: ", temperature=0.0, repetition_penalty=1.3, max_new_tokens=7, templated=True
    )
    assert r.choices[0].message.content == want  # the flag's template, the delta's sampling defaults


@aio
async def test_a_delta_put_again_is_served_with_its_new_template(cluster, clients):
    """Its own name, so that the other tests see chatty as it was, in any order."""
    own, _, router = clients
    ft = cluster.work / "reput-ft"
    if not ft.exists():
        shutil.copytree(cluster.ft, ft)

    async def put_and_see(template: str, prompt: str) -> None:
        own_files(ft, template)
        out = cluster.work / "reput.bitdelta.safetensors"
        code, text = run_cli(
            "compress", "--base", str(cluster.base), "--finetuned", str(ft), "--out", str(out), "--variant", "reput"
        )
        assert code == 0, text
        code, text = run_cli("store", "put", str(out), "--name", "reput", "--overwrite", "--store", cluster.st.address)
        assert code == 0, text
        want = await routers_text(
            router, "reput", prompt, temperature=0.0, repetition_penalty=1.3, max_new_tokens=7, templated=True
        )
        deadline = time.monotonic() + 30
        while True:  # the router's list (0.5 s) and the gateway's catalog (0.5 s) catch up
            r = await own.chat.completions.create(model="reput", messages=MESSAGES)
            if r.choices[0].message.content == want or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert r.choices[0].message.content == want, template

    await put_and_see(OWN_TEMPLATE, "<user>Hi there<|im_end|><assistant>")
    await put_and_see(NEW_TEMPLATE, "[Hi there]=> ")


@aio
async def test_a_variant_with_its_own_tokenizer_is_read_with_it_and_the_gateway_will_not_tokenize_for_it(
    cluster, clients
):
    from tokenizers import Tokenizer

    own, _, router = clients
    messages = [{"role": "user", "content": f"Hi {OWN}"}]
    prompt = f"user: Hi {OWN}\nassistant: "  # BASE_TEMPLATE by hand
    mine = Tokenizer.from_file(str(cluster.work / "lexicon-ft" / "tokenizer.json")).encode(prompt).ids
    theirs = Tokenizer.from_file(str(cluster.base / "tokenizer.json")).encode(prompt).ids
    assert len(mine) == len(theirs) - len(OWN) + 1  # <think> is one token to it
    r = await own.chat.completions.create(model="lexicon", messages=messages, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(mine)
    assert r.choices[0].message.content == await routers_text(
        router, "lexicon", prompt, max_new_tokens=6, templated=True
    )
    r = await own.chat.completions.create(model="v0", messages=messages, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(theirs)
    listed = {m.model_id: m for m in await router.list_models()}
    assert len(listed["lexicon"].tokenizer_sha256) == 64 and listed["v0"].tokenizer_sha256 == ""
    ok = await asyncio.to_thread(
        http,
        cluster.g_tok,
        "POST",
        "/tokenize",
        json.dumps({"model": "v0", "prompt": prompt, "add_special_tokens": False}).encode(),
    )
    assert ok[0] == 200 and ok[1]["tokens"] == theirs
    for path, body in (
        ("/tokenize", {"model": "lexicon", "prompt": prompt}),
        ("/detokenize", {"model": "lexicon", "tokens": [1, 2]}),
        ("/v1/completions", {"model": "lexicon", "prompt": [72, 105], "echo": True, "max_tokens": 2}),
    ):
        status, answer = await asyncio.to_thread(http, cluster.g_tok, "POST", path, json.dumps(body).encode())
        assert status == 400 and "its own tokenizer" in answer["error"]["message"], (path, answer)
        assert answer["error"]["code"] == "tokenizer_not_served"
