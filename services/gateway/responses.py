"""OpenAI's Responses API (`POST /v1/responses`), stateless and text-only, as vLLM serves it without
its response store: a request becomes the chat request it means (`to_chat`: `instructions` a system
message first, `input` the messages, `max_output_tokens`, `text.format` as response_format), runs
as one, and is answered as a `response` object, or as its stream of typed events
(response.created, ..., response.output_text.delta, ..., response.completed).

    chat_body, info = to_chat(body)          # 400 (ApiError) naming the Responses field
    whole(info, r, text, finish, usage)      # the response object
    Events(info, r)                          # the stream's events, numbered

Nothing is stored: `store` is answered false, and what needs a stored response or a tool the model
calls (`previous_response_id`, `conversation`, `background`, `tools`) is refused by name, as is any
field this module does not know.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.generation import MAX_LOGPROBS
from services.gateway.protocol import ApiError, Request, invalid

# The roles of input messages (a developer message is the system's, as OpenAI treats it)
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA = 16  # OpenAI's limit: keys of at most 64 characters, values of at most 512
# Responses field -> the chat field it becomes (errors from the chat parser name the Responses one)
RENAMED = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
}
# Fields passed to the chat request as they are: OpenAI's sampling ones and vLLM's extras
PASSED = ("model", "temperature", "top_p", "stream", "top_k", "min_p", "repetition_penalty", "seed", "priority")
PASSED += ("cache_salt", "stop", "chat_template_kwargs")
READ = ("instructions", "input", "max_output_tokens", "text", "metadata", "user")  # to_chat's own
# Fields served only "off" (_check_off): no tools, no truncation, no reasoning options, ...
OFF = ("background", "tools", "tool_choice", "truncation", "reasoning", "top_logprobs", "include")
# Fields that do not change the answer here
IGNORED = ("safety_identifier", "prompt_cache_key", "service_tier", "parallel_tool_calls", "store")
IGNORED += ("stream_options", "max_tool_calls")
# Fields refused whatever their value (but null), with why
REFUSED = {
    "previous_response_id": "this server keeps no responses (send the whole conversation as input)",
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


def _check_off(body: dict) -> None:
    """400 for a field that needs what this server does not do, unless it says "off"."""
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise invalid(name, f"{name} is not supported by this server: {why}", code="unsupported_parameter")
    if body.get("background"):
        raise invalid("background", "background is not supported: responses are answered while the request waits")
    if body.get("tools"):
        raise invalid(
            "tools", "tools are not served by /v1/responses; use /v1/chat/completions", "unsupported_parameter"
        )
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise invalid("tool_choice", "tool_choice needs tools, which /v1/responses does not serve")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("truncation", "truncation must be 'disabled': a prompt past the context is refused, not cut")
    reasoning = body.get("reasoning")
    if reasoning is not None and not (isinstance(reasoning, dict) and all(v is None for v in reasoning.values())):
        raise invalid("reasoning", "reasoning options are not served (the model's template decides)")
    if body.get("top_logprobs") not in (None, 0):
        raise invalid("top_logprobs", f"top_logprobs (0 to {MAX_LOGPROBS}) is not served by /v1/responses")
    if body.get("include") not in (None, []):
        raise invalid("include", "include: no extra output items are served")


def _messages(body: dict) -> list[dict]:
    inp = body.get("input")
    if isinstance(inp, str):
        out = [{"role": "user", "content": inp}]
    elif isinstance(inp, list) and inp:
        out = []
        for i, item in enumerate(inp):
            where = f"input[{i}]"
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                kind = item.get("type") if isinstance(item, dict) else type(item).__name__
                raise invalid("input", f"{where}: items of type {str(kind)[:40]!r} are not served (messages only)")
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
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "instructions must be a string")
        out.insert(0, {"role": "system", "content": instructions})
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


def to_chat(body: Any) -> tuple[dict, ResponsesInfo]:
    """The chat request a Responses request means, and what its answer echoes. 400 (ApiError) naming
    the field for what is not served."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", code="invalid_json")
    unknown = next((k for k in body if k not in (*PASSED, *READ, *OFF, *IGNORED, *REFUSED)), None)
    if unknown is not None:
        shown = str(unknown)[:64]
        raise invalid(
            shown, f"{shown} is not supported by /v1/responses (docs/gateway.md)", code="unsupported_parameter"
        )
    _check_off(body)
    chat = {k: body[k] for k in PASSED if k in body}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    echoed, response_format = _format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    user = body.get("user")
    info = ResponsesInfo(
        id="resp_" + uuid.uuid4().hex,
        created_at=int(time.time()),
        instructions=body.get("instructions"),
        max_output_tokens=body.get("max_output_tokens"),
        text_format=echoed,
        metadata=_metadata(body),
        user=user if isinstance(user, str) else None,
    )
    return chat, info


def renamed(e: ApiError) -> ApiError:
    """A chat parser's error in the Responses API's words (max_tokens -> max_output_tokens, ...)."""

    def words(text: str) -> str:  # the longer chat names first (RENAMED's order)
        for chat_name, name in RENAMED.items():
            text = text.replace(chat_name, name)
        return text

    return ApiError(e.status, words(e.message), type=e.type, param=e.param and words(e.param), code=e.code)


def _usage(u: gen_pb.Usage | None) -> dict | None:
    if u is None:
        return None
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},  # the usage the router reports has no cached count
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _message(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def response(
    info: ResponsesInfo,
    r: Request,
    status: str,
    output: list[dict],
    finish: str | None = None,
    usage: gen_pb.Usage | None = None,
) -> dict:
    """The response object: `status` in_progress, completed or incomplete (finish "length": the
    max_output_tokens reason)."""
    s = r.sampling
    return {
        "id": info.id,
        "object": "response",
        "created_at": info.created_at,
        "status": status,
        "completed_at": int(time.time()) if status != "in_progress" else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"}
        if status == "incomplete" and finish == "length"
        else None,
        "instructions": info.instructions,
        "max_output_tokens": info.max_output_tokens,
        "model": r.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": s.temperature,
        "text": {"format": info.text_format},
        "tool_choice": "auto",
        "tools": [],
        "top_p": s.top_p,
        "truncation": "disabled",
        "usage": _usage(usage),
        "user": info.user,
        "metadata": info.metadata,
    }


def whole(info: ResponsesInfo, r: Request, text: str, finish: str, usage: gen_pb.Usage) -> dict:
    """The whole answer: one assistant message of one output_text part."""
    status = "incomplete" if finish == "length" else "completed"
    return response(info, r, status, [_message("msg_" + uuid.uuid4().hex, text, status)], finish, usage)


class Events:
    """The stream's events in order, each with its sequence_number: `start()` (created, in_progress,
    the message and its text part added), `delta(text)` per piece, `end(finish, usage)` (the text
    done, the part and the message done, then completed or incomplete), or `error(e)`."""

    def __init__(self, info: ResponsesInfo, r: Request):
        self.info, self.r, self.n = info, r, 0
        self.item = "msg_" + uuid.uuid4().hex
        self.text: list[str] = []

    def _event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def start(self) -> bytes:
        at = {"output_index": 0, "item_id": self.item, "content_index": 0}
        return b"".join(
            (
                self._event("response.created", response=response(self.info, self.r, "in_progress", [])),
                self._event("response.in_progress", response=response(self.info, self.r, "in_progress", [])),
                self._event(
                    "response.output_item.added", output_index=0, item=_message(self.item, None, "in_progress")
                ),
                self._event(
                    "response.content_part.added",
                    **at,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                ),
            )
        )

    def delta(self, text: str) -> bytes:
        self.text.append(text)
        return self._event(
            "response.output_text.delta", output_index=0, item_id=self.item, content_index=0, delta=text, logprobs=[]
        )

    def end(self, finish: str, usage: gen_pb.Usage) -> bytes:
        text = "".join(self.text)
        status = "incomplete" if finish == "length" else "completed"
        at = {"output_index": 0, "item_id": self.item, "content_index": 0}
        message = _message(self.item, text, status)
        done = response(self.info, self.r, status, [message], finish, usage)
        return b"".join(
            (
                self._event("response.output_text.done", **at, text=text, logprobs=[]),
                self._event("response.content_part.done", **at, part=message["content"][0]),
                self._event("response.output_item.done", output_index=0, item=message),
                self._event("response.completed" if status == "completed" else "response.incomplete", response=done),
            )
        )

    def error(self, e: ApiError) -> bytes:
        return self._event("error", code=e.code, message=e.body()["error"]["message"], param=e.param)


__all__ = ["Events", "ResponsesInfo", "renamed", "response", "to_chat", "whole"]
