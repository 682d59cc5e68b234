"""Structured output through the gateway: the `openai` SDK against gateway + router + worker + delta
store as processes on loopback, on the tiny random family (byte tokenizer: one token, one byte).

A random model writes JSON only because the grammar makes it: every schema here bounds its output
(string lengths, integer ranges, array sizes; the layout is fixed, docs/structured-output.md), and
max_tokens is above that bound, so the grammar ends every output (finish_reason "stop"), which
then parses and validates (jsonschema), matches the regex, or is one of the choices: 100 % of
them, greedy and at temperature 1, for the base and both variants in one mixed batch, streamed
and whole, completions and chat.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
import pytest_asyncio

from bitdelta.testing.cluster import Cluster
from tests.support.structured import SCHEMA, gateway_client

pytestmark = pytest.mark.asyncio(loop_scope="module")

T = 120
MODELS = ("base", "v0", "v1")  # "base": the base's name is filled in by the fixture
BOS = "<s>"
TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}"
)
MAX = 190  # tokens: more than any output of SCHEMA (the model's context is 256)
REGEX = r"[a-z]{2,6}-[0-9]{3}"
CHOICES = ["positive", "negative", "neutral ☃"]
STRICT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def cluster(family, tmp_path_factory):
    work = tmp_path_factory.mktemp("structured_cluster")
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    tok = work / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": BOS}))
    with Cluster(work) as c:
        c.st = c.store(root)
        c.w = c.worker(family.base, c.st.address, kv_cache="16MiB", extra=("--max-running", "64"))
        c.r = c.router([c.w.address], c.st.address)
        c.wait_serving(c.st, c.w, c.r)
        c.g = c.gateway(c.r.address, chat_template=tok)
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(cluster):
    c = await gateway_client(cluster.g.address, {"v0", "v1"}, T)
    yield c
    await c.close()


def model_name(client, m: str) -> str:
    return client.base if m == "base" else m


async def complete(client, model: str, *, chat: bool, stream: bool, **kw) -> tuple[str, str]:
    """(text, finish_reason) of one choice, through the SDK."""
    model = model_name(client, model)
    if chat:
        msgs = [{"role": "user", "content": "JSON please"}]
        if not stream:
            r = await client.chat.completions.create(model=model, messages=msgs, **kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        async for ch in await client.chat.completions.create(model=model, messages=msgs, stream=True, **kw):
            for c in ch.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish
    if "response_format" in kw:  # not a parameter of the SDK's completions: sent as it would be by hand
        kw = dict(kw)
        kw["extra_body"] = {**kw.get("extra_body", {}), "response_format": kw.pop("response_format")}
    if not stream:
        r = await client.completions.create(model=model, prompt="JSON:", **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    async for ch in await client.completions.create(model=model, prompt="JSON:", stream=True, **kw):
        for c in ch.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


def valid(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


FORMATS = {
    "json_schema": ({"response_format": STRICT}, valid),
    "guided_json": ({"extra_body": {"guided_json": SCHEMA}}, valid),
    "structured_outputs.json": ({"extra_body": {"structured_outputs": {"json": json.dumps(SCHEMA)}}}, valid),
    "guided_regex": ({"extra_body": {"guided_regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) is not None),
    "guided_choice": ({"extra_body": {"guided_choice": CHOICES}}, lambda t: t in CHOICES),
    "structured_outputs.choice": ({"extra_body": {"structured_outputs": {"choice": CHOICES}}}, lambda t: t in CHOICES),
}


async def test_every_output_parses_and_validates_mixed_batch_streamed_and_whole(client):
    """Every format, for the base and both variants, greedy and sampled (temperature 1, seeded),
    completions and chat, streamed and whole: all at once, one mixed batch on the worker."""
    jobs, cases = [], []
    for name, (kw, ok) in FORMATS.items():
        for i, model in enumerate(MODELS):
            for temperature, seed in ((0.0, None), (1.0, 11 + i), (1.0, 21 + i)):
                chat, stream = (i + int(temperature)) % 2 == 0, seed is not None and seed % 2 == 1
                kws = {**kw, "max_tokens": MAX, "temperature": temperature, "seed": seed}
                jobs.append(complete(client, model, chat=chat, stream=stream, **kws))
                cases.append((name, model, temperature, chat, stream, ok))
    results = await asyncio.gather(*jobs)
    for (name, model, temperature, chat, stream, ok), (text, finish) in zip(cases, results):
        where = (name, model, temperature, "chat" if chat else "completion", "streamed" if stream else "whole")
        assert finish == "stop", (where, text)  # the grammar ended it, not max_tokens
        assert ok(text), (where, text)
    assert any(c[4] for c in cases) and any(not c[4] for c in cases) and any(c[3] for c in cases)


async def test_json_object(client):
    """Any JSON object is unbounded, and a random model would write one string forever: a bias on
    '"' and '}' (a model that means to close what it opens) lets the grammar end each one."""
    bias = {str(ord('"')): 6, str(ord("}")): 4, str(ord("1")): 3}
    kw = {"response_format": {"type": "json_object"}, "max_tokens": MAX, "logit_bias": bias}
    jobs = [
        complete(client, m, chat=True, stream=s, temperature=t, seed=seed, **kw)
        for m in MODELS
        for t, seed, s in ((0.0, None, False), (1.0, 3, True), (1.0, 4, False))
    ]
    for text, finish in await asyncio.gather(*jobs):
        assert finish == "stop" and isinstance(json.loads(text), dict), text


async def test_n_choices_each_validate(client):
    r = await client.chat.completions.create(
        model="v1",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format=STRICT,
        max_tokens=MAX,
        temperature=1.0,
        seed=5,
        n=3,
    )
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop" and valid(c.message.content), c.message.content


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=3)
    zip: str = pydantic.Field(pattern="^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=4)
    age: int = pydantic.Field(ge=0, le=120)
    tags: list[Literal["red", "green", "blue"]] = pydantic.Field(min_length=1, max_length=2)
    address: Address
    ok: bool


async def test_the_sdks_parse_with_a_pydantic_model(client):
    """The SDK's own strict schema of a pydantic model (`chat.completions.parse`), parsed back by it."""
    for model, seed in (("v0", None), ("base", 8)):
        r = await client.chat.completions.parse(
            model=model_name(client, model),
            messages=[{"role": "user", "content": "JSON please"}],
            response_format=Person,
            max_tokens=MAX,
            temperature=0.0 if seed is None else 1.0,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Person), r.choices[0].message.content


async def error_of(client, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model="v0", messages=[{"role": "user", "content": "hi"}], max_tokens=8, **kw
        )
    return e.value


@pytest.mark.parametrize(
    "kw,param,words",
    [
        (
            {
                "response_format": {
                    **STRICT,
                    "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}},
                }
            },
            "response_format",
            "Unsatisfiable schema: minLength (5) is greater than maxLength (2)",
        ),
        (
            {"response_format": {**STRICT, "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
            "response_format",
            "strng",
        ),
        ({"extra_body": {"guided_json": {"enum": []}}}, "guided_json", "Unsatisfiable"),
        ({"extra_body": {"guided_regex": "(a|b"}}, "guided_regex", "unclosed group"),
        ({"extra_body": {"guided_grammar": "start: foo"}}, "guided_grammar", "unknown name"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty list"),
        ({"extra_body": {"guided_regex": "a" * 70000}}, "guided_regex", "at most 65536"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "missing"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
            "guided_regex",
            "one structured-output",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs", "exactly one"),
        ({"extra_body": {"structured_outputs": {"structural_tag": "x"}}}, "structured_outputs", "not supported"),
        ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern", "layout is fixed"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 2}}, "min_tokens", "constraint"),
    ],
)
async def test_a_bad_constraint_is_400_at_once_naming_the_problem(client, kw, param, words):
    e = await error_of(client, **kw)
    body = e.body
    assert body["param"] == param and words in body["message"], body
    # the gateway serves on
    r = await client.chat.completions.create(
        model="v0", messages=[{"role": "user", "content": "hi"}], max_tokens=16, extra_body={"guided_choice": ["ok"]}
    )
    assert r.choices[0].message.content == "ok"


async def test_a_schema_only_the_workers_compile_refuses_is_400_naming_the_field(client):
    """2000 optional properties pass the tokenizer-free check but exceed llguidance's per-step limit
    on the worker's first step: INVALID_ARGUMENT there, 400 naming response_format here."""
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(2000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}
    e = await error_of(client, response_format=fmt)
    assert e.body["param"] == "response_format" and e.body["code"] == "invalid_constraint", e.body
    assert "too large" in e.body["message"], e.body


async def test_text_response_format_is_free_text(client):
    free = await client.completions.create(model="v0", prompt="JSON:", max_tokens=8, temperature=0)
    text = await client.completions.create(
        model="v0", prompt="JSON:", max_tokens=8, temperature=0, extra_body={"response_format": {"type": "text"}}
    )
    assert free.choices[0].text == text.choices[0].text
