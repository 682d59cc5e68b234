"""The OpenAI-compatible gateway end to end: the official `openai` client (and raw HTTP where the
client would hide the wire) against gateway + router + worker + delta store as processes on
loopback, a tiny random family (real checkpoints and delta files).

Correctness is "the same text as the router's Generate for the same variant and prompt"; the
router and the worker are checked against their own references in test_router.py and
test_worker_service.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import signal
import socket
import time
from pathlib import Path

import openai
import pytest
import pytest_asyncio

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.generation import Constraint, ConstraintKind, Sampling
from bitdelta.router.v1 import router_pb2 as rpb
from bitdelta.rpc.clients.router import RouterClient
from bitdelta.rpc.clients.worker import WorkerClient
from bitdelta.testing.cluster import Cluster, free_port
from services.gateway.chat import ChatTemplate, ChatTemplateError
from tests.support.gateway import http
from tests.support.metrics import sample

pytestmark = pytest.mark.asyncio(loop_scope="module")

N = 12  # new tokens per generation
T = 120  # client deadlines (s): generous, the machine may be busy
# The family's byte tokenizer has no chat template: these stand in for the base's and one variant's.
BASE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}"
)
V1_TEMPLATE = (  # its documents as a RAG template writes them (Command R's, Granite's)
    "{% if documents %}[DOCS]{% for d in documents %} {{ d.title }}: {{ d.text }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}[ASSISTANT] "
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
BOS = "<s>"
BASE_RENDERED = f"{BOS}system: Be brief.\n{BOS}user: Hi there\n{BOS}assistant: "  # BASE_TEMPLATE by hand
V1_RENDERED = "[SYSTEM] Be brief.\n[USER] Hi there\n[ASSISTANT] "
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def cluster(family, tmp_path_factory):
    """Store, one worker, one router; gateways: with the chat templates, without any, in front of a
    router that is not there, with a 1 s deadline per generation, and with a reasoning parser."""
    work = tmp_path_factory.mktemp("gateway_cluster")
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    tok = work / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": BASE_TEMPLATE, "bos_token": BOS}))
    (work / "v1.jinja").write_text(V1_TEMPLATE)
    with Cluster(work) as c:
        c.st = c.store(root)
        c.w_metrics = free_port()  # the worker's prefill counter (n choices share one prefill)
        c.w = c.worker(family.base, c.st.address, extra=("--metrics-address", f"127.0.0.1:{c.w_metrics}"))
        c.r = c.router([c.w.address], c.st.address, extra=("--max-prompt-bytes", "4096"))
        c.wait_serving(c.st, c.w, c.r)
        c.g = c.gateway(
            c.r.address,
            chat_template=tok,
            extra=("--variant-chat-templates", f"v1={work / 'v1.jinja'}", "--tokenizer", str(family.base)),
        )
        c.g_plain = c.gateway(c.r.address, name="gateway-plain")
        c.g_dead = c.gateway(f"127.0.0.1:{free_port()}", name="gateway-dead")
        c.g_short = c.gateway(c.r.address, name="gateway-short", extra=("--request-timeout-s", "1"))
        c.g_think = c.gateway(
            c.r.address, name="gateway-think", chat_template=tok, extra=("--reasoning-parser", "qwen3")
        )
        c.g_store = c.gateway(c.r.address, name="gateway-store", chat_template=tok, extra=("--responses-store", "8"))
        yield c


def oai(gateway, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        **{"base_url": f"http://{gateway.address}/v1", "api_key": "test-key", "max_retries": 0, "timeout": T, **kw}
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(cluster):
    router = RouterClient(cluster.r.address, generate_timeout_s=T)
    worker = WorkerClient(cluster.w.address, generate_timeout_s=T)
    client = oai(cluster.g)
    deadline = time.monotonic() + 60
    while not all(w.up for w in await router.list_workers()):
        assert time.monotonic() < deadline, "the router never saw its worker up"
        await asyncio.sleep(0.1)
    yield client, router, worker
    await client.close()
    await router.close()
    await worker.close()


async def router_text(router: RouterClient, model: str, prompt: str, n: int = N, **kw) -> tuple[str, list]:
    """The router's text and its tokens (of every message)."""
    toks = [t async for m in router.generate(model, prompt, max_new_tokens=n, **kw) for t in m.tokens]
    return "".join(t.text for t in toks), toks


def assert_error_shape(body, status: int, got_status: int, param=None, words: str = ""):
    assert got_status == status, body
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    e = body["error"]
    assert isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str), e
    assert e["param"] == param, e
    assert words in e["message"], e


# -- models ------------------------------------------------------------------------------------------------


async def test_models_list_the_base_and_servable_variants(clients, family):
    client, router, _ = clients
    page = await client.models.list()
    ids = [m.id for m in page.data]
    listed = await router.list_models()
    base = listed[0].model_id
    assert listed[0].is_base and ids[0] == base
    assert set(ids) == {base, *family.variants}, "servable variants only; the wrong-base delta is omitted"
    assert family.other_base in {m.model_id for m in listed} and family.other_base not in ids
    for m in page.data:
        assert m.object == "model" and m.owned_by == "bitdelta"
        assert m.parent == (None if m.id == base else base)
    one = await client.models.retrieve("v0")
    assert one.id == "v0" and one.parent == base
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")


# -- completions -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model,prompt", [("v0", "The quick brown fox"), ("v1", "abc xyz"), ("", "Hello world")])
async def test_greedy_completion_equals_the_routers_generate(clients, model, prompt):
    client, router, _ = clients
    model = model or (await router.list_models())[0].model_id
    want, msgs = await router_text(router, model, prompt)
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    r = await client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.model == model and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens == msgs[-1].usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + N

    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=N, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1, "tokens arrive as separate chunks"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert len({c.id for c in chunks}) == 1


async def test_stop_maps_to_stop_and_matches_the_router(clients):
    client, router, _ = clients
    full, _ = await router_text(router, "v0", "The quick brown fox", n=40)
    i, stop = next((i, ch) for i, ch in enumerate(full) if i > 0 and ch.isascii() and ch.isprintable())
    want, msgs = await router_text(router, "v0", "The quick brown fox", n=40, stop=[stop])
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_STOP and want == full[:i]
    r = await client.completions.create(
        model="v0", prompt="The quick brown fox", max_tokens=40, temperature=0, stop=stop
    )
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"


async def test_seeded_sampling_is_repeatable_and_equals_the_router(clients):
    client, router, _ = clients
    kw = dict(model="v1", prompt="abc xyz", max_tokens=N, temperature=0.9, top_p=0.95)
    a = await client.completions.create(seed=5, **kw)
    b = await client.completions.create(seed=5, **kw)
    want, _ = await router_text(router, "v1", "abc xyz", temperature=0.9, top_p=0.95, seed=5)
    assert a.choices[0].text == b.choices[0].text == want
    # seed 0 is a seed like any other (the router's 0 would mean "random")
    z = [(await client.completions.create(seed=0, **kw)).choices[0].text for _ in range(2)]
    assert z[0] == z[1]


async def test_n_choices_share_one_prefill(clients, cluster):
    """n = 4: one prefill on the worker (its counter grows by the prompt's tokens once), four
    choices with their index, usage counting every choice's tokens. Seeded: choice i is what a
    single request with choice i's seed gives (so the forked KV cache is the prompt's, the partly
    filled block's copy included), the choices differ, a second request repeats them; streamed
    (chat), each choice's chunks carry its index and add up to the whole answer's."""
    client, router, _ = clients
    prompt = "the shared prompt, forked"  # not a multiple of the block size: a partial block to copy
    kw = dict(model="v1", prompt=prompt, max_tokens=N, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    before = await asyncio.to_thread(sample, cluster.w_metrics, "bitdelta_worker_prefill_tokens_total")
    r = await client.completions.create(n=4, **kw)
    after = await asyncio.to_thread(sample, cluster.w_metrics, "bitdelta_worker_prefill_tokens_total")
    assert after - before == r.usage.prompt_tokens, "four choices, one prefill"
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 4 * N and all(c.finish_reason == "length" for c in r.choices)
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1, "each choice draws with its own seed"
    assert [c.text for c in (await client.completions.create(n=4, **kw)).choices] == texts
    sp = Sampling(max_new_tokens=N, temperature=0.9, seed=11, ignore_eos=True)
    for i in range(4):
        s = dataclasses.replace(sp, seed=sp.choice_seed(i))
        req = rpb.GenerateRequest(model_id="v1", prompt=prompt, sampling=s.to_pb())
        assert "".join([t.text async for m in router.generate_request(req) for t in m.tokens]) == texts[i], i
    greedy = await client.completions.create(model="v0", prompt=prompt, max_tokens=N, temperature=0, n=3)
    want, _ = await router_text(router, "v0", prompt)
    assert [c.text for c in greedy.choices] == [want] * 3

    ckw = dict(model="v1", messages=CHAT, max_tokens=N, temperature=0.9, seed=3, n=2)
    whole = await client.chat.completions.create(**ckw)
    stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ckw)
    parts, finishes, usage = {0: "", 1: ""}, {}, None
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert [parts[0], parts[1]] == [c.message.content for c in whole.choices]
    assert set(finishes) == {0, 1} and usage.completion_tokens == whole.usage.completion_tokens


# -- chat --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model,rendered", [("v0", BASE_RENDERED), ("v1", V1_RENDERED)])
async def test_chat_renders_the_template_and_equals_the_router(clients, model, rendered):
    """v0 has no template of its own: the base's; v1 has its own (--variant-chat-templates)."""
    client, router, _ = clients
    want, msgs = await router_text(router, model, rendered)
    r = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == msgs[-1].usage.prompt_tokens and r.usage.completion_tokens == N

    stream = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=N, temperature=0, stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not any(c.choices[0].finish_reason for c in chunks[:-1])


async def test_text_parts_reach_the_template_as_vllms(clients):
    """A message of several text parts: the base's template takes a message's content as a string
    (no loop over it: --chat-template-content-format auto finds "string"), so its parts reach it
    joined by newlines, as vLLM joins them."""
    client, router, _ = clients
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    want, _ = await router_text(router, "v0", f"{BOS}system: Be brief.\n{BOS}user: Hi\nthere\n{BOS}assistant: ")
    msgs = [CHAT[0], {"role": "user", "content": parts}]
    r = await client.chat.completions.create(model="v0", messages=msgs, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == want


async def test_responses_run_as_the_chat_they_mean(clients):
    """/v1/responses through the openai SDK: `instructions` a system message first, `input` the user's
    (a string, or messages of text parts with a developer's message as the system's), max_output_tokens
    the chat's max_tokens: the router's text for the prompt the base's template renders, as a
    response object (incomplete at max_output_tokens) and as its stream of typed events."""
    client, router, _ = clients
    want, toks = await router_text(router, "v0", BASE_RENDERED)
    kw = dict(model="v0", max_output_tokens=N, temperature=0)
    r = await client.responses.create(instructions="Be brief.", input="Hi there", **kw)
    assert r.id.startswith("resp_") and r.object == "response" and r.output_text == want
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (toks[-1].usage.prompt_tokens, N)
    assert r.output[0].role == "assistant" and r.store is False and r.max_output_tokens == N
    parts = [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "there"}]
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    joined, _ = await router_text(router, "v0", f"{BOS}system: Be brief.\n{BOS}user: Hi\nthere\n{BOS}assistant: ")
    assert (await client.responses.create(input=msgs, **kw)).output_text == joined
    events = [
        e async for e in await client.responses.create(instructions="Be brief.", input="Hi there", stream=True, **kw)
    ]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want and events[-1].response.usage.output_tokens == N


async def test_responses_refuse_what_they_do_not_serve(clients):
    """A field that needs a stored response, a hosted tool or a non-text item is 400 naming it; a
    chat parser's error names the Responses field (max_output_tokens, not max_tokens)."""
    client, _, _ = clients
    kw = dict(model="v0", input="Hi", max_output_tokens=N)
    for extra, param, words in (
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools", "function tools only"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}, "x": 1}]}, "tools", "not a field"),
        ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "tool_choice must be"),
        ({"tools": [{"type": "function", "name": "f b"}]}, "tools", "tools[0].name must be"),
        ({"background": True}, "background", "background"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "function_call_output"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "arguments"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text parts"),
        ({"text": {"format": {"type": "xml"}}}, "text", "json_schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format.schema", "JSON object"),
        ({"frobnicate": 1}, "frobnicate", "not supported"),
    ):
        with pytest.raises(openai.BadRequestError) as e:  # sent as they are (extra_body)
            await client.responses.create(**{k: v for k, v in kw.items() if k not in extra}, extra_body=extra)
        assert_error_shape(e.value.response.json(), 400, e.value.status_code, param, words)


async def test_responses_logprobs_are_chats(clients):
    """/v1/responses with include message.output_text.logprobs and top_logprobs: each generated token's
    logprob and alternatives in the output_text part, the chat answer's for the same request, whole and
    streamed (each delta its tokens', in order; the done event and the final response all of them);
    top_logprobs alone asks too, neither gives none; another include, top_logprobs past 20, and logprobs
    beside function tools are 400 naming the field."""
    client, router, _ = clients
    base = (await router.list_models())[0].model_id
    kw = dict(model=base, input=CHAT, max_output_tokens=N, temperature=0)
    c = await client.chat.completions.create(
        model=base, messages=CHAT, max_tokens=N, temperature=0, logprobs=True, top_logprobs=2
    )
    want = c.choices[0].logprobs.content

    def same(got, k):
        assert [e.token for e in got] == [e.token for e in want] and len(got) == N
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-5)
        for g, w in zip(got, want):
            assert len(g.top_logprobs) == k and g.bytes == list(g.token.encode())
            assert [t.logprob for t in g.top_logprobs] == pytest.approx(
                [t.logprob for t in w.top_logprobs[:k]], abs=1e-5
            )

    r = await client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    assert r.top_logprobs == 2 and r.output_text == c.choices[0].message.content
    same(r.output[0].content[0].logprobs, 2)
    same((await client.responses.create(top_logprobs=1, **kw)).output[0].content[0].logprobs, 1)
    same(
        (await client.responses.create(include=["message.output_text.logprobs"], **kw)).output[0].content[0].logprobs, 0
    )
    assert (await client.responses.create(**kw)).output[0].content[0].logprobs == []

    events = [
        e
        async for e in await client.responses.create(
            include=["message.output_text.logprobs"], top_logprobs=2, stream=True, **kw
        )
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp for e in deltas for lp in e.logprobs]
    assert len(deltas) > 1 and all(e.logprobs for e in deltas)
    assert [e.token for e in streamed] == [e.token for e in want]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in want], abs=1e-5)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [e.token for e in done.logprobs] == [e.token for e in want]
    same(events[-1].response.output[0].content[0].logprobs, 2)

    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    for extra, param, words in (
        ({"include": ["reasoning.encrypted_content"]}, "include", "only 'message.output_text.logprobs'"),
        ({"include": "message.output_text.logprobs"}, "include", "list of strings"),
        ({"top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
        ({"top_logprobs": True}, "top_logprobs", "integer"),
        ({"top_logprobs": 1, "tools": [tool]}, "include", "beside function tools"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(**kw, extra_body=extra)
        assert_error_shape(e.value.response.json(), 400, e.value.status_code, param, words)


async def test_stored_responses_continue_their_conversation(clients, cluster):
    """With --responses-store (vLLM's VLLM_ENABLE_RESPONSES_API_STORE): an answer is kept (store true by
    default), whole or streamed; previous_response_id continues its conversation (its input and output
    turns, then this input; its instructions not carried over), the router's text for that prompt;
    GET /v1/responses/{id} returns it and DELETE drops it, for the caller whose key made it alone (another
    key: 404, as for an id never kept); store false keeps nothing. Without a store: 404 and 400."""
    _, router, _ = clients
    client, other = oai(cluster.g_store), oai(cluster.g_store, api_key="another-key")
    try:
        kw = dict(model="v0", max_output_tokens=N, temperature=0)
        first = await client.responses.create(instructions="Be brief.", input="Hi there", **kw)
        want, _ = await router_text(router, "v0", BASE_RENDERED)
        assert first.output_text == want and first.store is True
        got = await client.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == want and got.previous_response_id is None

        second = await client.responses.create(previous_response_id=first.id, input="And then?", **kw)
        turns = f"{BOS}user: Hi there\n{BOS}assistant: {want}\n{BOS}user: And then?\n{BOS}assistant: "
        want2, _ = await router_text(router, "v0", turns)
        assert second.output_text == want2 and second.previous_response_id == first.id
        third = await client.responses.create(
            previous_response_id=second.id, instructions="Be brief.", input="Why?", stream=True, **kw
        )
        events = [e async for e in third]
        turns3 = f"{turns}{want2}\n{BOS}user: Why?\n{BOS}assistant: "
        want3, _ = await router_text(router, "v0", f"{BOS}system: Be brief.\n{turns3}")
        assert events[-1].response.output_text == want3
        kept = await client.responses.retrieve(events[0].response.id)
        assert kept.output_text == want3 and kept.status == events[-1].response.status

        for call in (
            other.responses.retrieve(first.id),
            other.responses.create(previous_response_id=first.id, input="x", **kw),
            client.responses.retrieve("resp_never"),
        ):
            with pytest.raises(openai.NotFoundError) as e:
                await call
            assert "no stored response" in e.value.response.json()["error"]["message"]
        unkept = await client.responses.create(input="Hi there", store=False, **kw)
        assert unkept.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unkept.id)
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        assert (await client.responses.retrieve(second.id)).output_text == want2  # the others stay
        got, metrics = await asyncio.to_thread(http, cluster.g_store, "GET", "/metrics")  # one label, no ids
        assert got == 200 and 'route="/v1/responses/{response_id}",status="404"' in metrics
        assert first.id not in metrics

        plain = clients[0]  # a gateway without a store
        with pytest.raises(openai.NotFoundError) as e:
            await plain.responses.retrieve(second.id)
        assert "--responses-store" in e.value.response.json()["error"]["message"]
        assert (await plain.responses.create(input="Hi there", **kw)).store is False  # store: answered false
    finally:
        await client.close()
        await other.close()


async def _settled(client: openai.AsyncOpenAI, response_id: str):
    """The stored response once it is no longer queued or in progress."""
    deadline = time.monotonic() + T
    while (got := await client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {got.status}"
        await asyncio.sleep(0.05)
    return got


async def test_background_responses_run_while_the_caller_polls(clients, cluster):
    """OpenAI's background mode (as vLLM's, with its store): the request is checked, answered at once
    as queued, and run by the gateway; GET returns it in progress and then completed with the router's
    text, or failed with the error a waiting caller would get; cancel stops a running one and keeps
    it cancelled, and is 400 for a finished or synchronous one; DELETE stops one too. Refused: without
    a store, with store false. (With stream: test_background_streams_resume.)"""
    _, router, _ = clients
    client, other = oai(cluster.g_store), oai(cluster.g_store, api_key="another-key")
    try:
        kw = dict(model="v0", max_output_tokens=N, temperature=0)
        bg = await client.responses.create(instructions="Be brief.", input="Hi there", background=True, **kw)
        assert bg.status == "queued" and bg.background is True and bg.output == [] and bg.usage is None
        done = await _settled(client, bg.id)
        want, _ = await router_text(router, "v0", BASE_RENDERED)
        waited = await client.responses.create(instructions="Be brief.", input="Hi there", store=False, **kw)
        assert done.output_text == waited.output_text == want and done.background is True
        assert done.status == waited.status and done.status in ("completed", "incomplete")
        assert done.usage.output_tokens > 0 and done.error is None
        nxt = await client.responses.create(previous_response_id=bg.id, input="And then?", **kw)  # continues it
        turns = f"{BOS}user: Hi there\n{BOS}assistant: {want}\n{BOS}user: And then?\n{BOS}assistant: "
        assert nxt.output_text == (await router_text(router, "v0", turns))[0]
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.cancel(bg.id)
        assert f"already {done.status}" in e.value.response.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.cancel(nxt.id)
        assert "synchronous" in e.value.response.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            await other.responses.cancel(bg.id)  # another caller's

        too_long = await client.responses.create(input="word " * 400, background=True, **kw)
        failed = await _settled(client, too_long.id)
        with pytest.raises(openai.BadRequestError) as e:  # what a waiting caller is answered
            await client.responses.create(input="word " * 400, **kw)
        assert failed.status == "failed" and failed.output == []
        assert failed.error.message == e.value.response.json()["error"]["message"]

        long = dict(kw, max_output_tokens=200)
        for _ in range(3):  # cancelled while it runs (or before its task starts)
            run = await client.responses.create(input="Hi there", background=True, **long)
            cancelled = await client.responses.cancel(run.id)
            assert cancelled.status == "cancelled" and cancelled.id == run.id
            await asyncio.sleep(0.3)
            assert (await client.responses.retrieve(run.id)).status == "cancelled"  # the run did not overwrite it
            with pytest.raises(openai.BadRequestError):
                await client.responses.cancel(run.id)
        gone = await client.responses.create(input="Hi there", background=True, **long)
        await client.responses.delete(gone.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(gone.id)
        await asyncio.sleep(0.3)
        with pytest.raises(openai.NotFoundError):  # its run, stopped, did not keep it again
            await client.responses.retrieve(gone.id)
        got, metrics = await asyncio.to_thread(http, cluster.g_store, "GET", "/metrics")
        assert 'route="/v1/responses/{response_id}/cancel",status="200"' in metrics

        for bad, plain, why in (
            (dict(store=False), False, "store must be true"),
            ({}, True, "--responses-store"),
        ):
            c = clients[0] if plain else client
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.create(input="Hi there", background=True, **kw, **bad)
            err = e.value.response.json()["error"]
            assert why in err["message"] and err["param"] == "background", err
    finally:
        await client.close()
        await other.close()


async def test_background_streams_resume(clients, cluster):
    """A background response with stream (OpenAI's resumable stream, as vLLM serves it): its events as
    they come; a caller that stops reading leaves it running, and GET ?stream=true&starting_after=N
    sends the events past N, live and after it ended (the same events); the answer is the waiting
    stream's. Refused before its first event: one error event. GET with stream of a response that
    kept no events is 400."""
    _, router, _ = clients
    client = oai(cluster.g_store)
    try:
        kw = dict(model="v0", max_output_tokens=N, temperature=0)
        want, _ = await router_text(router, "v0", BASE_RENDERED)
        whole = [e async for e in await client.responses.create(instructions="Be brief.", input="Hi there", background=True, stream=True, **kw)]  # fmt: skip
        assert whole[-1].response.output_text == want and whole[-1].response.background is True
        assert [e.sequence_number for e in whole] == list(range(len(whole)))
        rid = whole[0].response.id
        assert (await client.responses.retrieve(rid)).output_text == want
        again = [e async for e in await client.responses.retrieve(rid, stream=True, starting_after=2)]
        assert [e.model_dump() for e in again] == [e.model_dump() for e in whole[3:]]

        long = dict(kw, max_output_tokens=120)
        first = await client.responses.create(input="Hi there", background=True, stream=True, **long)
        seen = []
        async for e in first:
            seen.append(e)
            if len(seen) == 4:
                break
        await first.close()  # the caller goes away: the response goes on
        rest = [e async for e in await client.responses.retrieve(seen[0].response.id, stream=True, starting_after=3)]
        joined = seen + rest
        assert [e.sequence_number for e in joined] == list(range(len(joined)))
        assert joined[-1].type in ("response.completed", "response.incomplete")
        replay = [e async for e in await client.responses.retrieve(seen[0].response.id, stream=True)]
        assert [e.model_dump() for e in replay] == [e.model_dump() for e in joined]
        done = await client.responses.retrieve(seen[0].response.id)
        assert done.output_text == joined[-1].response.output_text and done.status == joined[-1].response.status

        bad = [e async for e in await client.responses.create(input="word " * 400, background=True, stream=True, **kw)]
        assert [e.type for e in bad] == ["error"] and "context" in bad[0].message
        sync = await client.responses.create(input="Hi there", **kw)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.retrieve(sync.id, stream=True)
        assert "no events to stream" in e.value.response.json()["error"]["message"]
    finally:
        await client.close()


async def test_chat_echo_and_role_are_vllms(clients):
    """vLLM's chat echo: the last message's content comes before the answer when that message has the
    answer's role (assistant after a generation prompt, else the last message's own: the prompt
    continues it), whole and streamed (a chunk of its own after the role's); otherwise nothing is
    added. Not with tools (their calls are parsed from the answer's text)."""
    client, router, _ = clients
    no_header = BASE_RENDERED.removesuffix(f"{BOS}assistant: ")
    turns = [*CHAT, {"role": "assistant", "content": "Hello, I am"}]
    kw = dict(model="v0", max_tokens=N, temperature=0)
    cont = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    want, _ = await router_text(router, "v0", f"{no_header}{BOS}assistant: Hello, I am")
    r = await client.chat.completions.create(messages=turns, extra_body=cont, **kw)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == "Hello, I am" + want
    chunks = [x async for x in await client.chat.completions.create(messages=turns, extra_body=cont, stream=True, **kw)]
    deltas = [x.choices[0].delta for x in chunks if x.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == "Hello, I am"
    assert "".join(d.content or "" for d in deltas) == r.choices[0].message.content

    user_last = {"add_generation_prompt": False, "echo": True}
    want, _ = await router_text(router, "v0", no_header)
    u = await client.chat.completions.create(messages=CHAT, extra_body=user_last, **kw)
    assert u.choices[0].message.role == "user" and u.choices[0].message.content == "Hi there" + want
    plain = await client.chat.completions.create(messages=CHAT, **kw)
    echoed = await client.chat.completions.create(messages=CHAT, extra_body={"echo": True}, **kw)
    assert echoed.choices[0].message.content == plain.choices[0].message.content, "the roles differ: no echo"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(messages=CHAT, tools=tools, extra_body={"echo": True}, **kw)
    assert err.value.body["param"] == "echo"


async def test_documents_reach_a_rag_template(clients):
    """vLLM's `documents` reach the chat template as transformers passes them (v1's reads them: the
    router's text for the prompt rendered by hand); a template that does not read them is 400 (they
    would be left out), as is a malformed list."""
    client, router, _ = clients
    kw = dict(max_tokens=N, temperature=0)
    docs = [{"title": "Lima", "text": "Capital of Peru."}, {"title": "Quito", "text": "Capital of Ecuador."}]
    want, _ = await router_text(
        router, "v1", "[DOCS] Lima: Capital of Peru. Quito: Capital of Ecuador.\n" + V1_RENDERED
    )
    r = await client.chat.completions.create(model="v1", messages=CHAT, extra_body={"documents": docs}, **kw)
    assert r.choices[0].message.content == want
    for model, bad, words in (
        ("v0", docs, "does not read documents"),
        ("v1", {"title": "x"}, "list of objects"),
        ("v1", [{"title": 1}], "string fields"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=model, messages=CHAT, extra_body={"documents": bad}, **kw)
        assert e.value.body["param"] == "documents" and words in e.value.body["message"], e.value.body


async def test_chat_render_fields_of_vllm(clients, cluster):
    """vLLM's chat request fields reach the template: add_generation_prompt false ends the prompt after
    the messages, continue_final_message ends it inside the last one (the model goes on with it), each
    the router's text for the prompt rendered by hand; /tokenize renders the same; chat_template_kwargs
    reaches the template (this one reads none: the same answer) unless it names the renderer's own
    variables; the two flags together are 400."""
    client, router, _ = clients
    kw = dict(model="v0", max_tokens=N, temperature=0)
    no_header = BASE_RENDERED.removesuffix(f"{BOS}assistant: ")
    want, _ = await router_text(router, "v0", no_header)
    r = await client.chat.completions.create(messages=CHAT, extra_body={"add_generation_prompt": False}, **kw)
    assert r.choices[0].message.content == want
    turns = [*CHAT, {"role": "assistant", "content": "Hello, I am"}]
    rendered = f"{no_header}{BOS}assistant: Hello, I am"  # the template's "\n" after the content is cut
    want, msgs = await router_text(router, "v0", rendered)
    body = {"add_generation_prompt": False, "continue_final_message": True}
    r = await client.chat.completions.create(messages=turns, extra_body=body, **kw)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == msgs[-1].usage.prompt_tokens
    got, tok = await asyncio.to_thread(
        http, cluster.g, "POST", "/tokenize", json.dumps({"model": "v0", "messages": turns, **body}).encode()
    )
    assert got == 200 and tok["count"] == r.usage.prompt_tokens
    plain = await client.chat.completions.create(messages=CHAT, **kw)
    same = await client.chat.completions.create(messages=CHAT, extra_body={"chat_template_kwargs": {"x": 1}}, **kw)
    assert same.choices[0].message.content == plain.choices[0].message.content
    for extra, param, words in (
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt: false"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
        ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs", "'bos_token'"),
        ({"chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs", "raise_exception"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "object"),
        ({"chat_template_kwargs": {f"v{i}": i for i in range(33)}}, "chat_template_kwargs", "at most 32"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt", "true or false"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(messages=CHAT, extra_body=extra, **kw)
        assert_error_shape(e.value.response.json(), 400, e.value.status_code, param, words)


async def test_chat_template_errors(clients, cluster):
    client, _, _ = clients
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="v0", messages=[{"role": "robot", "content": "hi"}])
    assert_error_shape(e.value.response.json(), 400, e.value.status_code, "messages", "unknown role robot")
    async with oai(cluster.g_plain) as plain:
        with pytest.raises(openai.BadRequestError) as e:
            await plain.chat.completions.create(model="v0", messages=CHAT)
        assert_error_shape(e.value.response.json(), 400, e.value.status_code, "messages", "--chat-template")
        assert e.value.code == "chat_template_missing"
        r = await plain.completions.create(
            model="v0", prompt="still serves completions", max_tokens=2, temperature=0
        )  # greedy: sampling (OpenAI's default 1.0) may draw EOS
        assert r.usage.completion_tokens == 2


async def test_the_real_base_keeps_its_chat_template_and_renders_like_transformers(real_base):
    """`bitdelta family build`'s converted SmolLM2-Instruct carries its template; the gateway's torch-free
    rendering is character for character what transformers' apply_chat_template gives."""
    from transformers import AutoTokenizer

    t = ChatTemplate.load(real_base)
    tok = AutoTokenizer.from_pretrained(str(real_base))
    for msgs in (
        CHAT,
        [{"role": "user", "content": "Écris « bonjour » ✓"}],
        [*CHAT, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}],
    ):
        assert t.render(msgs) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert t.render(msgs, add_generation_prompt=False) == tok.apply_chat_template(msgs, tokenize=False)
    assert "<|im_start|>assistant\n" in t.render(CHAT)
    # vLLM's continue_final_message and chat_template_kwargs, as transformers renders them; a template
    # that trims the content and one that reads a request's variable (Qwen3's enable_thinking)
    reads = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}"
    )
    for source in (t.source, reads):
        mine = ChatTemplate(source, "test", t.specials)
        tok.chat_template = source
        for last in ("The answer is", "The answer is  ", "  spaced  out "):
            msgs = [*CHAT, {"role": "assistant", "content": last}]
            want = tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
            assert mine.render(msgs, add_generation_prompt=False, continue_final_message=True) == want, (source, last)
        for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
            want = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kw)
            assert mine.render(CHAT, template_kwargs=kw) == want, kw
    assert "<think></think>" in ChatTemplate(reads, "test", {}).render(CHAT, template_kwargs={"enable_thinking": False})
    with pytest.raises(ChatTemplateError, match="as it is"):  # a template that drops the content
        ChatTemplate("{% for m in messages %}{{ m['role'] }}{% endfor %}", "t", {}).render(
            CHAT, add_generation_prompt=False, continue_final_message=True
        )


async def test_chat_template_loading(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "tools"},
                    {"name": "default", "template": "{{ eos_token }}!"},
                ],
                "eos_token": {"content": "</s>", "special": True},
            }
        )
    )
    assert ChatTemplate.load(tmp_path).render(CHAT) == "</s>!"  # named templates, AddedToken dicts
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatTemplate.load(tmp_path).render(CHAT) == "J2"  # the .jinja file wins, as in transformers
    sandbox = tmp_path / "sandbox.jinja"
    sandbox.write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="failed"):
        ChatTemplate.load(sandbox).render(CHAT)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.load(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.load(empty)


# -- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,status,param,words",
    [
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model", "unknown model"),
        ("/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "model", "unknown model"),
        ("/v1/completions", {"model": "otherbase", "prompt": "hi"}, 400, None, "compress it again"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "n": 17}, 400, "n", "between 1 and 16"),
        ("/v1/chat/completions", {"model": "v0", "messages": CHAT, "n": 0}, 400, "n", "between 1 and 16"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "temperature": 3}, 400, "temperature", "between 0 and 2"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "top_p": -1}, 400, "top_p", "greater than 0"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
        (
            "/v1/chat/completions",
            {"model": "v0", "messages": CHAT, "response_format": {"type": "json_schema"}},
            400,
            "response_format",
            "json_schema: {name, schema}",
        ),
        ("/v1/chat/completions", {"model": "v0", "messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools", ""),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "not supported"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "messages": CHAT}, 400, "messages", "not supported"),
        (
            "/v1/completions",
            {"model": "v0", "prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}},
            400,
            "stream_options",
            "true or false",
        ),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "max_tokens": 1000}, 400, "max_tokens", "context leaves"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens", "allows"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "stop": ["a"] * 5}, 400, "stop", "at most 4"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "seed": -1}, 400, "seed", "seed"),
        ("/v1/completions", {"model": "v0", "prompt": "hi", "logprobs": 21}, 400, "logprobs", "between 0 and 20"),
        ("/v1/chat/completions", {"model": "v0", "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
        ("/v1/chat/completions", {"model": "v0", "messages": CHAT, "logprobs": 2}, 400, "logprobs", "true or false"),
        ("/v1/completions", {"model": "v0", "prompt": ""}, 400, "prompt", "prompt"),
        ("/v1/completions", {"model": "v0", "prompt": [1, -2, 3]}, 400, "prompt", "token ids"),
        ("/v1/completions", {"model": "v0", "prompt": [[1], ""]}, 400, "prompt", "prompt[1]"),
        ("/v1/completions", {"model": "v0", "prompt": [[]]}, 400, "prompt", "prompt[0]"),
        ("/v1/completions", {"model": "v0", "prompt": [[[1]]]}, 400, "prompt", "prompt[0]"),
        ("/v1/completions", {"model": "v0", "prompt": [True]}, 400, "prompt", "prompt[0]"),
        ("/v1/completions", {"model": "v0", "prompt": ["hi"] * 65}, 400, "prompt", "at most 64"),
        ("/v1/completions", {"model": "v0", "prompt": [10**6]}, 400, "prompt", "not a token of this model"),
        ("/v1/completions", {"model": "v0", "prompt": ["hi", [10**6]]}, 400, "prompt", "not a token of this model"),
        ("/v1/completions", {"model": "v0", "prompt": "x" * 5000}, 400, "prompt", "bytes"),  # the router's limit
        ("/v1/completions", {"prompt": "hi"}, 400, "model", "model"),
        ("/v1/completions", {"model": "../etc/passwd", "prompt": "hi"}, 400, "model", "model_id"),
        ("/v1/chat/completions", {"model": "v0", "messages": []}, 400, "messages", "messages"),
        ("/v1/chat/completions", {"model": "v0", "messages": [{"content": "no role"}]}, 400, "messages", "role"),
        ("/v1/completions", [1, 2], 400, None, "JSON object"),
    ],
)
async def test_bad_requests_get_openai_errors(clients, cluster, path, body, status, param, words):
    got, out = await asyncio.to_thread(http, cluster.g, "POST", path, json.dumps(body).encode())
    assert_error_shape(out, status, got, param, words)
    r = await clients[0].completions.create(model="v0", prompt="still fine", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


VLLM_SAMPLING = {
    "top_k": 12,
    "min_p": 0.02,
    "repetition_penalty": 1.4,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "logit_bias": {"101": 4.0},
    "min_tokens": 3,
    "ignore_eos": True,
}


async def test_vllm_sampling_fields_reach_the_worker(clients):
    """The openai SDK with vLLM's extra fields (extra_body) gets exactly the router's tokens for the
    same Sampling, seeded and greedy, on both endpoints; and the fields change the answer."""
    client, router, _ = clients
    for temperature, seed in ((0.0, None), (0.9, 7)):
        s = Sampling(
            max_new_tokens=N,
            temperature=temperature,
            seed=seed,
            top_k=12,
            min_p=0.02,
            repetition_penalty=1.4,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logit_bias=((101, 4.0),),
            min_tokens=3,
            ignore_eos=True,
        )
        req = rpb.GenerateRequest(model_id="v1", prompt="abc xyz", sampling=s.to_pb())
        want = "".join([t.text async for m in router.generate_request(req) for t in m.tokens])
        r = await client.completions.create(
            model="v1", prompt="abc xyz", max_tokens=N, temperature=temperature, seed=seed, extra_body=VLLM_SAMPLING
        )
        assert r.choices[0].text == want
        plain = await client.completions.create(
            model="v1", prompt="abc xyz", max_tokens=N, temperature=temperature, seed=seed
        )
        assert plain.choices[0].text != want
    chat = await client.chat.completions.create(
        model="v1", messages=CHAT, max_tokens=N, temperature=0, extra_body=VLLM_SAMPLING
    )
    s = Sampling(
        max_new_tokens=N,
        top_k=12,
        min_p=0.02,
        repetition_penalty=1.4,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias=((101, 4.0),),
        min_tokens=3,
        ignore_eos=True,
    )
    req = rpb.GenerateRequest(model_id="v1", prompt=V1_RENDERED, sampling=s.to_pb(), templated=True)
    assert chat.choices[0].message.content == "".join(
        [t.text async for m in router.generate_request(req) for t in m.tokens]
    )


async def test_stop_token_ids_and_include_stop_str(clients):
    """Stop strings and stop tokens end the answer (the string's text only when asked), and vLLM's
    stop_reason names what ended it: the string, the token's id, or null (length), whole and on a
    stream's finish chunk, completions and chat."""
    client, router, _ = clients
    full = await client.completions.create(model="v0", prompt="The quick brown fox", max_tokens=N, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.choices[0].model_extra["stop_reason"] is None
    stop = text[4:6]
    kw = dict(model="v0", prompt="The quick brown fox", max_tokens=N, temperature=0)
    r = await client.completions.create(
        stop=["never-there", stop], extra_body={"include_stop_str_in_output": True}, **kw
    )
    assert r.choices[0].text == text[: text.index(stop) + 2] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    # the family's byte tokenizer: an ASCII character's token id is its byte
    ch = next(c for c in text[1:] if c.isascii())
    r = await client.completions.create(extra_body={"stop_token_ids": [ord(ch)]}, **kw)
    assert r.choices[0].text == text[: text.index(ch)] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == ord(ch)
    chunks = [x async for x in await client.completions.create(stop=stop, stream=True, **kw)]
    ends = [(c.finish_reason, c.model_extra["stop_reason"]) for x in chunks for c in x.choices]
    assert ends[-1] == ("stop", stop) and all(e == (None, None) for e in ends[:-1])
    c = await client.chat.completions.create(model="v0", messages=CHAT, max_tokens=N, temperature=0)
    said = c.choices[0].message.content
    cut = next(x for x in said[1:] if x.isascii() and x.isprintable())
    s = await client.chat.completions.create(model="v0", messages=CHAT, max_tokens=N, temperature=0, stop=cut)
    assert s.choices[0].message.content == said[: said.index(cut)] and s.choices[0].model_extra["stop_reason"] == cut


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"top_k": "x"}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),  # beyond the vocabulary: the worker's check
        ({"min_tokens": 20}, "min_tokens"),  # more than max_tokens
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"priority": 1.5}, "priority"),
        ({"priority": 2**31}, "priority"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
    ],
)
async def test_bad_sampling_fields_are_400_naming_the_field(cluster, extra, param):
    body = {"model": "v0", "prompt": "hi", "max_tokens": 4, **extra}
    got, out = await asyncio.to_thread(http, cluster.g, "POST", "/v1/completions", json.dumps(body).encode())
    assert_error_shape(out, 400, got, param)


def hf_logprobs(base, prompt_ids: list[int], out: list[int]) -> list:
    """log softmax of transformers' raw logits at each generated position (the dense base)."""
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + out])).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1)


async def test_logprobs_equal_transformers_raw_logits_in_openai_shapes(clients, family):
    """Completions (an int) and chat (bool + top_logprobs), whole and streamed: the sampled token's
    logprob and the top alternatives are transformers' log softmax of the raw logits at that
    position, also under a repetition penalty (raw: before penalties)."""
    from tokenizers import Tokenizer

    client, router, _ = clients
    base = (await router.list_models())[0].model_id
    tok = Tokenizer.from_file(str(family.base / "tokenizer.json"))
    prompt = "The quick brown fox"
    ids = tok.encode(prompt).ids
    for extra in ({}, {"repetition_penalty": 1.6}):
        r = await client.completions.create(
            model=base, prompt=prompt, max_tokens=N, temperature=0, logprobs=3, extra_body=extra
        )
        lp = r.choices[0].logprobs
        s = Sampling(max_new_tokens=N, repetition_penalty=extra.get("repetition_penalty", 1.0))
        req = rpb.GenerateRequest(model_id=base, prompt=prompt, sampling=s.to_pb())
        out = [
            t.token_id async for m in router.generate_request(req) for t in m.tokens
        ]  # the ids (the text may not round-trip)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == N
        ref = hf_logprobs(family.base, ids, out)
        for i in range(N):
            assert abs(lp.token_logprobs[i] - float(ref[i, out[i]])) < 1e-3, i
            top = sorted(ref[i].tolist(), reverse=True)[:3] + [float(ref[i, out[i]])]
            # keyed by the token's text: bytes of a multi-byte character all read "\ufffd" alone
            got = lp.top_logprobs[i].values()
            assert all(any(abs(v - t) < 1e-3 for t in top) for v in got) and abs(max(got) - top[0]) < 1e-3, i
            assert lp.tokens[i] in lp.top_logprobs[i], "the sampled token is among completions' top_logprobs"
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        if not extra:
            greedy_lp = lp
    z = await client.completions.create(model=base, prompt=prompt, max_tokens=2, temperature=0, logprobs=0)
    assert len(z.choices[0].logprobs.token_logprobs) == 2 and all(
        len(d) == 1 for d in z.choices[0].logprobs.top_logprobs
    )

    c = await client.chat.completions.create(
        model=base, messages=CHAT, max_tokens=N, temperature=0, logprobs=True, top_logprobs=2
    )
    content = c.choices[0].logprobs.content
    assert len(content) == N and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert all(abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6 for e in content), "greedy: the top one"
    rendered = tok.encode(BASE_RENDERED).ids
    req = rpb.GenerateRequest(
        model_id=base, prompt=BASE_RENDERED, sampling=Sampling(max_new_tokens=N).to_pb(), templated=True
    )
    ref = hf_logprobs(family.base, rendered, [t.token_id async for m in router.generate_request(req) for t in m.tokens])
    for i, e in enumerate(content):
        want = sorted(ref[i].tolist(), reverse=True)[:2]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(want, abs=1e-3), i
    plain = await client.chat.completions.create(model=base, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None

    stream = await client.chat.completions.create(
        model=base, messages=CHAT, max_tokens=N, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [
        e
        for ch in [x async for x in stream]
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]  # logprobs: see the prefix cache below
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    stream = await client.completions.create(
        model=base, prompt=prompt, max_tokens=N, temperature=0, logprobs=3, stream=True
    )
    chunks = [x async for x in stream]
    toks = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs]
    # the same request again: its prompt's KV comes from the prefix cache, so its logits are computed
    # over other shapes than the first time's and may differ in the last bits (tokens do not)
    assert toks == pytest.approx(greedy_lp.token_logprobs, abs=1e-5)


async def test_echo_returns_the_prompt_and_its_logprobs_from_transformers_raw_logits(clients, family):
    """echo on completions: the prompt before each choice's text; with logprobs, the prompt's tokens
    first (the first one's logprob and alternatives null), each the log softmax of transformers'
    raw logits at the position before it, then the generated tokens' as without echo; streamed, the
    first chunk of each choice is the prompt with the same logprobs."""
    from tokenizers import Tokenizer

    client, router, _ = clients
    base = (await router.list_models())[0].model_id
    tok = Tokenizer.from_file(str(family.base / "tokenizer.json"))
    prompt = "Echo this prompt back"
    ids = tok.encode(prompt).ids
    P = len(ids)
    kw = dict(model=base, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    plain = await client.completions.create(**kw)
    r = await client.completions.create(echo=True, n=2, **kw)
    assert [c.text for c in r.choices] == [prompt + plain.choices[0].text] * 2
    lp = r.choices[1].logprobs
    assert len(lp.tokens) == P + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[P:] == plain.choices[0].logprobs.tokens
    # the head's GEMM over more rows (the prompt's too) may round differently in the last bits
    assert lp.token_logprobs[P:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[P] == sum(len(t) for t in lp.tokens[:P])
    ref = hf_logprobs(family.base, ids[:1], ids[1:])  # [P - 1, vocab]: each prompt token's position
    for j in range(1, P):
        assert abs(lp.token_logprobs[j] - float(ref[j - 1, ids[j]])) < 1e-3, j
        top = sorted(ref[j - 1].tolist(), reverse=True)[:2] + [float(ref[j - 1, ids[j]])]
        # keyed by text: alternatives that decode alike (bytes of one character) keep one value
        assert all(any(abs(v - t) < 1e-3 for t in top) for v in lp.top_logprobs[j].values()), j
    only = await client.completions.create(model=base, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert only.choices[0].text == r.choices[0].text and only.choices[0].logprobs is None

    stream = await client.completions.create(echo=True, stream=True, **kw)
    chunks = [x async for x in stream]
    head = chunks[0].choices[0]
    assert head.text == prompt and head.logprobs.token_logprobs[0] is None
    assert head.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:P], abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    toks = [
        t for ch in chunks[1:] if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs
    ]
    assert toks == pytest.approx(lp.token_logprobs[P:], abs=1e-5)


async def test_prompt_logprobs_are_vllms_with_transformers_values_and_ranks(clients, family):
    """vLLM's `prompt_logprobs`: per prompt token (null for the first) {id: {logprob, rank,
    decoded_token}}, the prompt's token first with its rank in the vocabulary, then the k most likely
    (ranks 1..k), each transformers' log softmax of the raw logits; on every choice of each prompt of
    a completions batch, on the chat response itself; echo's own alternatives stay `logprobs` many;
    a variant's are its own; with stream, or out of range, 400 naming the field."""
    import openai
    from tokenizers import Tokenizer

    client, router, _ = clients
    base = (await router.list_models())[0].model_id
    tok = Tokenizer.from_file(str(family.base / "tokenizer.json"))
    texts = ["The quick brown fox", "abc xyz"]
    ids = [tok.encode(t).ids for t in texts]
    K = 3
    r = await client.completions.create(
        model=base, prompt=[texts[0], ids[1]], max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": K}
    )
    assert len(r.choices) == 4 and r.choices[0].logprobs is None
    for k, p in enumerate(ids):
        plps = [r.choices[2 * k + i].model_extra["prompt_logprobs"] for i in range(2)]
        assert plps[0] == plps[1], "every choice of a prompt carries its prompt's"
        plp = plps[0]
        assert len(plp) == len(p) and plp[0] is None
        ref = hf_logprobs(family.base, p[:1], p[1:])  # [P - 1, vocab]
        for j in range(1, len(p)):
            got, want = plp[j], ref[j - 1]
            own = got[str(p[j])]
            v = float(want[p[j]])
            assert abs(own["logprob"] - v) < 1e-3, (k, j)
            # ties within the two paths' rounding may fall either way
            assert int((want > v + 1e-4).sum()) + 1 <= own["rank"] <= int((want >= v - 1e-4).sum()), (k, j)
            assert own["decoded_token"] == tok.decode([p[j]], skip_special_tokens=False)
            top_v, top_i = want.topk(K)
            alts = [(int(t), e) for t, e in got.items() if e["rank"] <= K and (int(t) != p[j] or own["rank"] <= K)]
            assert sorted(e["rank"] for _, e in alts) == list(range(1, K + 1)), (k, j, got)
            assert [e["logprob"] for _, e in sorted(alts, key=lambda a: a[1]["rank"])] == pytest.approx(
                top_v.tolist(), abs=1e-3
            )
            assert len(got) == K + (own["rank"] > K)
            assert list(got)[0] == str(p[j]), "the prompt's token first"

    # echo with logprobs 1 and prompt_logprobs 3: echo keeps its 1 alternative (+ the token itself)
    e = await client.completions.create(
        model=base,
        prompt=texts[0],
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": K},
    )
    lp = e.choices[0].logprobs
    assert lp.top_logprobs[0] is None and all(1 <= len(d) <= 2 for d in lp.top_logprobs[1:])
    plp = e.choices[0].model_extra["prompt_logprobs"]
    assert [lp.token_logprobs[j] for j in range(1, len(ids[0]))] == pytest.approx(
        [plp[j][str(ids[0][j])]["logprob"] for j in range(1, len(ids[0]))], abs=1e-6
    )

    v = await client.completions.create(
        model="v1", prompt=texts[0], max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    vp = v.choices[0].model_extra["prompt_logprobs"]
    assert all(len(d) == 1 for d in vp[1:])
    base_p = r.choices[0].model_extra["prompt_logprobs"]
    assert any(
        abs(vp[j][str(ids[0][j])]["logprob"] - base_p[j][str(ids[0][j])]["logprob"]) > 1e-3
        for j in range(1, len(ids[0]))
    )

    c = await client.chat.completions.create(
        model=base, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    rendered = tok.encode(BASE_RENDERED, add_special_tokens=False).ids
    cp = c.model_extra["prompt_logprobs"]
    assert len(cp) == len(rendered) == c.usage.prompt_tokens and cp[0] is None
    assert all(str(t) in d for t, d in zip(rendered[1:], cp[1:]))
    plain = await client.chat.completions.create(model=base, messages=CHAT, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.model_extra or {})

    for bad, extra in (
        ({"stream": True}, {"prompt_logprobs": 0}),
        ({}, {"prompt_logprobs": 21}),
        ({}, {"prompt_logprobs": -1}),
        ({}, {"prompt_logprobs": "2"}),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model=base, prompt="x", max_tokens=1, extra_body=extra, **bad)
        assert err.value.body["param"] == "prompt_logprobs", (bad, extra)


async def test_return_token_ids_gives_the_prompt_and_choice_ids_as_run(clients, cluster, family):
    """vLLM's return_token_ids: each choice's token ids (every token it generated, the ones of the
    router's stream) and the prompt's as the worker ran it (BOS, truncation: completions on each
    choice, chat on the response), whole and streamed (each chunk its tokens', the first of each
    choice, or of a chat stream, the prompt's)."""
    from tokenizers import Tokenizer

    client, router, _ = clients
    tok = Tokenizer.from_file(str(family.base / "tokenizer.json"))
    texts = ["The quick brown fox", "abc xyz"]
    ids = [tok.encode(t).ids for t in texts]
    kw = dict(model="v1", max_tokens=N, temperature=0.8, seed=3, n=2, extra_body={"return_token_ids": True})
    r = await client.completions.create(prompt=[texts[0], ids[1]], **kw)
    for i, c in enumerate(r.choices):
        extra = c.model_extra
        assert extra["prompt_token_ids"] == ids[i // 2]
        assert tok.decode(extra["token_ids"]) == c.text and 1 <= len(extra["token_ids"]) <= N
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    _, want = await router_text(router, "v1", texts[0], temperature=0.8, seed=3)
    assert r.choices[0].model_extra["token_ids"] == [t.token_id for t in want]

    stream = await client.completions.create(prompt=[texts[0], ids[1]], stream=True, **kw)
    got: dict[int, list[int]] = {}
    prompts: dict[int, list] = {}
    async for ch in stream:
        for c in ch.choices:
            got.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            if "prompt_token_ids" in c.model_extra:
                prompts.setdefault(c.index, []).append(c.model_extra["prompt_token_ids"])
    assert got == {i: c.model_extra["token_ids"] for i, c in enumerate(r.choices)}
    assert prompts == {i: [ids[i // 2]] for i in range(4)}, "once per choice, on its first chunk"

    cut = await client.completions.create(
        model="v0", prompt=texts[0], max_tokens=2, extra_body={"return_token_ids": True, "truncate_prompt_tokens": 3}
    )
    assert cut.choices[0].model_extra["prompt_token_ids"] == ids[0][-3:]
    plain = await client.completions.create(model="v0", prompt=texts[0], max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra

    ckw = dict(model="v1", messages=CHAT, max_tokens=N, temperature=0, extra_body={"return_token_ids": True})
    c = await client.chat.completions.create(**ckw)
    _, rendered = await asyncio.to_thread(
        http, cluster.g, "POST", "/tokenize", json.dumps({"model": "v1", "messages": CHAT}).encode()
    )
    assert c.model_extra["prompt_token_ids"] == rendered["tokens"]
    assert tok.decode(c.choices[0].model_extra["token_ids"]) == c.choices[0].message.content
    chunks = [x async for x in await client.chat.completions.create(stream=True, **ckw)]
    assert chunks[0].model_extra["prompt_token_ids"] == rendered["tokens"]
    assert all("prompt_token_ids" not in x.model_extra for x in chunks[1:])
    streamed = [t for x in chunks for ch in x.choices for t in ch.model_extra["token_ids"]]
    assert streamed == c.choices[0].model_extra["token_ids"]


async def test_token_id_prompts_and_batched_prompts_answer_as_single_requests(clients, cluster, family):
    """`prompt` as token ids (vLLM's token prompts: used as they are) answers as the same prompt as
    text; a list of prompts (text and ids mixed) answers as one request each, prompt k's choice i at
    index k·n + i (vLLM's order), whole and streamed, the usage summed; and the shape
    lm-evaluation-harness's local-completions sends for log-likelihoods (a batch of token-id prompts,
    echo, logprobs 1, max_tokens 1) gives each prompt's own tokens and log-probabilities."""
    from tokenizers import Tokenizer

    client, _, _ = clients
    tok = Tokenizer.from_file(str(family.base / "tokenizer.json"))
    texts = ["The quick brown fox", "abc xyz", "Hello world"]
    ids = [tok.encode(t).ids for t in texts]
    kw = dict(model="v1", max_tokens=N, temperature=0.8, seed=4, n=2)
    singles = [await client.completions.create(prompt=t, **kw) for t in texts]
    by_ids = await client.completions.create(prompt=ids[0], **kw)
    assert [c.text for c in by_ids.choices] == [c.text for c in singles[0].choices]
    assert by_ids.usage.prompt_tokens == len(ids[0]) == singles[0].usage.prompt_tokens

    batch = [texts[0], ids[1], texts[2]]  # text and ids mixed
    r = await client.completions.create(prompt=batch, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [c.text for s in singles for c in s.choices]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids) and r.usage.completion_tokens == 6 * N

    stream = await client.completions.create(prompt=batch, stream=True, stream_options={"include_usage": True}, **kw)
    parts, finishes, usage = [""] * 6, {}, None
    async for ch in stream:
        usage = ch.usage or usage
        for c in ch.choices:
            parts[c.index] += c.text
            if c.finish_reason is not None:
                assert c.index not in finishes, "one finish per choice"
                finishes[c.index] = c.finish_reason
    assert parts == [c.text for c in r.choices] and sorted(finishes) == list(range(6))
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)

    # lm-evaluation-harness's log-likelihood request, against the text prompts' echo one at a time
    ll = await client.completions.create(model="v0", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert [c.index for c in ll.choices] == [0, 1, 2]
    for k, c in enumerate(ll.choices):
        one = await client.completions.create(
            model="v0", prompt=texts[k], max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        assert c.text == one.choices[0].text and c.text.startswith(texts[k])
        lp, want = c.logprobs, one.choices[0].logprobs
        assert len(lp.tokens) == len(ids[k]) + 1 and lp.tokens == want.tokens
        assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(
            want.token_logprobs[1:], abs=1e-5
        )

    # echo writes a token-id prompt's text: a gateway without a tokenizer cannot
    got, err = await asyncio.to_thread(
        http,
        cluster.g_plain,
        "POST",
        "/v1/completions",
        json.dumps({"model": "v0", "prompt": ids[0], "echo": True, "max_tokens": 1}).encode(),
    )
    assert_error_shape(err, 400, got, "echo", "--tokenizer")
    plain = await oai(cluster.g_plain).completions.create(model="v0", prompt=ids, max_tokens=N, temperature=0)
    assert [c.text for c in plain.choices] == [
        (await client.completions.create(model="v0", prompt=t, max_tokens=N, temperature=0)).choices[0].text
        for t in texts
    ]


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(clients, cluster, family):
    """vLLM's truncate_prompt_tokens: a prompt longer than the context (400 without it) runs as its
    last k tokens, the answer of those tokens given as the prompt; -1 keeps as many as the context
    leaves for max_tokens; chat truncates the rendered prompt; 0, -2 and echo with it are 400."""
    from tokenizers import Tokenizer

    client, _, _ = clients
    long = "The quick brown fox jumps over the lazy dog. " * 8  # more tokens than the 256 of the context
    ids = Tokenizer.from_file(str(family.base / "tokenizer.json")).encode(long).ids
    assert len(ids) > 256
    kw = dict(model="v1", max_tokens=N, temperature=0)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(prompt=long, **kw)
    cut = await client.completions.create(prompt=long, extra_body={"truncate_prompt_tokens": 50}, **kw)
    want = await client.completions.create(prompt=ids[-50:], **kw)
    assert cut.choices[0].text == want.choices[0].text and cut.usage.prompt_tokens == 50
    fit = await client.completions.create(prompt=long, extra_body={"truncate_prompt_tokens": -1}, **kw)
    assert fit.usage.prompt_tokens == 256 - N and fit.usage.completion_tokens == N
    chat = await client.chat.completions.create(
        messages=[{"role": "user", "content": long}], extra_body={"truncate_prompt_tokens": 40}, **kw
    )
    assert chat.usage.prompt_tokens == 40
    for extra, param in (
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 5, "echo": True}, "echo"),
    ):
        got, err = await asyncio.to_thread(
            http, cluster.g, "POST", "/v1/completions", json.dumps({"prompt": "hi", **kw, **extra}).encode()
        )
        assert_error_shape(err, 400, got, param)


async def test_allowed_token_ids_bound_the_picks(clients, cluster):
    """vLLM's allowed_token_ids: every token picked is one of them (read back as ids with
    return_tokens_as_token_ids); empty, past the vocabulary, or with a constraint: 400."""
    client, _, _ = clients
    allowed = [66, 101, 115, 116]
    r = await client.completions.create(
        model="v1",
        prompt="abc xyz",
        max_tokens=N,
        temperature=1.0,
        seed=9,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True},
    )
    picked = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert len(picked) == N and set(picked) <= set(allowed) and len(set(picked)) > 1
    for extra, param in (
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": [66], "response_format": {"type": "json_object"}}, "allowed_token_ids"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="v0", messages=CHAT, max_tokens=2, extra_body=extra)
        assert_error_shape(e.value.response.json(), 400, e.value.status_code, param)


async def test_bad_words_reach_the_worker(clients):
    client, _, _ = clients
    kw = dict(model="v0", prompt="The quick brown fox", max_tokens=N, temperature=0)
    plain = (await client.completions.create(**kw)).choices[0].text
    word = next(ch for ch in plain if ch.strip())
    banned = (await client.completions.create(extra_body={"bad_words": [word]}, **kw)).choices[0].text
    assert word in plain and word not in banned
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(extra_body={"bad_words": [" "]}, **kw)
    assert_error_shape(e.value.response.json(), 400, e.value.status_code, "bad_words")


async def test_skip_special_tokens_reaches_the_worker(clients):
    client, _, _ = clients
    kw = dict(model="v0", prompt="hi", max_tokens=2, temperature=0, logit_bias={"257": 100})
    assert (await client.completions.create(**kw)).choices[0].text == ""
    kept = await client.completions.create(extra_body={"skip_special_tokens": False}, **kw)
    assert kept.choices[0].text == "<|im_start|>" * 2


async def test_tokens_as_token_ids_name_the_routers_tokens(clients, family):
    """vLLM's return_tokens_as_token_ids: the same logprobs with each token (sampled, alternatives,
    echo's prompt tokens) named "token_id:N" by the id the router streamed; chat's bytes are those of
    that name."""
    from tokenizers import Tokenizer

    client, router, _ = clients
    prompt = "The quick brown fox"
    _, toks = await router_text(router, "v0", prompt)
    kw = dict(model="v0", prompt=prompt, max_tokens=N, temperature=0, logprobs=2)
    plain = (await client.completions.create(**kw)).choices[0].logprobs
    named = await client.completions.create(echo=True, extra_body={"return_tokens_as_token_ids": True}, **kw)
    lp = named.choices[0].logprobs
    ids = Tokenizer.from_file(str(family.base / "tokenizer.json")).encode(prompt).ids
    assert lp.tokens == [f"token_id:{i}" for i in [*ids, *(t.token_id for t in toks)]]
    P = len(ids)
    assert lp.token_logprobs[P:] == pytest.approx(plain.token_logprobs, abs=1e-5)
    for top, name in zip(lp.top_logprobs[P:], lp.tokens[P:]):
        assert name in top and len(top) >= 2 and all(k.startswith("token_id:") for k in top)
    assert named.choices[0].text.startswith(prompt)
    chat = await client.chat.completions.create(
        model="v0",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    for c in chat.choices[0].logprobs.content:
        assert c.token.startswith("token_id:") and c.bytes == list(c.token.encode())
        assert all(t.token.startswith("token_id:") for t in c.top_logprobs)


async def test_the_gateways_own_metrics_bound_the_model_label(clients, cluster):
    """/metrics counts requests by route, model and status; a made-up model id is "other", so
    unknown ids cannot grow the series."""
    client, _, _ = clients
    await client.completions.create(model="v0", prompt="count me", max_tokens=2, temperature=0)
    for name in ("made-up-1", "made-up-2"):
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model=name, prompt="hi", max_tokens=2)
    got, text = await asyncio.to_thread(http, cluster.g, "GET", "/metrics")
    assert got == 200 and isinstance(text, str)
    assert 'bitdelta_gateway_requests_total{model="v0",route="/v1/completions",status="200"}' in text
    assert 'bitdelta_gateway_requests_total{model="other",route="/v1/completions",status="404"}' in text
    assert 'bitdelta_gateway_errors_total{model="other",route="/v1/completions"}' in text
    assert "made-up" not in text
    assert 'bitdelta_gateway_request_seconds_count{model="v0",route="/v1/completions"}' in text


async def test_a_models_card_names_its_base_and_size(clients, cluster, family):
    client, router, _ = clients
    listed = {m.model_id: m for m in await router.list_models()}
    card = await client.models.retrieve("v0")
    base = next(m for m in listed.values() if m.is_base)
    assert card.parent == base.model_id and card.base_model == listed["v0"].base_model
    assert card.delta_bytes == listed["v0"].delta_bytes > 0
    assert (await client.models.retrieve(base.model_id)).delta_bytes == 0
    # vLLM's max_model_len: the base's context (its config.json, through --tokenizer), the worker's own
    config = json.loads((family.base / "config.json").read_text())
    assert card.max_model_len == config["max_position_embeddings"] == 256
    plain = oai(cluster.g_plain)  # no --tokenizer: the gateway does not know it, and says nothing
    try:
        assert getattr(await plain.models.retrieve("v0"), "max_model_len", None) is None
    finally:
        await plain.close()


async def test_tokenize_and_detokenize_in_vllms_shapes(clients, cluster, family):
    """/tokenize gives the ids the worker counts as the prompt (a prompt, or messages through the
    chat template), with return_token_strs each id's token; /detokenize gives the text back; a field
    /tokenize does not read is 400 naming it."""
    from tokenizers import Tokenizer

    client, _, _ = clients
    prompt = "The quick brown fox"
    got, out = await asyncio.to_thread(
        http, cluster.g, "POST", "/tokenize", json.dumps({"model": "v0", "prompt": prompt}).encode()
    )
    assert got == 200 and set(out) == {"count", "max_model_len", "tokens", "token_strs"}, out
    assert out["token_strs"] is None
    got, named = await asyncio.to_thread(
        http,
        cluster.g,
        "POST",
        "/tokenize",
        json.dumps({"model": "v0", "prompt": prompt, "return_token_strs": True}).encode(),
    )
    vocab = Tokenizer.from_file(str(family.base / "tokenizer.json"))
    assert got == 200 and named["tokens"] == out["tokens"]
    assert named["token_strs"] == [vocab.id_to_token(i) for i in out["tokens"]] and len(named["token_strs"]) > 1
    r = await client.completions.create(model="v0", prompt=prompt, max_tokens=1, temperature=0)
    assert out["count"] == len(out["tokens"]) == r.usage.prompt_tokens and out["max_model_len"] == 256
    got, back = await asyncio.to_thread(
        http, cluster.g, "POST", "/detokenize", json.dumps({"model": "v0", "tokens": out["tokens"]}).encode()
    )
    assert got == 200 and back == {"prompt": prompt}
    got, chat = await asyncio.to_thread(
        http, cluster.g, "POST", "/tokenize", json.dumps({"model": "v1", "messages": CHAT}).encode()
    )
    c = await client.chat.completions.create(model="v1", messages=CHAT, max_tokens=1, temperature=0)
    assert got == 200 and chat["count"] == c.usage.prompt_tokens == len(V1_RENDERED.encode())
    for path, body, status, param in (
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "v0", "tokens": [10**6]}, 400, "tokens"),
        ("/tokenize", {"model": "v0", "prompt": 5}, 400, "prompt"),
        ("/tokenize", {"model": "v0", "prompt": "x", "messages_": []}, 400, "messages_"),
        ("/tokenize", {"model": "v0", "prompt": "x", "tools": []}, 400, "tools"),
        ("/tokenize", {"model": "v0", "messages": CHAT, "documents": []}, 400, "documents"),
        ("/tokenize", {"model": "v0", "prompt": "x", "return_token_strs": 1}, 400, "return_token_strs"),
    ):
        got, err = await asyncio.to_thread(http, cluster.g, "POST", path, json.dumps(body).encode())
        assert_error_shape(err, status, got, param)
    got, err = await asyncio.to_thread(
        http, cluster.g_plain, "POST", "/tokenize", json.dumps({"model": "v0", "prompt": "x"}).encode()
    )
    assert got == 400 and err["error"]["code"] == "tokenizer_missing"


async def test_priority_and_cache_salt_are_parsed_for_the_router():
    from services.gateway.protocol import parse_chat, parse_completion

    assert parse_completion({"model": "v0", "prompt": "x", "priority": -4}, 8).priority == -4
    assert parse_chat({"model": "v0", "messages": [{"role": "user", "content": "x"}], "priority": 9}).priority == 9
    assert parse_completion({"model": "v0", "prompt": "x"}, 8).priority == 0
    assert parse_completion({"model": "v0", "prompt": "x", "cache_salt": "tenant-a"}, 8).cache_salt == "tenant-a"


async def test_harmless_fields_are_ignored_and_off_values_pass(clients):
    client, router, _ = clients
    want, _ = await router_text(router, "v0", "The quick brown fox")
    extra = {
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "n": 1,
        "echo": False,
        "suffix": None,  # null: as if absent
        "best_of": 1,
        "response_format": {"type": "text"},
        "spaces_between_special_tokens": False,  # a tokenizer.json decodes alike either way
    }
    r = await client.completions.create(
        model="v0", prompt="The quick brown fox", max_tokens=N, temperature=0, extra_body=extra
    )
    assert r.choices[0].text == want


async def test_public_errors_name_no_internal_address(cluster):
    """A prompt + max_tokens beyond the model's context (the worker's refusal) is 400 naming both
    numbers; nothing in it names the worker or any address of the deployment."""
    body = {"model": "v0", "prompt": "abc", "max_tokens": 1000, "temperature": 0}
    got, out = await asyncio.to_thread(http, cluster.g, "POST", "/v1/completions", json.dumps(body).encode())
    assert_error_shape(out, 400, got, "max_tokens", "1000")
    msg = out["error"]["message"]
    assert "prompt's 3 tokens" in msg and "253 of 256" in msg, msg
    assert "127.0.0.1" not in msg and cluster.w.address not in msg and "worker" not in msg, msg


async def test_a_deeply_nested_body_is_400(cluster):
    deep = b'{"model": "v0", "prompt": "hi", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    got, out = await asyncio.to_thread(http, cluster.g, "POST", "/v1/completions", deep)
    assert_error_shape(out, 400, got, None, "nested too deeply")
    assert out["error"]["code"] == "invalid_json"


async def test_the_docs_field_table_is_the_allowlist():
    """docs/gateway.md's table of request fields is `services.gateway.fields.table()` verbatim
    (regenerate: `python -m services.gateway.fields`)."""
    from services.gateway import fields

    doc = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    begin, end = "<!-- fields: begin -->\n", "<!-- fields: end -->"
    assert begin in doc and end in doc
    assert doc.split(begin, 1)[1].split(end, 1)[0] == fields.table()
    assert {"user", "metadata", "store", "service_tier"} <= {
        f.name for f in fields.FIELDS if f.use("chat") is fields.Use.IGNORED
    }


async def test_malformed_json_and_unknown_routes(cluster):
    got, out = await asyncio.to_thread(http, cluster.g, "POST", "/v1/completions", b'{"model": "v0", "prompt": ')
    assert_error_shape(out, 400, got, None, "not valid JSON")
    assert out["error"]["code"] == "invalid_json"
    got, out = await asyncio.to_thread(http, cluster.g, "GET", "/v1/engines")
    assert_error_shape(out, 404, got, None, "/v1/engines")
    got, out = await asyncio.to_thread(http, cluster.g, "GET", "/v1/completions")
    assert_error_shape(out, 405, got, None, "")


async def test_openai_client_errors_carry_the_shape(clients):
    client, _, _ = clients
    with pytest.raises(openai.NotFoundError) as e:
        await client.completions.create(model="nope", prompt="hi")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="v0", prompt="hi", temperature=-0.5)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):  # streaming: the error comes before any event
        await client.completions.create(model="nope", prompt="hi", stream=True)


async def test_router_down_is_503(cluster):
    async with oai(cluster.g_dead) as dead:
        for call in (
            dead.models.list(),
            dead.completions.create(model="v0", prompt="hi"),
            dead.chat.completions.create(model="v0", messages=CHAT),
        ):  # no template: 400 comes first
            with pytest.raises(openai.APIStatusError) as e:
                await call
            if e.value.status_code == 400:
                assert e.value.code == "chat_template_missing"
                continue
            assert e.value.status_code == 503, e.value
            assert_error_shape(e.value.response.json(), 503, e.value.status_code)
            msg = e.value.response.json()["error"]["message"]  # gRPC's "ipv4:127.0.0.1:PORT: Connection refused"
            assert "127.0.0.1" not in msg and "refused" in msg.lower(), msg
    got, out = await asyncio.to_thread(http, cluster.g_dead, "GET", "/ready")
    assert got == 503 and out["status"] == "router unavailable"
    assert "127.0.0.1" not in out["detail"], out
    got, out = await asyncio.to_thread(http, cluster.g, "GET", "/ready")
    assert got == 200


async def test_full_queue_is_429_and_deadline_is_504(clients, cluster):
    """A second router with one request per worker and no queue; the store stopped (SIGSTOP) so a
    cold variant's load holds the worker's one slot: the next request is refused at once (429). A
    gateway with a 1 s deadline per generation gets 504 for a request stuck on that load."""
    _, _, worker = clients
    small = cluster.router(
        [cluster.w.address],
        cluster.st.address,
        name="router-small",
        extra=("--max-in-flight-per-worker", "1", "--max-queue", "0"),
    )
    cluster.wait_serving(small)
    g_small = cluster.gateway(small.address, name="gateway-small")
    async with (
        RouterClient(small.address, generate_timeout_s=T) as rs,
        oai(g_small) as client,
        oai(cluster.g_short) as short,
    ):
        while not all(w.up for w in await rs.list_workers()):
            await asyncio.sleep(0.1)
        await worker.evict_delta("v1")
        cluster.st.popen.send_signal(signal.SIGSTOP)
        try:
            hold = asyncio.create_task(router_text(rs, "v1", "hold the worker", n=2))
            deadline = time.monotonic() + 60
            while (await rs.list_workers())[0].in_flight != 1:
                assert time.monotonic() < deadline and not hold.done(), "the first request never took the slot"
                await asyncio.sleep(0.05)
            with pytest.raises(openai.RateLimitError) as e:
                await client.completions.create(model="v0", prompt="one too many", max_tokens=2)
            assert_error_shape(e.value.response.json(), 429, e.value.status_code, None, "queue")
            t = time.monotonic()
            with pytest.raises(openai.APIStatusError) as e:
                await short.completions.create(model="v1", prompt="stuck behind the load", max_tokens=2)
            assert e.value.status_code == 504 and e.value.code == "deadline_exceeded", e.value
            assert_error_shape(e.value.response.json(), 504, e.value.status_code)
            assert time.monotonic() - t < 30
            assert not hold.done()
        finally:
            cluster.st.popen.send_signal(signal.SIGCONT)
        assert len((await hold)[1]) == 2
    g_small.stop()
    small.stop()


# -- Authorization -----------------------------------------------------------------------------------------


async def test_authorization_is_forwarded_to_the_router(cluster, tmp_path):
    """A router that checks bearer tokens (--tokens-file): the gateway forwards the HTTP Authorization
    header as the gRPC `authorization` metadata, so the router's answers follow the token."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"sk-alice": {"name": "alice", "variants": ["v0"]}}))
    ra = cluster.router(
        [cluster.w.address], cluster.st.address, name="router-auth", extra=("--tokens-file", str(tokens))
    )
    cluster.wait_serving(ra)
    ga = await asyncio.to_thread(cluster.gateway, ra.address, name="gateway-auth")
    try:
        async with (
            oai(ga, api_key="sk-alice") as alice,
            oai(ga, api_key="sk-mallory") as mallory,
            RouterClient(ra.address, generate_timeout_s=T, token="sk-alice") as direct,
        ):
            deadline = time.monotonic() + 60
            while not any(m.model_id == "v0" and m.servable for m in await direct.list_models()):
                assert time.monotonic() < deadline, "the router never saw its worker up"
                await asyncio.sleep(0.1)
            want, _ = await router_text(direct, "v0", "The quick brown fox")
            r = await alice.completions.create(model="v0", prompt="The quick brown fox", max_tokens=N, temperature=0)
            assert r.choices[0].text == want
            assert [m.id for m in (await alice.models.list()).data] == ["v0"], "ListModels follows the token"
            with pytest.raises(openai.PermissionDeniedError) as e:
                await alice.completions.create(model="v1", prompt="hi", max_tokens=2)
            assert_error_shape(e.value.response.json(), 403, e.value.status_code)
            with pytest.raises(openai.AuthenticationError) as e:
                await mallory.completions.create(model="v0", prompt="hi", max_tokens=2)
            assert_error_shape(e.value.response.json(), 401, e.value.status_code, None, "not valid")
        got, out = await asyncio.to_thread(
            http, ga, "POST", "/v1/completions", json.dumps({"model": "v0", "prompt": "hi"}).encode()
        )
        assert_error_shape(out, 401, got, None, "bearer token")
        got, _ = await asyncio.to_thread(http, ga, "GET", "/ready")
        assert got == 200, "a router that refuses a token-less probe is up"
    finally:
        ga.stop()
        ra.stop()


# -- disconnects -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["x", ["x", [100, 101, 102]]], ids=["one", "batched"])
async def test_a_client_that_disconnects_mid_stream_frees_the_sequence(clients, cluster, prompt):
    """Read the first streamed token, freeze the worker (SIGSTOP: the generation cannot finish on its
    own), hang up. The router must drop the request (its in_flight goes to 0 while the worker is still
    frozen: only a cancellation from the gateway can do that); once the worker runs again it frees the
    sequence (Status: running == 0, kv_tokens_used == 0). Batched: every prompt's call is dropped."""
    _, router, worker = clients
    base = "v0"  # a variant: ListModels lists it (with in_flight) even while its only worker is frozen
    host, port = cluster.g.address.rsplit(":", 1)
    # sampled: a step at a time (greedy decode bursts could end the generation before the SIGSTOP)
    body = json.dumps(
        {"model": base, "prompt": prompt, "max_tokens": 200, "temperature": 0.7, "seed": 1, "stream": True}
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=T)
    frozen = False
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        while b"data: {" not in got:
            got += await asyncio.to_thread(sock.recv, 65536)
        cluster.w.popen.send_signal(signal.SIGSTOP)
        frozen = True
        assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
        sock.settimeout(0.3)
        try:
            while chunk := await asyncio.to_thread(sock.recv, 65536):
                got += chunk
        except TimeoutError:
            pass
        assert b"[DONE]" not in got, "the generation finished before the worker was frozen: make it longer"
        models = {m.model_id: m for m in await router.list_models()}
        assert models[base].in_flight == (1 if isinstance(prompt, str) else len(prompt))
    finally:
        sock.close()
    try:
        deadline = time.monotonic() + 30
        while {m.model_id: m for m in await router.list_models()}[base].in_flight:
            assert time.monotonic() < deadline, "the router kept the request after the client hung up"
            await asyncio.sleep(0.05)
    finally:
        if frozen:
            cluster.w.popen.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:
        st = await worker.status()
        if st.running == 0 and st.waiting == 0 and st.kv_tokens_used == 0:
            break
        assert time.monotonic() < deadline, f"the worker kept the sequence: {st}"
        await asyncio.sleep(0.05)
    assert "client disconnected" in cluster.g.log_text()
    assert "Traceback" not in cluster.g.log_text(), "a cancelled generation must end without an error"
    deadline = time.monotonic() + 30
    while not all(w.up for w in await router.list_workers()):  # it may have been marked down while frozen
        assert time.monotonic() < deadline, "the router never saw the worker up again"
        await asyncio.sleep(0.1)
    r = await clients[0].completions.create(model=base, prompt="after", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


# -- reasoning parser (vLLM's --reasoning-parser) ----------------------------------------------------------


async def _chat_both(client, **kw) -> tuple[object, list]:
    """The whole answer and the streamed chunks of one greedy chat request."""
    whole = await client.chat.completions.create(model="base", messages=CHAT, temperature=0, **kw)
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="base", messages=CHAT, temperature=0, stream=True, **kw
        )
    ]
    return whole, chunks


def _joined(chunks, field: str) -> str | None:
    parts = [getattr(c.choices[0].delta, field, None) for c in chunks if c.choices]
    parts = [p for p in parts if p]
    return "".join(parts) if parts else None


async def test_reasoning_parser_answers_the_thinking_apart_as_vllm(clients, cluster):
    """qwen3's parser: a thinking that is never closed (a random model writes no </think>) is all
    reasoning, content null; a closed one (the output forced by a regex with thinking off, where the
    model opens the thinking itself) splits at </think>; whole and streamed agree; include_reasoning
    false leaves it out; a grammar while thinking binds only after it (the thinking is the free
    text's: tests/gpu_worker/test_worker_constraints.py shows the binding). The router's text is the
    reference."""
    _, router, _ = clients
    client = oai(cluster.g_think)
    try:
        req = rpb.GenerateRequest(
            model_id="", prompt=BASE_RENDERED, sampling=Sampling(max_new_tokens=N).to_pb(), templated=True
        )
        want = "".join([t.text async for m in router.generate_request(req) for t in m.tokens])
        whole, chunks = await _chat_both(client, max_tokens=N)
        m = whole.choices[0].message
        assert (m.reasoning, m.reasoning_content, m.content) == (want, want, None)
        assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == (want, None)
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"

        off = {"chat_template_kwargs": {"enable_thinking": False}}
        forced = {**off, "guided_regex": "<think>[a-z]{3}</think>[a-z]{4}"}
        whole, chunks = await _chat_both(client, max_tokens=40, extra_body=forced)
        m = whole.choices[0].message
        assert len(m.reasoning) == 3 and len(m.content) == 4 and (m.reasoning + m.content).isalpha(), m
        assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == (m.reasoning, m.content)
        whole, chunks = await _chat_both(client, max_tokens=40, extra_body={**forced, "include_reasoning": False})
        assert whole.choices[0].message.reasoning is None and whole.choices[0].message.content == m.content
        assert (_joined(chunks, "reasoning"), _joined(chunks, "content")) == (None, m.content)
        plain = {**off, "guided_regex": "[a-z]{5}"}  # thinking off and never opened: all content
        whole, chunks = await _chat_both(client, max_tokens=40, extra_body=plain)
        m = whole.choices[0].message
        assert m.reasoning is None and len(m.content) == 5 and _joined(chunks, "content") == m.content

        # the Responses API: the thinking as a reasoning item before the message, its tokens counted
        resp = await client.responses.create(model="base", input=CHAT, max_output_tokens=N, temperature=0)
        assert [o.type for o in resp.output] == ["reasoning", "message"]
        assert resp.output[0].content[0].text == want and resp.output[1].content[0].text == ""
        assert resp.usage.output_tokens_details.reasoning_tokens == resp.usage.output_tokens == N
        events = [e async for e in await client.responses.create(
            model="base", input=CHAT, max_output_tokens=N, temperature=0, stream=True
        )]  # fmt: skip
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want
        done = events[-1].response
        assert [o.type for o in done.output] == ["reasoning", "message"] and done.output[0].content[0].text == want
        assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
        assert done.usage.output_tokens_details.reasoning_tokens == N
        with pytest.raises(openai.BadRequestError) as e:  # the parser's split is not the tokens'
            await client.responses.create(model="base", input=CHAT, max_output_tokens=N, top_logprobs=1)
        assert_error_shape(e.value.response.json(), 400, e.value.status_code, "include", "reasoning parser")

        # a grammar binds the answer after the thinking (as vLLM's): the thinking is the model's own
        # text (valid UTF-8: llguidance's free text), the router's with the constraint after </think>
        bound = Constraint(ConstraintKind.JSON_OBJECT, after="</think>")
        req = rpb.GenerateRequest(
            model_id="",
            prompt=BASE_RENDERED,
            sampling=Sampling(max_new_tokens=N, constraint=bound).to_pb(),
            templated=True,
        )
        thinking = "".join([t.text async for m in router.generate_request(req) for t in m.tokens])
        assert not thinking.startswith("{")  # free: a random model writes no JSON by itself
        whole, chunks = await _chat_both(client, max_tokens=N, response_format={"type": "json_object"})
        m = whole.choices[0].message
        assert (m.reasoning, m.content, whole.choices[0].finish_reason) == (thinking, None, "length")
        assert _joined(chunks, "reasoning") == thinking
        no_parser = await clients[0].chat.completions.create(model="base", messages=CHAT, max_tokens=N, temperature=0)
        assert no_parser.choices[0].message.content == want  # without the flag: the text as it came
        assert "reasoning" not in no_parser.choices[0].message.model_dump(exclude_unset=True)
    finally:
        await client.close()


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_continuous_usage_stats_count_each_choices_tokens_as_vllm(clients, kind):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its prompt's tokens and its
    choice's tokens so far (one more per token chunk), the last usage chunk the totals; without
    include_usage it changes nothing (vLLM's rule)."""
    client = clients[0]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = {"model": "v0", "max_tokens": N, "temperature": 0.7, "seed": 5, "n": 2, "stream": True}
    kw["extra_body"] = {"return_token_ids": True}  # every token has its chunk, its id on it
    if kind == "chat":
        chunks = [c async for c in await client.chat.completions.create(messages=CHAT, stream_options=opts, **kw)]
    else:
        chunks = [c async for c in await client.completions.create(prompt="The fox", stream_options=opts, **kw)]
    *pieces, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 2 * N
    prompt = last.usage.prompt_tokens
    seen = {0: 0, 1: 0}
    for c in pieces:
        i = c.choices[0].index
        seen[i] += len(getattr(c.choices[0], "token_ids", None) or ())
        assert c.usage.prompt_tokens == prompt and c.usage.completion_tokens == seen[i], (c, seen)
        assert c.usage.total_tokens == prompt + seen[i]
    assert seen == {0: N, 1: N}
    alone = {"continuous_usage_stats": True}
    if kind == "completion":
        plain = [c async for c in await client.completions.create(prompt="The fox", stream_options=alone, **kw)]
        assert all(c.usage is None for c in plain)
