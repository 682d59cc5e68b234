"""Tool calling through the gateway: the `openai` SDK's tool_calls objects against gateway + router +
worker + delta store as processes on loopback, on a tiny random family with a 1024-token context.

Three tool-capable chat templates written for the test: a Hermes one (`<tool_call>` blocks, as
Qwen2.5's) for the base and v0, a Llama 3.1 JSON one for v1 (`--variant-chat-templates`), and a
Mistral one (`[TOOL_CALLS]` and a JSON list, ids of 9 letters and digits checked as Mistral's
templates check them) on a second gateway. A random
model makes a call only when the grammar makes it: `required` and a named function are enforced,
so each answer is a call of a defined tool whose arguments validate against its parameters
(bounded, so the grammar ends it); `auto` parses whatever the model writes, which a user grammar
(`structured_outputs`) steers here into content followed by a call.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import jsonschema
import openai
import pytest
import pytest_asyncio

from bitdelta.testing.cluster import Cluster
from bitdelta.testing.family import make_test_family, tiny_args
from services.gateway.chat import ChatTemplate
from services.gateway.tools import CallStream, ToolFormat, parse_calls
from tests.support.structured import gateway_client

pytestmark = pytest.mark.asyncio(loop_scope="module")

T = 120
BOS = "<s>"
HERMES = (
    "{%- if tools %}{{ bos_token }}system: tools:{% for t in tools %} {{ t.function.name }}{% endfor %}."
    ' Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ bos_token }}assistant: {{ m.content }}"
    "{% for tc in m.tool_calls %}<tool_call>\n"
    '{{ {"name": tc.function.name, "arguments": tc.function.arguments} | tojson }}\n</tool_call>{% endfor %}\n'
    "{% elif m.role == 'tool' %}{{ bos_token }}tool {{ m.tool_call_id }}: {{ m.content }}\n"
    "{% else %}{{ bos_token }}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}"
)
LLAMA = (
    '{%- if tools %}{{ bos_token }}system: answer {"name": function name, "parameters": dictionary}. Tools:'
    "{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{ bos_token }}assistant: "
    '{{ {"name": m.tool_calls[0].function.name, "parameters": m.tool_calls[0].function.arguments} | tojson }}\n'
    "{% elif m.role == 'tool' %}{{ bos_token }}ipython: {{ m.content }}\n"
    "{% else %}{{ bos_token }}{{ m.role }}: {{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}"
)
MISTRAL = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] [{% for tc in m.tool_calls %}"
    "{% if tc.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    '{% endif %}{{ {"name": tc.function.name, "arguments": tc.function.arguments, "id": tc.id} | tojson }}'
    "{% if not loop.last %}, {% endif %}{% endfor %}]"
    '{%- elif m.role == \'tool\' %}[TOOL_RESULTS] {{ {"content": m.content, "call_id": m.tool_call_id} | tojson }}'
    "[/TOOL_RESULTS]{%- else %}{{ m.content }}{% endif %}"
    "{%- endfor %}"
)
GRANITE = (
    "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|end_of_text|>\n{% endif %}"
    "{%- for m in messages %}<|start_of_role|>{{ m.role }}<|end_of_role|>"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|tool_call|>"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}{% else %}{{ m.content }}{% endif %}<|end_of_text|>\n"
    "{%- endfor %}<|start_of_role|>assistant<|end_of_role|>"
)
# a Phi-4-mini template that teaches its calls (Phi-4-mini-instruct's own renders no `tools`; vLLM serves it
# with one of its examples), written for the test
PHI4 = (
    '{%- if tools %}<|system|>To call functions answer functools[{"name": ..., "arguments": {...}}, ...]'
    "<|tool|>{% for t in tools %} {{ t.function.name }}{% endfor %}<|/tool|><|end|>{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>"
    "{%- if m.role == 'assistant' and m.tool_calls %}functools{{ m.tool_calls | map(attribute='function') | list | tojson }}"
    "{%- else %}{{ m.content }}{% endif %}<|end|>{%- endfor %}<|assistant|>"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
PARAMS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
ASK = [{"role": "user", "content": "Weather in Lima?"}]
MAX = 160  # tokens: more than any call of TOOLS
HISTORY = [
    {"role": "user", "content": "Weather in Lima?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lima", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    {"role": "user", "content": "And 1 + 2?"},
]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(
        tmp_path_factory.mktemp("tools_family"), n_variants=2, merged=False, args=tiny_args(max_seq_len=1024)
    )


@pytest.fixture(scope="module")
def cluster(family, tmp_path_factory):
    work = tmp_path_factory.mktemp("tools_cluster")
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    for bad in (family.corrupt, family.other_base):
        (root / family.delta_path(bad).name).unlink()
    tok = work / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": HERMES, "bos_token": BOS}))
    (work / "llama.jinja").write_text(LLAMA)
    mistral = work / "mistral"
    mistral.mkdir()
    (mistral / "tokenizer_config.json").write_text(json.dumps({"chat_template": MISTRAL, "bos_token": BOS}))
    (work / "granite.jinja").write_text(GRANITE)
    (work / "phi4.jinja").write_text(PHI4)
    with Cluster(work) as c:
        c.st = c.store(root)
        c.w = c.worker(family.base, c.st.address, kv_cache="32MiB", extra=("--max-running", "48"))
        c.r = c.router([c.w.address], c.st.address)
        c.wait_serving(c.st, c.w, c.r)
        c.g = c.gateway(
            c.r.address,
            chat_template=tok,
            extra=("--variant-chat-templates", f"v1={work / 'llama.jinja'}", "--tokenizer", str(family.base)),
        )
        c.g_mistral = c.gateway(  # Mistral's template for the base and v1, Granite's for v0
            c.r.address,
            name="gateway-mistral",
            chat_template=mistral,
            extra=("--variant-chat-templates", f"v0={work / 'granite.jinja'}"),
        )
        c.g_phi = c.gateway(  # Phi-4-mini's for v1, Hermes' for the base and v0
            c.r.address,
            name="gateway-phi",
            chat_template=tok,
            extra=("--variant-chat-templates", f"v1={work / 'phi4.jinja'}"),
        )
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(cluster):
    c = await gateway_client(cluster.g.address, {"v0", "v1"}, T)
    yield c
    await c.close()


def openai_id(call_id: str) -> bool:
    return call_id.startswith("call_")


def mistral_id(call_id: str) -> bool:
    return len(call_id) == 9 and call_id.isascii() and call_id.isalnum()


async def chat(client, model: str, stream: bool, id_rule=openai_id, **kw):
    """(content, [(name, arguments text)], finish_reason) of choice 0: from the SDK's message, or from
    its streamed deltas assembled as OpenAI's docs do (by tool call index); every call's id follows
    `id_rule`."""
    model = client.base if model == "base" else model
    if not stream:
        r = await client.chat.completions.create(model=model, **kw)
        m = r.choices[0].message
        assert all(id_rule(t.id) for t in m.tool_calls or []), m.tool_calls
        return (
            m.content,
            [(t.function.name, t.function.arguments) for t in m.tool_calls or []],
            r.choices[0].finish_reason,
        )
    content, calls, finish = "", {}, None
    async for ch in await client.chat.completions.create(model=model, stream=True, **kw):
        for c in ch.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
                assert t.id is None or id_rule(t.id), t.id
            finish = c.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def assert_valid_call(name: str, arguments: str, names=("get_weather", "add")) -> None:
    assert name in names, name
    jsonschema.validate(json.loads(arguments), PARAMS[name])


async def test_required_and_named_calls_validate_for_every_model_and_format(client):
    """required (one call: parallel_tool_calls false) and a named function, greedy and sampled,
    streamed and whole, the base and v0 (Hermes) and v1 (Llama JSON) in one mixed batch."""
    jobs, cases = [], []
    for model in ("base", "v0", "v1"):
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            for temperature, seed, stream in ((0.0, None, False), (1.0, 3, True), (1.0, 4, False)):
                kw = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": MAX}
                kw.update(temperature=temperature, seed=seed, parallel_tool_calls=False)
                jobs.append(chat(client, model, stream, **kw))
                cases.append((model, choice, temperature, stream))
    for case, (content, calls, finish) in zip(cases, await asyncio.gather(*jobs)):
        assert finish == "tool_calls" and len(calls) == 1 and not content, (case, content, calls, finish)
        names = ("add",) if isinstance(case[1], dict) else ("get_weather", "add")
        assert_valid_call(*calls[0], names=names)


async def test_required_with_parallel_calls_makes_at_least_one(client):
    """Parallel calls have no bound (a random model goes on to the next call as often as it stops):
    a bias on EOS, which the grammar allows only between whole calls, ends the answer after some."""
    for seed in (1, 2):
        content, calls, finish = await chat(
            client,
            "v0",
            seed == 2,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=600,
            temperature=1.0,
            seed=seed,
            logit_bias={"256": 8},
        )
        assert finish == "tool_calls" and calls and not content, (content, calls, finish)
        for call in calls:
            assert_valid_call(*call)


STEERED = 'start: "Let me check. <tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" CITY "\\", \\"days\\": " DAY "}}\\n</tool_call>"\nCITY: "Paris" | "Tokyo" | "Lima"\nDAY: /[1-7]/'


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_parses_what_the_model_writes_content_and_call(client, stream):
    """tool_choice auto with a user grammar that makes the model write content and then a call:
    the SDK sees the content and a tool_calls object (streamed: content first, the call at the end)."""
    content, calls, finish = await chat(
        client, "v0", stream, messages=ASK, tools=TOOLS, max_tokens=MAX, extra_body={"guided_grammar": STEERED}
    )
    assert finish == "tool_calls" and content == "Let me check. ", (content, calls)
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    assert_valid_call(*calls[0])


async def test_auto_text_that_is_no_call_is_content_and_none_is_text_only(client):
    steered = {"guided_choice": ["It is sunny."]}
    for choice in ("auto", "none"):
        content, calls, finish = await chat(
            client, "v0", True, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=MAX, extra_body=steered
        )
        assert (content, calls, finish) == ("It is sunny.", [], "stop")
    call = {"guided_grammar": 'start: "<tool_call>\\n{\\"name\\": \\"add\\", \\"arguments\\": {}}\\n</tool_call>"'}
    content, calls, finish = await chat(
        client, "v0", False, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=MAX, extra_body=call
    )
    assert calls == [] and finish == "stop" and content.startswith("<tool_call>"), "none: the text as it is"


async def test_multi_turn_history_with_tool_calls_and_results_is_rendered(client, cluster):
    """An assistant turn with tool_calls and a tool turn with tool_call_id reach the template (the
    prompt the worker gets, from /tokenize: with the request's tools, vLLM's field, the prompt chat
    renders for them), and the next call is served."""
    import urllib.request

    def tokenize(model: str, tools: list | None = None) -> str:
        req = urllib.request.Request(
            f"http://{cluster.g.address}/tokenize",
            json.dumps({"model": model, "messages": HISTORY, **({"tools": tools} if tools else {})}).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=T) as r:
            ids = json.loads(r.read())["tokens"]
        req = urllib.request.Request(
            f"http://{cluster.g.address}/detokenize",
            json.dumps({"model": model, "tokens": ids}).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=T) as r:
            return json.loads(r.read())["prompt"]

    hermes, llama = await asyncio.gather(asyncio.to_thread(tokenize, "v0"), asyncio.to_thread(tokenize, "v1"))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}\n</tool_call>' in hermes
    assert "tool call_1: sunny, 24 C" in hermes and "user: And 1 + 2?" in hermes
    assert '{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}' in llama and "ipython: sunny" in llama
    with_tools = await asyncio.to_thread(tokenize, "v0", TOOLS)
    r = await client.chat.completions.create(model="v0", messages=HISTORY, tools=TOOLS, max_tokens=1, temperature=0)
    assert len(with_tools.encode()) == r.usage.prompt_tokens > len(hermes.encode())  # the byte tokenizer
    head = with_tools.removesuffix(hermes)  # the template's tools section before the same turns
    assert head != with_tools and "system: tools:" in head and "get_weather" in head
    for model in ("v0", "v1"):
        _, calls, finish = await chat(
            client,
            model,
            False,
            messages=HISTORY,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=MAX,
            parallel_tool_calls=False,
        )
        assert finish == "tool_calls" and len(calls) == 1
        assert_valid_call(*calls[0])


async def test_the_templates_get_the_tools_as_transformers_passes_them():
    t = ChatTemplate(HERMES, "test", {"bos_token": BOS})
    assert t.render(ASK, tools=TOOLS).startswith(f"{BOS}system: tools: get_weather add. Call one as <tool_call>")
    assert "tools:" not in t.render(ASK)


async def test_parse_calls_and_the_stream_holder():
    text = 'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 3}}\n</tool_call>'
    content, calls = parse_calls(text, ToolFormat.HERMES)
    assert content == "Hi \n" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_weather", {"city": "Lima", "days": 3}),
    ]
    assert parse_calls("<tool_call>not json</tool_call>", ToolFormat.HERMES) == ("<tool_call>not json</tool_call>", ())
    content, calls = parse_calls(' {"name": "add", "parameters": {"a": 1, "b": 2}}', ToolFormat.LLAMA_JSON)
    assert content is None and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert parse_calls("{not a call", ToolFormat.LLAMA_JSON) == ("{not a call", ())
    s = CallStream(ToolFormat.HERMES)
    pieces = [s.add(p) for p in ("Hi <to", "ol_call>\n", text[3 + len("<tool_call>\n") :])]
    assert pieces == ["Hi ", "", ""]
    rest, made, finish = s.finish("stop")
    assert finish == "tool_calls" and len(made) == 2 and rest == ""
    s = CallStream(ToolFormat.HERMES)
    assert s.add("a <to") == "a " and s.add("ast>") == "<toast>"  # held only while it could begin a call
    assert s.finish("stop") == ("", (), "stop")


@pytest.mark.parametrize(
    "kw,param,words",
    [
        ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools",
            "object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "strng"}}},
                        },
                    }
                ]
            },
            "tools",
            "strng",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "same name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not one of",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "logprobs": True}, "logprobs", "not served"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "one constraint",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages",
            "JSON object",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ],
)
async def test_malformed_tools_are_400_naming_the_field(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="v0", **{"messages": ASK, "max_tokens": 8, **kw})
    body = e.value.body
    assert body["param"] == param and words in body["message"], body


# The Responses API's function tools: flat ({type, name, description, parameters}), the calls output
# items of their own, a conversation's calls and results input items of their own
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]
HISTORY_ITEMS = [
    {"role": "user", "content": "Weather in Lima?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Lima", "days": 2}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"},
    {"role": "user", "content": "And 1 + 2?"},
]


async def respond(client, model: str, stream: bool, **kw):
    """(text, [(name, arguments, call_id)], status) of a /v1/responses answer, whole or from its
    streamed events (each call from its output_item.done, checked against its arguments' events)."""
    model = client.base if model == "base" else model
    if not stream:
        r = await client.responses.create(model=model, **kw)
        calls = [(o.name, o.arguments, o.call_id) for o in r.output if o.type == "function_call"]
        return r.output_text or None, calls, r.status
    text, calls, args, status = "", [], {}, None
    kinds = []
    async for e in await client.responses.create(model=model, stream=True, **kw):
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
        elif e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
        elif e.type == "response.function_call_arguments.done":
            assert args[e.item_id] == e.arguments
        elif e.type == "response.output_item.done" and e.item.type == "function_call":
            assert args[e.item.id] == e.item.arguments
            calls.append((e.item.name, e.item.arguments, e.item.call_id))
        elif e.type in ("response.completed", "response.incomplete"):
            status = e.response.status
            assert [(o.name, o.arguments, o.call_id) for o in e.response.output if o.type == "function_call"] == calls
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    return text or None, calls, status


async def test_responses_serve_function_tools_as_chat_does(client):
    """required and a named function through /v1/responses (flat tools, {type: function, name}):
    function_call items whose arguments validate, whole and streamed; greedy, each the same call the
    chat API makes for the same request."""
    for model in ("v0", "v1"):
        for choice, chat_choice in (
            ("required", "required"),
            ({"type": "function", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
        ):
            kw = {"tools": FLAT, "tool_choice": choice, "max_output_tokens": MAX, "temperature": 0.0}
            whole, streamed = await asyncio.gather(
                respond(client, model, False, input=ASK, parallel_tool_calls=False, **kw),
                respond(client, model, True, input=ASK, parallel_tool_calls=False, **kw),
            )
            _, want, _ = await chat(
                client,
                model,
                False,
                messages=ASK,
                tools=TOOLS,
                tool_choice=chat_choice,
                max_tokens=MAX,
                temperature=0.0,
                parallel_tool_calls=False,
            )
            for text, calls, status in (whole, streamed):
                assert status == "completed" and text is None and len(calls) == 1, (model, choice, text, calls)
                assert calls[0][:2] == want[0] and calls[0][2].startswith("call_")
                assert_valid_call(*calls[0][:2], names=("add",) if isinstance(choice, dict) else ("get_weather", "add"))


async def test_responses_give_content_then_a_call_as_two_items():
    """What the model wrote before its call is a message item, the call a function_call item of its
    own: whole, and streamed (the text's events, then the call's, then completed), numbered."""
    from bitdelta.common.v1 import generation_pb2 as gen_pb
    from services.gateway import responses as rsp
    from services.gateway.protocol import parse_chat
    from services.gateway.tools import Call

    body, info = rsp.to_chat({"model": "v0", "input": ASK, "tools": FLAT})
    r = parse_chat(body)
    call = Call("call_7", "get_weather", '{"city": "Lima", "days": 2}')
    usage = gen_pb.Usage(prompt_tokens=5, completion_tokens=9)
    out = rsp.whole(info, r, "Let me check. ", "tool_calls", usage, (call,))
    assert [o["type"] for o in out["output"]] == ["message", "function_call"] and out["status"] == "completed"
    assert out["output"][0]["content"][0]["text"] == "Let me check. "
    assert {k: out["output"][1][k] for k in ("call_id", "name", "arguments")} == {
        "call_id": "call_7",
        "name": "get_weather",
        "arguments": call.arguments,
    }
    assert out["tools"] == FLAT and rsp.whole(info, r, None, "tool_calls", usage, (call,))["output"][0]["type"] == (
        "function_call"
    )
    ev = rsp.Events(info, r)
    raw = ev.start() + ev.delta("Let me check. ") + ev.end("tool_calls", usage, (call,))
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[8]["output_index"] == 1 and events[9]["delta"] == call.arguments
    assert events[-1]["response"]["output"][1]["call_id"] == "call_7"
    only = rsp.Events(info, r)  # calls alone: no message item
    raw = only.start() + only.end("tool_calls", usage, (call,))
    kinds = [json.loads(line[6:])["type"] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert "response.content_part.added" not in kinds and kinds[2] == "response.output_item.added"


async def test_a_conversation_s_calls_and_results_are_input_items(client, cluster):
    """function_call and function_call_output input items become the assistant turn's tool_calls and
    the tool turn chat sends: the same greedy answer as chat's on HISTORY, for both templates."""
    for model in ("v0", "v1"):
        _, calls, _ = await respond(
            client,
            model,
            False,
            input=HISTORY_ITEMS,
            tools=FLAT,
            tool_choice="required",
            max_output_tokens=MAX,
            temperature=0.0,
            parallel_tool_calls=False,
        )
        _, want, _ = await chat(
            client,
            model,
            False,
            messages=HISTORY,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=MAX,
            temperature=0.0,
            parallel_tool_calls=False,
        )
        assert [c[:2] for c in calls] == want and want
    # no tools now: text, the same as chat's for the same conversation
    text, calls, _ = await respond(client, "v0", False, input=HISTORY_ITEMS, max_output_tokens=8, temperature=0.0)
    want, _, _ = await chat(client, "v0", False, messages=HISTORY, max_tokens=8, temperature=0.0)
    assert (text, calls) == (want, [])


async def test_mistral_calls_are_read_and_their_ids_go_back_into_its_template(cluster):
    """A Mistral template's answers (the base's and v1's on this gateway): required and named calls (the grammar writes [TOOL_CALLS] and a
    list) come back as tool_calls with ids of 9 letters and digits, whole and streamed; a history
    with such ids renders and is served, one with OpenAI's ids is refused by the template (400)."""
    client = await gateway_client(cluster.g_mistral.address, {"v0"}, T)
    try:
        jobs = []
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            for stream in (False, True):
                kw = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": MAX}
                jobs.append(chat(client, "base", stream, mistral_id, temperature=0, parallel_tool_calls=False, **kw))
        for content, calls, finish in await asyncio.gather(*jobs):
            assert finish == "tool_calls" and len(calls) == 1 and not content, (content, calls)
            assert_valid_call(*calls[0])
        r = await client.chat.completions.create(
            model="v1", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=MAX, parallel_tool_calls=False
        )
        made = r.choices[0].message.tool_calls[0]
        history = [*ASK, r.choices[0].message.model_dump(exclude_none=True)]
        history += [{"role": "tool", "tool_call_id": made.id, "content": "sunny"}, HISTORY[-1]]
        _, calls, finish = await chat(
            client,
            "v1",
            False,
            mistral_id,
            messages=history,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=MAX,
            parallel_tool_calls=False,  # one call: parallel ones have no bound on a random model
        )
        assert finish == "tool_calls" and calls
        with pytest.raises(openai.BadRequestError, match="length 9"):
            await client.chat.completions.create(model="v1", messages=HISTORY, tools=TOOLS, max_tokens=4)
        # Mistral's [TOOL_CALLS] is a special token: with tools, special tokens' text stays in the
        # output (as vLLM's parser asks); a grammar writes one here (257, a special of the test's tokenizer)
        special = {"guided_grammar": 'start: "Hi" <[257]> "x"'}
        for model in ("v1", "v0"):  # Mistral's, and Granite's <|tool_call|>
            r = await client.chat.completions.create(
                model=model, messages=ASK, tools=TOOLS, max_tokens=8, extra_body=special
            )
            assert r.choices[0].message.content == "Hi<|im_start|>x", model
        hermes = await gateway_client(cluster.g.address, {"v0"}, T)
        r = await hermes.chat.completions.create(
            model="v0", messages=ASK, tools=TOOLS, max_tokens=8, extra_body=special
        )
        await hermes.close()
        assert r.choices[0].message.content == "Hix"  # elsewhere skipped, as by default
    finally:
        await client.close()


async def test_mistral_parse_calls_and_the_stream_holder():
    fmt = ToolFormat.MISTRAL
    content, calls = parse_calls('Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]', fmt)
    assert content == "Sure. " and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert all(mistral_id(c.id) for c in calls)
    two = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Lima", "days": 1}'
    content, calls = parse_calls(two, fmt)  # the v11 form, a call after each [TOOL_CALLS]
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    for bad in ("[TOOL_CALLS] [not json", '[TOOL_CALLS] [{"name": "add", "arguments": {}}] and more', "[TOOL_CALLS]"):
        assert parse_calls(bad, fmt) == (bad, ()), bad
    assert ToolFormat.of_template(MISTRAL) is fmt and ToolFormat.of_template(HERMES) is ToolFormat.HERMES
    s = CallStream(fmt)
    assert [s.add(p) for p in ("Sure. [TOOL_", "CALLS] [", '{"name": "add", "arguments": {}}]')] == ["Sure. ", "", ""]
    rest, made, finish = s.finish("stop")
    assert (rest, [c.name for c in made], finish) == ("", ["add"], "tool_calls")
    s = CallStream(fmt)
    assert s.add("a [TOOL") == "a " and s.add("S]") == "[TOOLS]"  # held only while it could begin a call


@pytest.mark.parametrize(
    "gateway, first, other, auto",
    [
        ("g_mistral", "v0", ("v1", mistral_id), None),  # Granite's v0 beside Mistral's v1
        ("g_phi", "v1", ("v0", openai_id), 'functools[{"name": "add", "arguments": {"a": 1, "b": 2}}]'),
    ],
    ids=["granite", "phi4_mini"],
)
async def test_listed_calls_are_read_whole_and_streamed(cluster, gateway, first, other, auto):
    """A Granite template (v0 on the second gateway) and a Phi-4-mini one (v1 on the third; vLLM's
    phi4_mini_json parser): required and named calls (the opener and a list) come back as
    tool_calls, whole and streamed, in one mixed batch with a model of another format; a
    conversation with a call and its result is served; Phi-4-mini's `auto` answer that writes a call
    (steered by a grammar) is read as one."""
    client = await gateway_client(getattr(cluster, gateway).address, {first}, T)
    try:
        jobs = []
        for model, rule in ((first, openai_id), other):
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                for stream in (False, True):
                    kw = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": MAX}
                    jobs.append(chat(client, model, stream, rule, temperature=0, parallel_tool_calls=False, **kw))
        for content, calls, finish in await asyncio.gather(*jobs):
            assert finish == "tool_calls" and len(calls) == 1 and not content, (content, calls)
            assert_valid_call(*calls[0])
        _, calls, finish = await chat(
            client, first, False, messages=HISTORY, tools=TOOLS, tool_choice="required", max_tokens=MAX,
            parallel_tool_calls=False,
        )  # fmt: skip
        assert finish == "tool_calls" and calls
        if auto is not None:
            steered = {"guided_grammar": f"start: {json.dumps(auto)}"}
            for stream in (False, True):
                content, calls, finish = await chat(
                    client, first, stream, messages=ASK, tools=TOOLS, max_tokens=MAX, extra_body=steered
                )
                assert finish == "tool_calls" and not content and calls[0][0] == "add", (content, calls)
    finally:
        await client.close()


async def test_granite_parse_calls_and_the_stream_holder():
    fmt = ToolFormat.GRANITE
    assert ToolFormat.of_template(GRANITE) is fmt
    content, calls = parse_calls('<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}]', fmt)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert all(openai_id(c.id) for c in calls)
    for bad in ('[{"name": "add", "arguments": {}}]', "<|tool_call|>add[ARGS]{}", "<|tool_call|>[oops"):
        assert parse_calls(bad, fmt) == (bad, ()), bad  # no opener, Mistral's other form, not JSON
    s = CallStream(fmt)
    assert [s.add(p) for p in ("Ok <|tool", '_call|>[{"name": "add", "arguments": {}}]')] == ["Ok ", ""]
    rest, made, finish = s.finish("stop")
    assert (rest, [c.name for c in made], finish) == ("Ok "[3:], ["add"], "tool_calls")


async def test_phi4_mini_parse_calls_and_the_stream_holder():
    fmt = ToolFormat.PHI4_MINI
    assert ToolFormat.of_template(PHI4) is fmt and not fmt.special_opener
    text = 'Let me check. functools[{"name": "add", "arguments": {"a": 1}}, {"name": "neg", "arguments": {"x": 2}}]'
    content, calls = parse_calls(text, fmt)
    assert content == "Let me check. " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1}),
        ("neg", {"x": 2}),
    ]
    assert all(openai_id(c.id) for c in calls)
    for bad in ('[{"name": "add", "arguments": {}}]', "functools[oops", 'functools[{"name": "a", "arguments": {}}] ok'):
        assert parse_calls(bad, fmt) == (bad, ()), bad  # no opener, not JSON, text after the calls
    assert parse_calls("the functools module", fmt) == ("the functools module", ())
    s = CallStream(fmt)
    assert [s.add(p) for p in ("Ok func", 'tools[{"name": "add", "arguments": {}}]')] == ["Ok ", ""]
    rest, made, finish = s.finish("stop")
    assert (rest, [c.name for c in made], finish) == ("", ["add"], "tool_calls")
    s = CallStream(fmt)
    assert s.add("have fun") == "have " and s.add(" today") == "fun today"  # held only while it could begin a call
