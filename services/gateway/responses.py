"""OpenAI's Responses API (`POST /v1/responses`), stateless, text and function tools, as vLLM serves
it without its response store: a request becomes the chat request it means (`to_chat`:
`instructions` a system message first, `input` the messages, its function_call items an assistant
turn's tool_calls and its function_call_output items tool turns, `tools` (function tools) and
`tool_choice` chat's, `max_output_tokens`, `text.format` as response_format), runs as one, and is
answered as a `response` object (an assistant message and/or function_call items), or as its
stream of typed events (response.created, ..., response.output_text.delta, ...,
response.function_call_arguments.delta, ..., response.completed).

    chat_body, info = to_chat(body)          # 400 (ApiError) naming the Responses field
    whole(info, r, text, finish, usage, calls)   # the response object
    Events(info, r)                          # the stream's events, numbered

Token logprobs as OpenAI's: `include: ["message.output_text.logprobs"]` (or `top_logprobs` > 0) puts
each generated token's logprob, with `top_logprobs` alternatives, in the message's output_text part and
in each text delta event (not beside function tools or a reasoning parser, whose split of the text
the tokens do not follow: refused).

Stored responses, as vLLM's with VLLM_ENABLE_RESPONSES_API_STORE: where the gateway keeps some
(`ResponseStore`, --responses-store), an answer with `store` (true by default, as OpenAI's) is kept
with the conversation it ends, `previous_response_id` continues that conversation (its input and
output turns before this request's input; its instructions are not carried over, as OpenAI says),
and GET and DELETE /v1/responses/{id} read and drop it, each only for the caller whose
authorization header made it. Without a store `store` is answered false and `previous_response_id`
is refused.

Background responses, as OpenAI's and vLLM's (a store needed, `store` true): the request is checked,
answered at once as a `queued` response, and run by the gateway (app.py) while the caller polls GET
/v1/responses/{id} (`in_progress`, then `completed`, `incomplete` or `failed` with its error) or
cancels it (POST /v1/responses/{id}/cancel: `cancelled`). With `stream` its events are sent as they
come and kept: GET /v1/responses/{id}?stream=true&starting_after=N sends them again from N + 1 on
(the rest as they come, while it runs), so a caller whose connection broke resumes. What needs a tool this server does not run
(`conversation`, hosted tools such as web_search) is refused by name, as is any field this module
does not know.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.generation import MAX_LOGPROBS
from services.gateway.protocol import ApiError, Request, invalid
from services.gateway.tools import Call

# The roles of input messages (a developer message is the system's, as OpenAI treats it)
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA = 16  # OpenAI's limit: keys of at most 64 characters, values of at most 512
# Responses field -> the chat field it becomes (errors from the chat parser name the Responses one)
RENAMED = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "function.name": "name",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
}
# Fields passed to the chat request as they are: OpenAI's sampling ones and vLLM's extras
PASSED = ("model", "temperature", "top_p", "stream", "top_k", "min_p", "repetition_penalty", "seed", "priority")
PASSED += ("cache_salt", "stop", "chat_template_kwargs", "parallel_tool_calls")
READ = ("instructions", "input", "max_output_tokens", "text", "metadata", "user", "tools", "tool_choice")
READ += ("top_logprobs", "include", "store", "previous_response_id", "background")
# Fields served only "off" (_check_off): no truncation, no reasoning options
OFF = ("truncation", "reasoning")
# A response's statuses while it runs in the background, and those it ends in
RUNNING = ("queued", "in_progress")
# What `include` may ask for here (OpenAI's other includables need hosted tools, images or stored state)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Fields that do not change the answer here
IGNORED = ("safety_identifier", "prompt_cache_key", "service_tier", "stream_options", "max_tool_calls")
# Fields refused whatever their value (but null), with why
REFUSED = {
    "conversation": "this server keeps no conversations (send the whole conversation as input)",
    "prompt": "stored prompt templates are not served",
}


@dataclass(frozen=True)
class ResponsesInfo:
    """What the response object echoes of its request, beside the chat request it ran as."""

    id: str
    created_at: int
    instructions: str | None
    max_output_tokens: int | None
    text_format: dict
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    tools: list = field(default_factory=list)  # as the request gave them (function tools)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    logprobs: bool = False  # the output text's tokens' logprobs (include, top_logprobs)
    top_logprobs: int | None = None  # as the request gave it (the alternatives per token)
    store: bool = False  # the answer is kept (a gateway with a store, and the request's `store`)
    previous_response_id: str | None = None
    background: bool = False  # run by the gateway, read later from its store
    # the turns this request continues and adds (a previous response's, then its input; no instructions):
    # what a stored answer keeps for the next previous_response_id
    conversation: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Stored:
    """A kept answer: the conversation it ends (input and output turns, as chat messages), the
    response object, and a background stream's events (each server-sent event with its sequence
    number: what GET ?stream=true replays)."""

    conversation: tuple[dict, ...]
    response: dict
    events: tuple[tuple[int, bytes], ...] = ()


class ResponseStore:
    """The gateway's kept responses, in this process's memory (a replica keeps its own), the least
    recently used dropped past `capacity` answers or `max_bytes` of their JSON. Each is read only
    with the authorization header that made it (`owner`)."""

    def __init__(self, capacity: int, max_bytes: int):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._kept: OrderedDict[tuple[str, str], tuple[Stored, int]] = OrderedDict()
        self.bytes = 0

    @staticmethod
    def owner(authorization: str | None) -> str:
        """Whose a response is: a digest of the caller's authorization header ("" without one)."""
        return hashlib.sha256(authorization.encode()).hexdigest() if authorization else ""

    def put(self, owner: str, info: ResponsesInfo, response: dict, events: tuple[tuple[int, bytes], ...] = ()) -> None:
        """Keep `response` (an answer to `info`'s request) with its conversation (and its stream's
        `events`), unless alone it is past max_bytes."""
        kept = Stored((*info.conversation, *turns(response["output"])), response, events)
        size = len(json.dumps([kept.conversation, response], ensure_ascii=False)) + sum(len(e) for _, e in events)
        if size > self.max_bytes:
            return
        self.delete(owner, info.id)
        self._kept[owner, info.id] = (kept, size)
        self.bytes += size
        while len(self._kept) > self.capacity or self.bytes > self.max_bytes:
            _, (_, gone) = self._kept.popitem(last=False)
            self.bytes -= gone

    def update(self, owner: str, response_id: str, response: dict) -> None:
        """Replace a kept response's object (a background response's status), its conversation kept;
        nothing if it is no longer kept."""
        got = self._kept.get((owner, response_id))
        if got is not None:
            kept, size = got
            self._kept[owner, response_id] = (dataclasses.replace(kept, response=response), size)

    def get(self, owner: str, response_id: str) -> Stored | None:
        got = self._kept.get((owner, response_id))
        if got is None:
            return None
        self._kept.move_to_end((owner, response_id))
        return got[0]

    def delete(self, owner: str, response_id: str) -> bool:
        got = self._kept.pop((owner, response_id), None)
        if got is not None:
            self.bytes -= got[1]
        return got is not None


def turns(output: list[dict]) -> list[dict]:
    """A response's output items as the chat turns a next request continues: the message's text an
    assistant turn, with the function calls that follow it as its tool_calls (reasoning left out, as
    vLLM leaves it)."""
    out: list[dict] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"] if p["type"] == "output_text")
            out.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item["arguments"]}
            if not out:  # calls alone: an assistant turn of no text
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
    return out


def previous_id(body: Any) -> str | None:
    """The request's previous_response_id (400 unless a string)."""
    value = body.get("previous_response_id") if isinstance(body, dict) else None
    if value is not None and (not isinstance(value, str) or not value):
        raise invalid("previous_response_id", "previous_response_id must be a response's id (a string)")
    return value


def _check_off(body: dict) -> None:
    """400 for a field that needs what this server does not do, unless it says "off"."""
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise invalid(name, f"{name} is not supported by this server: {why}", code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("truncation", "truncation must be 'disabled': a prompt past the context is refused, not cut")
    reasoning = body.get("reasoning")
    if reasoning is not None and not (isinstance(reasoning, dict) and all(v is None for v in reasoning.values())):
        raise invalid("reasoning", "reasoning options are not served (the model's template decides)")


def _logprobs(body: dict) -> tuple[bool, int | None]:
    """(whether the output text's token logprobs are asked for, top_logprobs as given): `include`
    may name message.output_text.logprobs only; top_logprobs 0 to MAX_LOGPROBS, more than 0 asks too."""
    include, top = body.get("include"), body.get("top_logprobs")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise invalid("include", "include must be a list of strings")
    other = next((v for v in include if v != LOGPROBS_INCLUDE), None)
    if other is not None:
        raise invalid("include", f"include: {other[:64]!r} is not served (only {LOGPROBS_INCLUDE!r})")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise invalid("top_logprobs", f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}")
    return bool(include) or bool(top), top


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise invalid("input", f"{where}.{key} must be a non-empty string")
    return value


def _call_item(item: dict, where: str) -> dict:
    """A function_call input item (a call the model made) as a chat tool call."""
    name, call_id, arguments = (_string(item, k, where) for k in ("name", "call_id", "arguments"))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _messages(body: dict) -> list[dict]:
    """The request's input as chat messages (its instructions apart)."""
    inp = body.get("input")
    if isinstance(inp, str):
        out = [{"role": "user", "content": inp}]
    elif isinstance(inp, list) and inp:
        out = []
        for i, item in enumerate(inp):
            where = f"input[{i}]"
            kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
            if kind == "function_call":  # the calls of one turn: one assistant message's tool_calls
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                    last.setdefault("tool_calls", []).append(_call_item(item, where))
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [_call_item(item, where)]})
                continue
            if kind == "function_call_output":  # a call's result: a tool turn
                output = item.get("output")
                if not isinstance(output, str):
                    raise invalid("input", f"{where}.output must be a string (the call's result)")
                out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
                continue
            if kind != "message":
                raise invalid(
                    "input",
                    f"{where}: items of type {str(kind)[:40]!r} are not served (messages, function_call and "
                    "function_call_output)",
                )
            role = ROLES.get(item.get("role"))
            if role is None:
                raise invalid("input", f"{where}.role must be one of {', '.join(ROLES)}")
            content = item.get("content")
            if isinstance(content, list):
                if not all(
                    isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
                    for p in content
                ):
                    raise invalid("input", f"{where}.content: only text parts ({', '.join(TEXT_PARTS)}) are served")
                content = [{"type": "text", "text": p["text"]} for p in content]
            elif not isinstance(content, str):
                raise invalid("input", f"{where}.content must be a string or a list of text parts")
            out.append({"role": role, "content": content})
    else:
        raise invalid("input", "input must be a string or a non-empty list of messages")
    return out


def _format(body: dict) -> tuple[dict, dict | None]:
    """(text.format as echoed, the chat response_format it means, or None)."""
    text = body.get("text")
    if text is None:
        return {"type": "text"}, None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid("text", "text must be an object of format (and verbosity)")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return fmt, None
    if kind == "json_object":
        return fmt, {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return fmt, {"type": "json_schema", "json_schema": schema}
    raise invalid("text", "text.format must be {type: text}, {type: json_object} or {type: json_schema, name, schema}")


def _tools(body: dict) -> tuple[list, Any]:
    """The chat request's tools and tool_choice from the Responses API's (function tools, flat:
    {type: function, name, description, parameters, strict}); hosted tools are refused by name."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise invalid("tools", "tools must be a list of function tools")
    chat = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise invalid(
                "tools",
                f"tools[{i}]: tools of type {str(kind)[:40]!r} are not served (function tools only: this server "
                "runs no hosted tool)",
                "unsupported_parameter",
            )
        unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise invalid("tools", f"tools[{i}]: {unknown[0][:40]!r} is not a field of a function tool")
        chat.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise invalid(
                "tool_choice",
                "tool_choice must be auto, none, required or {type: function, name}",
                "unsupported_parameter",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return chat, choice


def _metadata(body: dict) -> dict[str, str]:
    md = body.get("metadata")
    if md is None:
        return {}
    if (
        not isinstance(md, dict)
        or len(md) > MAX_METADATA
        or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in md.items())
    ):
        raise invalid(
            "metadata", f"metadata must be at most {MAX_METADATA} string keys (≤ 64 chars) and values (≤ 512)"
        )
    return dict(md)


def to_chat(body: Any, previous: Stored | None = None, keeping: bool = False) -> tuple[dict, ResponsesInfo]:
    """The chat request a Responses request means, and what its answer echoes. 400 (ApiError) naming
    the field for what is not served. previous: the stored response previous_response_id names (the
    caller looked it up); keeping: whether the gateway keeps answers (a store)."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", code="invalid_json")
    unknown = next((k for k in body if k not in (*PASSED, *READ, *OFF, *IGNORED, *REFUSED)), None)
    if unknown is not None:
        shown = str(unknown)[:64]
        raise invalid(
            shown, f"{shown} is not supported by /v1/responses (docs/gateway.md)", code="unsupported_parameter"
        )
    _check_off(body)
    prev_id = previous_id(body)
    if prev_id is not None and previous is None:
        raise invalid(
            "previous_response_id",
            "previous_response_id is not supported by this server: it keeps no responses (start the gateway "
            "with --responses-store N, or send the whole conversation as input)",
            code="unsupported_parameter",
        )
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid("store", "store must be true or false")
    if previous is not None and previous.response["status"] in RUNNING:
        raise invalid("previous_response_id", f"response {prev_id[:64]!r} is still {previous.response['status']}")
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise invalid("background", "background must be true or false")
    if background and not keeping:
        raise invalid(
            "background",
            "background responses are not supported by this server: it keeps no responses to read them from "
            "(start the gateway with --responses-store N)",
            code="unsupported_parameter",
        )
    if background and store is False:
        raise invalid("background", "a background response is read from the store: store must be true")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "instructions must be a string")
    chat = {k: body[k] for k in PASSED if k in body}
    conversation = (*(previous.conversation if previous else ()), *_messages(body))
    system = [{"role": "system", "content": instructions}] if instructions is not None else []
    chat["messages"] = [*system, *conversation]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    echoed, response_format = _format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    tools, choice = _tools(body)
    logprobs, top = _logprobs(body)
    if logprobs:
        if tools:
            raise invalid(
                "include",
                "token logprobs beside function tools are not served by /v1/responses (the calls are cut from "
                "the text the tokens make)",
            )
        chat["logprobs"], chat["top_logprobs"] = True, top or 0
    if tools:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice  # chat's parser checks it (a choice without tools, a name it lacks)
    user = body.get("user")
    info = ResponsesInfo(
        id="resp_" + uuid.uuid4().hex,
        created_at=int(time.time()),
        instructions=body.get("instructions"),
        max_output_tokens=body.get("max_output_tokens"),
        text_format=echoed,
        metadata=_metadata(body),
        user=user if isinstance(user, str) else None,
        tools=list(body.get("tools") or []),
        tool_choice=body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        logprobs=logprobs,
        top_logprobs=top,
        store=keeping and store is not False,
        previous_response_id=prev_id,
        background=bool(background),
        conversation=conversation,
    )
    return chat, info


def renamed(e: ApiError) -> ApiError:
    """A chat parser's error in the Responses API's words (max_tokens -> max_output_tokens, ...)."""

    def words(text: str) -> str:  # the longer chat names first (RENAMED's order)
        for chat_name, name in RENAMED.items():
            text = text.replace(chat_name, name)
        return text

    return ApiError(e.status, words(e.message), type=e.type, param=e.param and words(e.param), code=e.code)


def _usage(u: gen_pb.Usage | None, reasoning_tokens: int = 0) -> dict | None:
    if u is None:
        return None
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},  # the usage the router reports has no cached count
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},  # the thinking's (--reasoning-parser)
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _message(item_id: str, text: str | None, status: str, logprobs: list[dict] | None = None) -> dict:
    """An assistant message item; logprobs: its tokens' (chat's content entries: token, logprob, bytes,
    top_logprobs), OpenAI's output_text logprobs."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}
    content = [] if text is None else [part]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning(item_id: str, text: str | None) -> dict:
    """The thinking (a reasoning parser's) as the Responses API's reasoning item, before the message."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "encrypted_content": None}


def _function_call(c: Call, arguments: str | None = None, status: str = "completed") -> dict:
    """A call the model made as the Responses API's output item (its call_id: the chat call's id)."""
    args = c.arguments if arguments is None else arguments
    item = "fc_" + c.id.removeprefix("call_")
    return {"type": "function_call", "id": item, "call_id": c.id, "name": c.name, "arguments": args, "status": status}


def response(
    info: ResponsesInfo,
    r: Request,
    status: str,
    output: list[dict],
    finish: str | None = None,
    usage: gen_pb.Usage | None = None,
    reasoning_tokens: int = 0,
    error: dict | None = None,
) -> dict:
    """The response object: `status` queued or in_progress (running), completed or incomplete (finish
    "length": the max_output_tokens reason), failed (`error`: its code and message) or cancelled."""
    s = r.sampling
    return {
        "id": info.id,
        "object": "response",
        "created_at": info.created_at,
        "status": status,
        "background": info.background,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"}
        if status == "incomplete" and finish == "length"
        else None,
        "instructions": info.instructions,
        "max_output_tokens": info.max_output_tokens,
        "model": r.model,
        "output": output,
        "parallel_tool_calls": info.parallel_tool_calls,
        "previous_response_id": info.previous_response_id,
        "reasoning": None,
        "store": info.store,
        "temperature": s.temperature,
        "top_logprobs": info.top_logprobs,
        "text": {"format": info.text_format},
        "tool_choice": info.tool_choice,
        "tools": info.tools,
        "top_p": s.top_p,
        "truncation": "disabled",
        "usage": _usage(usage, reasoning_tokens),
        "user": info.user,
        "metadata": info.metadata,
    }


def whole(
    info: ResponsesInfo,
    r: Request,
    text: str | None,
    finish: str,
    usage: gen_pb.Usage,
    calls: tuple[Call, ...] = (),
    reasoning: str | None = None,
    reasoning_tokens: int = 0,
    logprobs: list[dict] | None = None,
) -> dict:
    """The whole answer: a reasoning item where a reasoning parser found a thinking, an assistant
    message of one output_text part (with its tokens' logprobs where asked: chat's content entries),
    unless the model only called tools, then a function_call item per call."""
    status = "incomplete" if finish == "length" else "completed"
    output = [_reasoning("rs_" + uuid.uuid4().hex, reasoning)] if reasoning else []  # as the stream: text only
    if text is not None or not calls:
        output.append(_message("msg_" + uuid.uuid4().hex, text or "", status, logprobs))
    output += [_function_call(c) for c in calls]
    return response(info, r, status, output, finish, usage, reasoning_tokens)


class Events:
    """The stream's events in order, each with its sequence_number: `start()` (created, in_progress),
    `thought(text)` per piece of a thinking (a reasoning parser's: the reasoning item added before
    the first, done before the message), `delta(text, logprobs)` per piece with its tokens' logprobs
    (the message and its text part added before the first), `end(finish, usage, calls)` (the text,
    the part and the message done, then each function_call item added, its arguments, done, then
    completed or incomplete), or `error(e)`."""

    def __init__(self, info: ResponsesInfo, r: Request):
        self.info, self.r, self.n = info, r, 0
        self.item = "msg_" + uuid.uuid4().hex
        self.text: list[str] = []
        self.logprobs: list[dict] = []  # the message's tokens' (chat's content entries), where asked
        self.started = False  # the message item is out (its first text came)
        self.reasoning_item = "rs_" + uuid.uuid4().hex
        self.thinking: list[str] | None = None  # the reasoning item's text, once it is out
        self.reasoned: dict | None = None  # the reasoning item, done
        self.at = 0  # the message's output_index: 1 after a reasoning item
        self.reasoning_tokens = 0
        self.final: dict | None = None  # the response object, once end() made it

    def thought(self, text: str) -> bytes:
        head = b""
        if self.thinking is None:
            self.thinking = []
            item = {**_reasoning(self.reasoning_item, None), "status": "in_progress"}
            head = self._event("response.output_item.added", output_index=0, item=item)
        self.thinking.append(text)
        return head + self._event(
            "response.reasoning_text.delta", output_index=0, item_id=self.reasoning_item, content_index=0, delta=text
        )

    def _thinking_done(self) -> bytes:
        if self.thinking is None or self.reasoned is not None:
            return b""
        text = "".join(self.thinking)
        self.reasoned, self.at = _reasoning(self.reasoning_item, text), 1
        at = {"output_index": 0, "item_id": self.reasoning_item, "content_index": 0}
        return self._event("response.reasoning_text.done", **at, text=text) + self._event(
            "response.output_item.done", output_index=0, item=self.reasoned
        )

    def _event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def start(self) -> bytes:
        return b"".join(
            (
                self._event("response.created", response=response(self.info, self.r, "in_progress", [])),
                self._event("response.in_progress", response=response(self.info, self.r, "in_progress", [])),
            )
        )

    def _message_start(self) -> bytes:
        self.started = True
        at = {"output_index": self.at, "item_id": self.item, "content_index": 0}
        return b"".join(
            (
                self._event(
                    "response.output_item.added", output_index=self.at, item=_message(self.item, None, "in_progress")
                ),
                self._event(
                    "response.content_part.added",
                    **at,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                ),
            )
        )

    def delta(self, text: str, logprobs: list[dict] = ()) -> bytes:
        head = self._thinking_done() + (b"" if self.started else self._message_start())
        self.text.append(text)
        self.logprobs += logprobs
        return head + self._event(
            "response.output_text.delta",
            output_index=self.at,
            item_id=self.item,
            content_index=0,
            delta=text,
            logprobs=list(logprobs),
        )

    def end(self, finish: str, usage: gen_pb.Usage, calls: tuple[Call, ...] = ()) -> bytes:
        text = "".join(self.text)
        status = "incomplete" if finish == "length" else "completed"
        out = [self._thinking_done()]
        output = [] if self.reasoned is None else [self.reasoned]
        if self.started or not calls:  # an answer of calls alone has no message
            if not self.started:
                out.append(self._message_start())
            at = {"output_index": self.at, "item_id": self.item, "content_index": 0}
            message = _message(self.item, text, status, self.logprobs)
            output.append(message)
            out += [
                self._event("response.output_text.done", **at, text=text, logprobs=self.logprobs),
                self._event("response.content_part.done", **at, part=message["content"][0]),
                self._event("response.output_item.done", output_index=self.at, item=message),
            ]
        for c in calls:  # each call whole: its arguments in one delta
            k, item = len(output), _function_call(c)
            out += [
                self._event("response.output_item.added", output_index=k, item=_function_call(c, "", "in_progress")),
                self._event(
                    "response.function_call_arguments.delta", output_index=k, item_id=item["id"], delta=c.arguments
                ),
                self._event(
                    "response.function_call_arguments.done",
                    output_index=k,
                    item_id=item["id"],
                    name=c.name,
                    arguments=c.arguments,
                ),
                self._event("response.output_item.done", output_index=k, item=item),
            ]
            output.append(item)
        done = self.final = response(self.info, self.r, status, output, finish, usage, self.reasoning_tokens)
        out.append(self._event("response.completed" if status == "completed" else "response.incomplete", response=done))
        return b"".join(out)

    def error(self, e: ApiError) -> bytes:
        return self.failure(e.code, e.body()["error"]["message"], e.param)

    def failure(self, code: str | None, message: str, param: str | None) -> bytes:
        """The error event (numbered as the next; a stream refused before its first: 0)."""
        return self._event("error", code=code, message=message, param=param)


__all__ = [
    "Events",
    "ResponseStore",
    "ResponsesInfo",
    "Stored",
    "previous_id",
    "renamed",
    "response",
    "to_chat",
    "turns",
    "whole",
]
