"""vLLM's `add_special_tokens` through the whole system (store, worker, router, gateway as processes)
on a tiny family whose tokenizer adds a BOS itself, as Llama's do (the other gateway tests' adds
none, so the field would change nothing there)."""

from __future__ import annotations

import asyncio
import json
import shutil

import openai
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from bitdelta.testing.cluster import Cluster
from bitdelta.testing.family import make_test_family
from tests.gateway.test_gateway import http
from tests.support.family import add_bos_to_tokenizer
from tests.support.structured import gateway_client

pytestmark = pytest.mark.asyncio(loop_scope="module")

T = 120
N = 6
CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    fam = make_test_family(tmp_path_factory.mktemp("bos_family"), n_variants=1, merged=False)
    fam.bos = add_bos_to_tokenizer(fam.base)
    return fam


@pytest.fixture(scope="module")
def cluster(family, tmp_path_factory):
    work = tmp_path_factory.mktemp("bos_cluster")
    root = work / "deltas"
    root.mkdir()
    shutil.copy(family.delta_path("v0"), root)
    tok = work / "tokenizer"
    tok.mkdir()
    template = (
        "{% for m in messages %}{{ bos_token }}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ bos_token }}assistant: "
    )
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": family.bos}))
    with Cluster(work) as c:
        c.st = c.store(root)
        c.w = c.worker(family.base, c.st.address, kv_cache="16MiB")
        c.r = c.router([c.w.address], c.st.address)
        c.wait_serving(c.st, c.w, c.r)
        c.g = c.gateway(c.r.address, chat_template=tok, extra=("--tokenizer", str(family.base)))
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(cluster):
    c = await gateway_client(cluster.g.address, {"v0"}, T)
    yield c
    await c.close()


async def test_completions_add_the_bos_unless_told_not_to(client, family):
    """By default the tokenizer's BOS comes first (vLLM's completions); `add_special_tokens: false`
    runs the text alone, which answers as the token-id prompt without the BOS; token ids are used as
    they are either way."""
    tok = Tokenizer.from_file(str(family.base / "tokenizer.json"))
    prompt = "The quick brown fox"
    with_bos, bare = tok.encode(prompt).ids, tok.encode(prompt, add_special_tokens=False).ids
    assert with_bos == [256, *bare]
    kw = dict(model="v0", max_tokens=N, temperature=0)
    plain = await client.completions.create(prompt=prompt, **kw)
    off = await client.completions.create(prompt=prompt, extra_body={"add_special_tokens": False}, **kw)
    assert plain.usage.prompt_tokens == len(with_bos) and off.usage.prompt_tokens == len(bare)
    assert plain.choices[0].text == (await client.completions.create(prompt=with_bos, **kw)).choices[0].text
    assert off.choices[0].text == (await client.completions.create(prompt=bare, **kw)).choices[0].text
    on = await client.completions.create(prompt=bare, extra_body={"add_special_tokens": True}, **kw)
    assert on.usage.prompt_tokens == len(bare), "token ids are used as they are"


async def test_chat_adds_none_unless_told_to_and_tokenize_agrees(client, cluster, family):
    """Chat's template writes its own BOS, so by default the tokenizer adds none (vLLM's chat);
    `add_special_tokens: true` adds one more in front, as vLLM does; /tokenize counts alike."""
    tok = Tokenizer.from_file(str(family.base / "tokenizer.json"))
    rendered = f"{family.bos}user: Hi there\n{family.bos}assistant: "
    kw = dict(model="v0", messages=CHAT, max_tokens=1, temperature=0)
    c = await client.chat.completions.create(**kw)
    on = await client.chat.completions.create(extra_body={"add_special_tokens": True}, **kw)
    assert c.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False).ids)
    assert on.usage.prompt_tokens == c.usage.prompt_tokens + 1 == len(tok.encode(rendered).ids)
    for extra, count in (({}, c.usage.prompt_tokens), ({"add_special_tokens": True}, on.usage.prompt_tokens)):
        body = json.dumps({"model": "v0", "messages": CHAT, **extra}).encode()
        got, out = await asyncio.to_thread(http, cluster.g, "POST", "/tokenize", body)
        assert got == 200 and out["count"] == count and out["tokens"][0] == 256, extra
        assert (out["tokens"][1] == 256) == bool(extra), "a second BOS only when asked"
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(extra_body={"add_special_tokens": "yes"}, **kw)
    assert err.value.body["param"] == "add_special_tokens"
