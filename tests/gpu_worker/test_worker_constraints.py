"""Constrained decoding in the worker (Sampling.constraint, services/gpu_worker/constraints.py), on a
tiny random family whose byte tokenizer makes one token one byte.

A random model never writes JSON by itself, so every output here is the grammar's doing. Each schema
bounds its output (strings, integers and arrays have limits, the layout is fixed: bitdelta/grammar.py),
so max_new_tokens above that bound means the grammar, not the length, ends every output: each test
asserts finish EOS, then that the text parses and validates (jsonschema), matches the regex, is
one of the choices. Greedy and sampled (temperature 1, several seeds), the base and a variant, n > 1,
all in one mixed batch with unconstrained requests, which get the same tokens as alone.
"""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import pytest
import pytest_asyncio

from bitdelta.generation import Constraint, ConstraintKind, FinishReason, GenerationError, Request, Sampling
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
from bitdelta.grammar import check
from bitdelta.rpc.clients.worker import WorkerCallError, WorkerClient
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from tests.support.structured import SCHEMA
from tests.support.worker import running_worker

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("cpu_kernels")]

EOS = 256
PROMPT = "Answer in JSON:"
# nested objects, an array of enums, string length limits, an integer range, a pattern, a boolean;
# at most ~200 bytes written compactly (a string's character at most a 12-byte surrogate-pair escape)
BOUND = 225  # tokens: more than any output of SCHEMA, REGEX or CHOICES (the model's context is 256)
JSON_SCHEMA = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
REGEX = r"[a-z]{2,6}-[0-9]{3}( \(ok\))?"
CHOICES = ("positive", "negative", "neutral ☃")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("constraints_family"), n_variants=1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(family):
    cfg = WorkerConfig(
        base=family.base, delta_dir=str(family.deltas), delta_budget=4 << 20, kv_cache=16 << 20, max_running=32
    )
    async with running_worker(cfg) as (w, server, _):
        client = WorkerClient(f"127.0.0.1:{server.port}", generate_timeout_s=120)
        yield w, client
        await client.close()


async def run(worker, model: str, sampling: Sampling, prompt: str = PROMPT) -> dict[int, tuple[str, FinishReason]]:
    """choice -> (text, finish reason)."""
    texts, finish = {}, {}
    async for ev in worker.generate(Request(model, prompt, sampling)):
        texts[ev.index] = texts.get(ev.index, "") + ev.text
        if ev.finish_reason is not None:
            finish[ev.index] = ev.finish_reason
    return {i: (texts.get(i, ""), finish[i]) for i in finish}


def valid_json(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


CASES = [
    (JSON_SCHEMA, valid_json),
    (Constraint(ConstraintKind.JSON_OBJECT), None),  # unbounded: checked apart below
    (Constraint(ConstraintKind.REGEX, REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    (Constraint(ConstraintKind.CHOICE, choices=CHOICES), lambda t: t in CHOICES),
]


async def test_every_output_satisfies_its_constraint_greedy_and_sampled_base_and_variant_in_one_batch(served):
    worker, _ = served
    jobs, checks = [], []
    for constraint, ok in CASES:
        if ok is None:
            continue
        for model in ("", "v0"):
            for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)):
                s = Sampling(max_new_tokens=BOUND, temperature=temperature, seed=seed, constraint=constraint)
                jobs.append(run(worker, model, s))
                checks.append((constraint.kind, model, temperature, ok))
    free = Sampling(max_new_tokens=24)
    jobs.append(run(worker, "v0", free))  # an unconstrained row in the same batch
    steps = worker.engine.steps
    results = await asyncio.gather(*jobs)
    assert worker.engine.steps - steps < sum(BOUND for _ in jobs) // 4, "the requests did not share steps"
    for (kind, model, temperature, ok), out in zip(checks, results):
        text, finish = out[0]
        assert finish is FinishReason.EOS, (kind, model, temperature, text)  # the grammar ended it
        assert ok(text), (kind, model, temperature, text)
    alone = await run(worker, "v0", free)
    assert results[-1] == alone, "an unconstrained row changed by constrained rows in its batch"


async def test_n_choices_each_satisfy_the_schema_and_sampled_ones_differ(served):
    worker, _ = served
    out = await run(worker, "v0", Sampling(max_new_tokens=BOUND, temperature=1.0, seed=7, n=4, constraint=JSON_SCHEMA))
    assert sorted(out) == [0, 1, 2, 3]
    for text, finish in out.values():
        assert finish is FinishReason.EOS and valid_json(text), text
    assert len({t for t, _ in out.values()}) > 1


async def test_json_object_is_a_json_object(served):
    """Any JSON object has no bound, and a random model would write one string forever; a bias on
    '"' and '}' (as a model that means to close what it opens) lets the grammar end each one."""
    worker, _ = served
    c = Constraint(ConstraintKind.JSON_OBJECT)
    bias = ((ord('"'), 6.0), (ord("}"), 4.0), (ord("1"), 3.0))
    jobs = [
        run(worker, m, Sampling(max_new_tokens=BOUND, temperature=t, seed=s, logit_bias=bias, constraint=c))
        for m in ("", "v0")
        for t, s in ((0.0, None), (1.0, 4), (1.0, 5), (1.0, 6))
    ]
    for out in await asyncio.gather(*jobs):
        text, finish = out[0]
        assert finish is FinishReason.EOS and isinstance(json.loads(text), dict), text


async def test_eos_waits_for_the_grammar_even_when_biased_up(served):
    """A bias that makes EOS the likeliest token everywhere: free text ends at once, constrained text
    only once the grammar is complete (and then at once: nothing else is allowed)."""
    worker, _ = served
    bias = ((EOS, 100.0),)
    free = await run(worker, "", Sampling(max_new_tokens=20, logit_bias=bias))
    assert free[0] == ("", FinishReason.EOS)
    for c, want in ((Constraint(ConstraintKind.CHOICE, choices=("abc", "abcd")), {"abc", "abcd"}),):
        text, finish = (await run(worker, "", Sampling(max_new_tokens=20, logit_bias=bias, constraint=c)))[0]
        assert finish is FinishReason.EOS and text in want


async def test_lark_and_gbnf_grammars(served):
    worker, _ = served
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-c]{1,4}'
    for text, pattern in ((lark, r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"), (gbnf, r"\[[a-c]{1,4}(,[a-c]{1,4}){0,3}\]")):
        c = Constraint(ConstraintKind.GRAMMAR, text)
        for t, seed in ((0.0, None), (1.0, 9)):
            out, finish = (
                await run(worker, "v0", Sampling(max_new_tokens=BOUND, temperature=t, seed=seed, constraint=c))
            )[0]
            if finish is FinishReason.EOS:
                assert re.fullmatch(pattern, out), out
            else:  # a '+'-repetition has no bound
                assert finish is FinishReason.LENGTH


async def test_a_constraint_compiles_once_per_schema(served):
    worker, _ = served
    c = Constraint(ConstraintKind.REGEX, "[0-9]{4}-only-once")
    before = worker.grammars.compiled
    outs = await asyncio.gather(*(run(worker, "", Sampling(max_new_tokens=40, constraint=c)) for _ in range(3)))
    await run(worker, "v0", Sampling(max_new_tokens=40, constraint=c))
    assert worker.grammars.compiled - before == 1
    assert all(re.fullmatch("[0-9]{4}-only-once", o[0][0]) for o in outs)


def _request(constraint: Constraint, **kw) -> wpb.GenerateRequest:
    s = Sampling(max_new_tokens=8, constraint=constraint, **kw)
    return wpb.GenerateRequest(model_id="", prompt=PROMPT, sampling=s.to_pb())


@pytest.mark.parametrize(
    "constraint,words",
    [
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "string", "minLength": 5, "maxLength": 2}'), "Unsatisfiable"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "strng"}'), "strng"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"'), "not valid JSON"),
        (Constraint(ConstraintKind.REGEX, "(a|b"), "unclosed group"),
        (Constraint(ConstraintKind.GRAMMAR, "start: foo"), "unknown name"),
        (Constraint(ConstraintKind.CHOICE), "at least one"),
        (
            Constraint(
                ConstraintKind.JSON_SCHEMA,
                json.dumps({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(2000)}}),
            ),
            "too large",
        ),
        (Constraint(ConstraintKind.REGEX, "a" * 70000), "at most 65536"),
    ],
)
async def test_a_bad_constraint_is_invalid_argument_naming_the_problem_and_the_worker_serves_on(
    served, constraint, words
):
    worker, client = served
    with pytest.raises(WorkerCallError) as e:
        async for _ in client.generate(_request(constraint)):
            pass
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sampling.constraint" in e.value.details, e.value
    assert words in e.value.details, e.value.details
    if "too large" not in words:  # found by the worker's first step, which needs the tokenizer
        with pytest.raises(GenerationError, match=re.escape(words)):
            check(constraint)  # the gateway's check says the same
    ok = [ev async for ev in client.generate(_request(Constraint(ConstraintKind.CHOICE, choices=("yes",))))]
    assert "".join(ev.text for ev in ok) == "yes"


@pytest.mark.parametrize("field", ["min_tokens", "ignore_eos"])
async def test_fields_that_would_fight_the_grammar_are_refused(served, field):
    _, client = served
    value = 2 if field == "min_tokens" else True
    with pytest.raises(WorkerCallError) as e:
        async for _ in client.generate(_request(Constraint(ConstraintKind.CHOICE, choices=("a",)), **{field: value})):
            pass
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"sampling.{field}" in e.value.details


async def test_a_slow_compile_never_holds_the_event_loop(served):
    """A large schema (tens of milliseconds to compile) compiles on the compiler's threads: the
    loop ticks on meanwhile (a compile on the loop would let it tick at most once)."""
    worker, _ = served
    pattern = "[a-z0-9]{3,60}@[a-z]{2,60}\\.(com|org|net|edu)"
    big = {
        "type": "object",
        "properties": {f"k{i}": {"type": "string", "pattern": f"{pattern}{i}"} for i in range(400)},
        "required": [f"k{i}" for i in range(400)],
    }
    task = asyncio.create_task(worker.grammars.compile(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(big))))
    ticks = 0
    while not task.done():
        await asyncio.sleep(0.001)
        ticks += 1
    g = await task
    assert g.compile_ms > 10, "the schema compiled too fast to tell"
    assert ticks >= 3, (ticks, g.compile_ms)


async def test_a_constraint_after_a_text_leaves_what_comes_before_free(served):
    """Constraint.after (a reasoning model's thinking, closed by "</think>" in the gateway): the output
    is free up to and including the first occurrence of the text, then bound. Here the text is "x" (one
    byte, one token) and a bias on it ends the free part within a few tokens: what follows is the
    regex's, then EOS; greedy, the free part is the unconstrained output's own beginning."""
    worker, _ = served
    c = Constraint(ConstraintKind.REGEX, "[0-9]{3}", after="x")
    bias = ((ord("x"), 6.0),)
    for model, t, seed in (("", 1.0, 1), ("v0", 1.0, 2), ("v0", 0.0, None)):
        s = Sampling(max_new_tokens=BOUND, temperature=t, seed=seed, logit_bias=bias, constraint=c)
        text, finish = (await run(worker, model, s))[0]
        free, sep, bound = text.partition("x")
        assert sep and finish is FinishReason.EOS and re.fullmatch("[0-9]{3}", bound), (model, t, text)
        if t == 0.0:
            alone = (await run(worker, model, Sampling(max_new_tokens=len(free) + 1, logit_bias=bias)))[0][0]
            assert alone == free + "x", (alone, text)
    with pytest.raises(GenerationError, match="at most 64"):
        Constraint(ConstraintKind.JSON_OBJECT, after="x" * 65).validate()
    assert Constraint.from_pb(c.to_pb()) == c
    for kind, body in ((ConstraintKind.JSON_OBJECT, ""), (ConstraintKind.GRAMMAR, 'root ::= "a"')):
        check(Constraint(kind, body, after="</think>"))  # every kind wraps, GBNF too
