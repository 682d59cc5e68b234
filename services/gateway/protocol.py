"""OpenAI's request and response shapes <-> the router's Generate, and its error shape.

Only translation lives here (no I/O): `parse_completion` / `parse_chat` check a JSON body and
return a `Request` (or raise `ApiError` naming the field), the `*_response` / `*_chunk` builders
write OpenAI's objects, and `error_of_rpc` maps a router status to an HTTP error.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.generation import (
    DEFAULTABLE,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGPROBS,
    MAX_N,
    Constraint,
    ConstraintKind,
    FinishReason,
    GenerationError,
    Sampling,
    SamplingDefaults,
    check_integer,
    check_number,
)
from bitdelta.rpc.errors import without_addresses
from services.gateway import fields
from services.gateway.chat import ChatTemplateError, check_template_kwargs
from services.gateway.reasoning import Reasoning
from services.gateway.tools import Call, CallStream, ToolError, ToolFormat, Tools, parse_tools

MAX_STOP = 4  # OpenAI's limit on `stop` strings
MAX_SEED = 2**64 - 1

FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop"}  # OpenAI's words


class ApiError(Exception):
    """An error in OpenAI's shape: HTTP status, `type`, `param` (the request field) and `code`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        """The JSON body; the message names no address of the deployment (the router's, say)."""
        return {
            "error": {
                "message": without_addresses(self.message),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# gRPC status -> (HTTP status, OpenAI error type, code). FAILED_PRECONDITION (e.g. a variant built for
# another base) is 400 and ABORTED 409, as in Google's gRPC <-> HTTP mapping (google/rpc/code.proto).
STATUS_HTTP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "model_not_servable"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.ABORTED: (409, "conflict_error", "aborted"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error", "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", "not_implemented"),
}

# The field an INVALID_ARGUMENT from the router (or a worker) names ("sampling.top_k: ..."), in OpenAI's terms.
_PARAM_RE = re.compile(r"^(?:sampling\.)?(\w+):")
_PARAMS = {"model_id": "model", "max_new_tokens": "max_tokens"}


def param_of(field_name: str) -> str | None:
    """The request field a `GenerationError.field` (or an error message's first word) names."""
    name = field_name.removeprefix("sampling.")
    name = _PARAMS.get(name, name)
    return name if name in fields.BY_NAME else None


def error_of_rpc(code: grpc.StatusCode, details: str, prompt_param: str = "prompt") -> ApiError:
    status, type_, code_name = STATUS_HTTP.get(code, (500, "server_error", "internal_error"))
    param = None
    if status == 400:
        m = _PARAM_RE.match(details)
        if m:
            param = prompt_param if m.group(1) in ("prompt", "prompt_token_ids") else param_of(m.group(1))
    elif status == 404:
        param = "model"
    return ApiError(status, details or code.name, type=type_, param=param, code=code_name)


# -- requests ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, or token ids used as they are (vLLM's token prompts; `text` then "")."""

    text: str = ""
    token_ids: tuple[int, ...] = ()


@dataclass
class Request:
    """One generation asked for in OpenAI's terms, ready for the router."""

    kind: str  # "completion" or "chat"
    model: str
    # completions: 1 to MAX_PROMPTS (fields), each its own generation of n choices (prompt k's choice i is choice
    # k·n + i, as in vLLM); chat: the rendered template, filled in by the app
    prompts: tuple[Prompt, ...] = ()
    messages: list[dict[str, Any]] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)  # max_new_tokens 0: the router's default
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    # completions: the prompt before each choice's text (and its logprobs); chat (vLLM's): the last
    # message's content before each choice's, when that message has the answer's role
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs, ranks, this many alternatives
    # vLLM's: the tokenizer adds its special tokens (BOS) to a text prompt; chat's template writes its own
    add_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: the prompt's token ids and each choice's, beside the text
    priority: int = 0  # vLLM's: lower first, FIFO within one value
    constraint_param: str | None = None  # the field sampling.constraint came from (errors name it)
    cache_salt: str = ""  # vLLM's: only requests with the same salt share prefix-cached KV blocks
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    tools: Tools | None = None  # chat: the tools, tool_choice and parallel_tool_calls
    # chat, vLLM's: how the template renders the messages (chat.ChatTemplate.render)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    documents: list[dict[str, str]] | None = None  # vLLM's: the template's documents (a RAG template's)
    # chat, vLLM's --reasoning-parser (the app sets it): the thinking answered as `reasoning`, apart from
    # the content; include_reasoning false drops it
    reasoning: Reasoning | None = None
    include_reasoning: bool = True
    tool_format: ToolFormat = ToolFormat.HERMES  # how the model's chat template writes a call (the app sets it)
    id: str = ""
    created: int = 0

    @property
    def role(self) -> str:
        """Chat: the answer's role, as vLLM's: the assistant's after a generation prompt, else the last
        message's (the prompt continues it)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1]["role"]

    def chat_echo(self) -> str | None:
        """Chat's echo: the last message's content (its text parts joined by newlines, as vLLM's), when it
        has the answer's role; else None."""
        last, content = self.messages[-1], self.messages[-1]["content"]
        text = "\n".join(p["text"] for p in content) if isinstance(content, list) else content
        return text if self.echo and last["role"] == self.role and text else None


def _checked(name: str, check: Callable[[], Any]) -> Any:
    """check()'s value, or 400 naming the field ("temperature must be ...")."""
    try:
        return check()
    except GenerationError as e:
        raise invalid(name, str(e).replace(f"{name}: ", f"{name} ", 1)) from None


def _number(body: dict, name: str, default: float, lo: float, hi: float, low_open: bool = False) -> float:
    v = body.get(name)
    return default if v is None else _checked(name, lambda: check_number(name, v, lo, hi, low_open))


def _is_off(value: Any, off: tuple) -> bool:
    """`value` is one of `off` (type and value: `0` is not `false`)."""
    return any(type(value) is type(o) and value == o for o in off)


def check_fields(body: dict, kind: str) -> None:
    """400 `unsupported_parameter` naming the first field that this endpoint neither honours nor may
    ignore (`fields.FIELDS`); null, or a refused field's value that means "off", passes."""
    for name, value in body.items():
        f = fields.BY_NAME.get(name)
        use = f.use(kind) if f is not None else None
        if use in (fields.Use.HONOURED, fields.Use.IGNORED) or value is None:
            continue
        if use is fields.Use.REFUSED and _is_off(value, f.off):
            continue
        shown = str(name)[:64]
        why = f": {f.note}" if use is fields.Use.REFUSED and f.note else ""
        raise invalid(
            shown,
            f"{shown} is not supported by this server{why} (docs/gateway.md lists every field)",
            code="unsupported_parameter",
        )


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    return None if v is None else _checked(name, lambda: check_integer(name, v, lo, hi))


def _salt(body: dict) -> str:
    v = body.get("cache_salt")
    if v is None:
        return ""
    if not isinstance(v, str) or not v or len(v) > MAX_CACHE_SALT_CHARS:
        raise invalid(
            "cache_salt", f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"
        )
    return v


def _common(body: Any, kind: str, defaults: SamplingDefaults) -> Request:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model must be a non-empty string: the variant's id from /v1/models")
    check_fields(body, kind)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stops = tuple(stop)
    else:
        raise invalid("stop", f"stop must be a string or a list of at most {MAX_STOP} strings")
    if any(not s for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    seed = _integer(body, "seed", 0, MAX_SEED)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream", "stream must be true or false")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("stream_options", "stream_options must be an object")
    include_usage = (opts or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options", "stream_options.include_usage must be true or false")
    continuous = (opts or {}).get("continuous_usage_stats", False)  # vLLM's: usage on every chunk
    if not isinstance(continuous, bool):
        raise invalid("stream_options", "stream_options.continuous_usage_stats must be true or false")
    if set(opts or {}) - {"include_usage", "continuous_usage_stats"}:
        raise invalid(
            "stream_options",
            f"stream_options: only include_usage and continuous_usage_stats are supported, got {sorted(opts)}"[:200],
            code="unsupported_parameter",
        )
    continuous = include_usage and continuous  # vLLM's rule: only with include_usage
    if include_usage and not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    prompt_logprobs = _integer(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt_logprobs is not None and stream:
        raise invalid("prompt_logprobs", "prompt_logprobs are not returned in a stream (as vLLM): use stream: false")
    constraint, constraint_param = parse_constraint(body)
    return_ids = _boolean(body, "return_token_ids")
    sampling = Sampling(
        constraint=constraint,
        **_defaulted(body, defaults),
        stop=stops,
        seed=seed,
        n=_integer(body, "n", 1, MAX_N) or 1,
        truncate_prompt_tokens=_integer(body, "truncate_prompt_tokens", -1, 2**31 - 1),  # 0: Sampling.validate
        prompt_logprobs=prompt_logprobs,
        return_prompt_token_ids=return_ids or continuous,  # continuous usage counts the prompt's ids
        **_vllm_sampling(body),
    )
    return Request(
        kind=kind,
        model=model,
        sampling=sampling,
        tokens_as_ids=_boolean(body, "return_tokens_as_token_ids"),
        add_special_tokens=_boolean(body, "add_special_tokens", default=kind == "completion"),
        return_token_ids=return_ids,
        prompt_logprobs=prompt_logprobs,
        constraint_param=constraint_param,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        priority=_integer(body, "priority", -(2**31), 2**31 - 1) or 0,
        cache_salt=_salt(body),
        id=("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex,
        created=int(time.time()),
    )


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"{name} must be true or false")
    return v


def _are_ids(v: Any) -> bool:
    """A list of token ids: integers in uint32's range (the worker checks them against its vocabulary)."""
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in v)


def _token_ids(body: dict, name: str) -> tuple[int, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if not _are_ids(v):
        raise invalid(name, f"{name} must be a list of token ids (integers >= 0)")
    return tuple(v)


def _bad_words(body: dict) -> tuple[str, ...]:
    v = body.get("bad_words")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(w, str) and w.strip() for w in v):
        raise invalid("bad_words", "bad_words must be a list of words (non-blank strings)")
    return tuple(v)


def _allowed(body: dict) -> tuple[int, ...]:
    """vLLM's allowed_token_ids: a non-empty list (empty would allow nothing)."""
    ids = _token_ids(body, "allowed_token_ids")
    if body.get("allowed_token_ids") is not None and not ids:
        raise invalid("allowed_token_ids", "allowed_token_ids must name at least one token")
    return ids


def _prompts(v: Any) -> tuple[Prompt, ...]:
    """OpenAI's `prompt`: a string, token ids, or a list of up to MAX_PROMPTS (fields) of either (none empty)."""
    what = f"a non-empty string, a non-empty list of token ids (integers >= 0), or a list of up to {fields.MAX_PROMPTS} of either"
    if isinstance(v, str) and v:
        return (Prompt(text=v),)
    if not isinstance(v, list) or not v:
        raise invalid("prompt", f"prompt must be {what}")
    if _are_ids(v):
        return (Prompt(token_ids=tuple(v)),)
    if len(v) > fields.MAX_PROMPTS:
        raise invalid("prompt", f"prompt: {len(v)} prompts; at most {fields.MAX_PROMPTS} in one request")
    out = []
    for k, p in enumerate(v):
        if isinstance(p, str) and p:
            out.append(Prompt(text=p))
        elif p and _are_ids(p):
            out.append(Prompt(token_ids=tuple(p)))
        else:
            raise invalid("prompt", f"prompt[{k}] must be a non-empty string or a non-empty list of token ids")
    return tuple(out)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (the keys are strings in JSON)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise invalid("logit_bias", "logit_bias must be an object of token id -> bias")
    out = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isdigit()) or isinstance(b, bool) or not isinstance(b, (int, float)):
            raise invalid("logit_bias", f"logit_bias: {str(k)[:20]!r}: keys are token ids, values numbers")
        out[int(k)] = float(b)
    return tuple(sorted(out.items()))


NEUTRAL = SamplingDefaults()  # every model's defaults when the gateway has no generation config


def _defaulted(body: dict, d: SamplingDefaults) -> dict:
    """The sampling fields a model's generation config may set (DEFAULTABLE, their rules): the
    body's, else d's."""
    out = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        _, lo, hi, low_open = DEFAULTABLE[name]
        out[name] = _number(body, name, getattr(d, name), lo, hi, low_open)
    top_k = _integer(body, "top_k", *DEFAULTABLE["top_k"][1:3])
    out["top_k"] = d.top_k if top_k is None else max(top_k, 0)  # vLLM's -1 (and 0): no limit
    return out


def _vllm_sampling(body: dict) -> dict:
    """The sampling fields beyond OpenAI's temperature/top_p/stop/seed and those a generation config
    may default (vLLM's names and meanings)."""
    return {
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "logit_bias": _logit_bias(body),
        "stop_token_ids": _token_ids(body, "stop_token_ids"),
        "allowed_token_ids": _allowed(body),
        "skip_special_tokens": _boolean(body, "skip_special_tokens", default=True),
        "bad_words": _bad_words(body),
        "min_tokens": _integer(body, "min_tokens", 0, 1 << 31) or 0,
        "ignore_eos": _boolean(body, "ignore_eos"),
        "include_stop_str_in_output": _boolean(body, "include_stop_str_in_output"),
    }


def _schema_text(param: str, schema: Any) -> str:
    """A JSON schema given as an object (or, as vLLM takes it, as JSON text) -> its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise invalid(param, f"{param}: the schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise invalid(param, f"{param}: the schema must be a JSON object")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _response_format(v: Any) -> Constraint | None:
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict, description}."""
    p = "response_format"
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text" and set(v) == {"type"}:
        return None
    if kind == "json_object" and set(v) == {"type"}:
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "json_schema" and set(v) == {"type", "json_schema"}:
        js = v["json_schema"]
        if not isinstance(js, dict) or set(js) - {"name", "schema", "strict", "description"}:
            raise invalid(p, "response_format.json_schema must be an object of name, schema, strict and description")
        name = js.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise invalid(p, "response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'")
        if not isinstance(js.get("strict", False), (bool, type(None))):
            raise invalid(p, "response_format.json_schema.strict must be true or false")
        if "schema" not in js:
            raise invalid(p, "response_format.json_schema.schema: the JSON schema is missing")
        return Constraint(ConstraintKind.JSON_SCHEMA, _schema_text("response_format.json_schema.schema", js["schema"]))
    raise invalid(
        p,
        "response_format must be {type: text}, {type: json_object} or {type: json_schema, json_schema: {name, schema}}",
    )


def _string(param: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise invalid(param, f"{param} must be a non-empty string")
    return v


def _choices(param: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
        raise invalid(param, f"{param} must be a non-empty list of strings")
    return tuple(v)


# vLLM's guided_* fields and the keys of its structured_outputs (the same meanings)
_GUIDED = {
    "json": lambda p, v: Constraint(ConstraintKind.JSON_SCHEMA, _schema_text(p, v)),
    "regex": lambda p, v: Constraint(ConstraintKind.REGEX, _string(p, v)),
    "choice": lambda p, v: Constraint(ConstraintKind.CHOICE, choices=_choices(p, v)),
    "grammar": lambda p, v: Constraint(ConstraintKind.GRAMMAR, _string(p, v)),
}


def _structured_outputs(v: Any) -> Constraint:
    p = "structured_outputs"
    if not isinstance(v, dict):
        raise invalid(p, "structured_outputs must be an object with one of json, regex, choice, grammar, json_object")
    given = {k: x for k, x in v.items() if x is not None and x is not False}
    extra = set(given) - {*_GUIDED, "json_object"}
    if extra:
        raise invalid(
            p,
            f"structured_outputs: {sorted(extra)} not supported (one of json, regex, choice, grammar, json_object)"[
                :200
            ],
            code="unsupported_parameter",
        )
    if len(given) != 1:
        raise invalid(p, "structured_outputs must give exactly one of json, regex, choice, grammar, json_object")
    ((k, x),) = given.items()
    if k == "json_object":
        if x is not True:
            raise invalid(p, "structured_outputs.json_object must be true")
        return Constraint(ConstraintKind.JSON_OBJECT)
    return _GUIDED[k](f"{p}.{k}", x)


def parse_constraint(body: dict) -> tuple[Constraint | None, str | None]:
    """The output's constraint from response_format, guided_json/_regex/_choice/_grammar or
    structured_outputs (at most one of them), and the field it came from."""
    found = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    for k, make in _GUIDED.items():
        if body.get(f"guided_{k}") is not None:
            found.append((f"guided_{k}", make(f"guided_{k}", body[f"guided_{k}"])))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    found = [(p, c) for p, c in found if c is not None]
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise invalid(found[1][0], f"one structured-output constraint per request: got {names}")
    return found[0][1] if found else None, found[0][0] if found else None


def _with_max_tokens(r: Request, max_tokens: int) -> Request:
    r.sampling = dataclasses.replace(r.sampling, max_new_tokens=max_tokens)
    try:
        r.sampling.validate()
    except GenerationError as e:
        raise (
            constraint_error(r, e)
            if e.field == "sampling.constraint"
            else invalid(param_of(e.field), str(e).removeprefix("sampling."))
        ) from None
    return r


def constraint_error(r: Request, e: GenerationError) -> ApiError:
    """A constraint that does not compile, as 400 naming the request's field it came from."""
    message = str(e).removeprefix("sampling.constraint: ")
    return invalid(r.constraint_param, f"{r.constraint_param}: {message}", code="invalid_constraint")


def parse_completion(body: Any, default_max_tokens: int, defaults: SamplingDefaults = NEUTRAL) -> Request:
    """`defaults`: the sampling defaults of the body's model (its generation config's); an unset
    max_tokens is `default_max_tokens` (OpenAI's 16), as in vLLM, whatever the model's config says."""
    r = _common(body, "completion", defaults)
    n = _integer(body, "logprobs", 0, MAX_LOGPROBS)  # an int: the alternatives (0: the sampled token's alone)
    r.echo = _boolean(body, "echo")
    if r.echo and r.sampling.truncate_prompt_tokens is not None:
        raise invalid(
            "echo", "echo with truncate_prompt_tokens is not served (the prompt echoed would not be the one run)"
        )
    # echo's logprobs come from the prompt's too: the worker sends the larger count of alternatives
    asked = [k for k in (r.prompt_logprobs, n if r.echo else None) if k is not None]
    r.sampling = dataclasses.replace(r.sampling, logprobs=n, prompt_logprobs=max(asked) if asked else None)
    r.prompts = _prompts(body.get("prompt"))
    mt = _integer(body, "max_tokens", 1, 1 << 31)
    return _with_max_tokens(r, default_max_tokens if mt is None else mt)


def _tool_calls(where: str, calls: Any) -> list[dict]:
    """An assistant turn's tool_calls for the chat template: OpenAI's shape with the arguments as an
    object (templates write them with tojson; vLLM hands them over the same way)."""
    if not isinstance(calls, list):
        raise invalid("messages", f"{where}.tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (
            isinstance(f, dict)
            and c.get("type", "function") == "function"
            and isinstance(c.get("id"), str)
            and isinstance(f.get("name"), str)
            and isinstance(f.get("arguments"), str)
        ):
            raise invalid(
                "messages", f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, arguments}}}}"
            )
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise invalid("messages", f"{where}.tool_calls[{j}].function.arguments must be a JSON object's text")
        out.append({"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def parse_chat(body: Any, defaults: SamplingDefaults = NEUTRAL) -> Request:
    """`defaults`: the sampling defaults of the body's model (its generation config's, with its
    max_new_tokens for an unset max_tokens)."""
    r = _common(body, "chat", defaults)
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if _boolean(body, "logprobs"):
        r.sampling = dataclasses.replace(r.sampling, logprobs=top or 0)
    elif top:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    try:
        r.tools = parse_tools(body)
    except ToolError as e:
        raise invalid(e.param, str(e)) from None
    if r.tools is not None and r.tools.parsed and r.sampling.logprobs is not None:
        raise invalid("logprobs", "logprobs with tools is not served (tool calls are parsed from the whole text)")
    r.echo = _boolean(body, "echo")
    if r.echo and r.tools is not None and r.tools.parsed:
        raise invalid("echo", "echo with tools is not served (tool calls are parsed from the answer's text)")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise invalid("messages", f"{where} must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only, handed to the template as vLLM does (chat.py)
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise invalid("messages", f"{where}.content: only text parts are supported")
            content = [{"type": "text", "text": p["text"]} for p in content]
        elif content is not None and not isinstance(content, str):
            raise invalid("messages", f"{where}.content must be a string, a list of text parts or null")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise invalid("messages", f"{where}: only assistant messages have tool_calls")
            msg["tool_calls"] = _tool_calls(where, m["tool_calls"])
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise invalid("messages", f"{where}: a tool message needs the tool_call_id it answers")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    r.messages = out
    r.add_generation_prompt = _boolean(body, "add_generation_prompt", default=True)
    r.continue_final_message = _boolean(body, "continue_final_message")
    if r.continue_final_message and r.add_generation_prompt:
        raise invalid(
            "continue_final_message", "continue_final_message needs add_generation_prompt: false (vLLM's rule)"
        )
    if body.get("chat_template_kwargs") is not None:
        try:
            r.template_kwargs = check_template_kwargs(body["chat_template_kwargs"])
        except ChatTemplateError as e:
            raise invalid("chat_template_kwargs", str(e)) from None
    r.include_reasoning = _boolean(body, "include_reasoning", default=True)
    docs = body.get("documents")
    if docs is not None:
        if not isinstance(docs, list) or not all(
            isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items()) for d in docs
        ):
            raise invalid("documents", "documents must be a list of objects of string fields (e.g. title, text)")
        r.documents = [dict(d) for d in docs]
    mt = _integer(body, "max_completion_tokens", 1, 1 << 31)
    mt = _integer(body, "max_tokens", 1, 1 << 31) if mt is None else mt
    if mt is None:  # the model's default, cut to the context the prompt leaves (vLLM's get_max_tokens)
        r.sampling = dataclasses.replace(r.sampling, default_max_new_tokens=defaults.max_new_tokens)
    return _with_max_tokens(r, mt or 0)


# -- responses ---------------------------------------------------------------------------------------------


def total_usage(us: dict[int, gen_pb.Usage], n: int) -> gen_pb.Usage:
    """The request's usage from its choices' (by choice index, n a prompt): each prompt's tokens once,
    every choice's tokens."""
    return gen_pb.Usage(
        prompt_tokens=sum(u.prompt_tokens for i, u in us.items() if i % n == 0),
        completion_tokens=sum(u.completion_tokens for u in us.values()),
    )


def usage(u: gen_pb.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _envelope(r: Request, obj: str) -> dict:
    return {"id": r.id, "object": obj, "created": r.created, "model": r.model, "system_fingerprint": None}


def logprobs(r: Request, lps: list[gen_pb.Logprobs], offset: int = 0, prompt=()) -> dict | None:
    """OpenAI's `logprobs` of a choice (or of a chunk's tokens, `offset` characters into the text);
    None when the request asked for none. Completions: tokens, token_logprobs, top_logprobs (the
    sampled token among them, as vLLM does) and text_offset, with echo's `prompt` tokens first
    (the first one's logprob and alternatives null: nothing precedes it); chat: content entries
    with bytes."""
    if r.sampling.logprobs is None:
        return None

    def name(t: gen_pb.TokenLogprob) -> str:  # vLLM's return_tokens_as_token_ids: "token_id:N"
        return f"token_id:{t.token_id}" if r.tokens_as_ids else t.token

    if r.kind == "completion":
        lps = [*prompt, *lps]
        offsets = []
        for lp in lps:
            offsets.append(offset)
            offset += len(lp.sampled.token)  # characters of the text, whatever the tokens are called
        k = r.sampling.logprobs  # the prompt's may carry more alternatives (prompt_logprobs)
        out = {
            "tokens": [name(lp.sampled) for lp in lps],
            "token_logprobs": [lp.sampled.logprob for lp in lps],
            "top_logprobs": [
                {**{name(t): t.logprob for t in lp.top[:k]}, name(lp.sampled): lp.sampled.logprob} for lp in lps
            ],
            "text_offset": offsets,
        }
        if prompt:
            out["token_logprobs"][0] = out["top_logprobs"][0] = None
        return out

    def entry(t: gen_pb.TokenLogprob) -> dict:
        token = name(t)
        return {"token": token, "logprob": t.logprob, "bytes": list(token.encode("utf-8", "surrogatepass"))}

    return {
        "content": [{**entry(lp.sampled), "top_logprobs": [entry(t) for t in lp.top]} for lp in lps],
        "refusal": None,
    }


def prompt_logprobs(r: Request, prompt: list[gen_pb.Logprobs]) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` of one prompt; None when the request asked for none. Per prompt token:
    null for the first (nothing precedes it), then {token id: {logprob, rank, decoded_token}} with the
    prompt's token first and the `r.prompt_logprobs` most likely after it (ranks 1 up); -inf written
    as -9999.0, as vLLM's clamp does (JSON has no infinity)."""
    if r.prompt_logprobs is None:
        return None

    def entry(t: gen_pb.TokenLogprob, rank: int) -> dict:
        return {"logprob": max(t.logprob, -9999.0), "rank": rank, "decoded_token": t.token}

    out: list[dict | None] = [None]
    for lp in prompt[1:]:
        d = {str(lp.sampled.token_id): entry(lp.sampled, lp.rank)}
        for i, t in enumerate(lp.top[: r.prompt_logprobs]):
            d.setdefault(str(t.token_id), entry(t, i + 1))
        out.append(d)
    return out


@dataclass(frozen=True)
class Choice:
    text: str | None
    finish: str
    reasoning: str | None = None  # with a reasoning parser: the thinking (the text is the content)
    reasoning_tokens: int = 0  # the thinking's tokens (the one that ends it included)
    logprobs: dict | None = None
    tool_calls: tuple[Call, ...] = ()
    prompt_logprobs: list[dict | None] | None = None  # its prompt's (vLLM's prompt_logprobs)
    token_ids: list[int] = field(default_factory=list)  # its tokens (vLLM's return_token_ids)
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token that ended it
    prompt_token_ids: list[int] = field(default_factory=list)  # its prompt's, as run (return_token_ids)


def with_tool_calls(r: Request, pieces: list[str], finish: str, echo: str = "") -> Choice:
    """A finished chat choice of `echo` + its tokens' texts (`pieces`): the reasoning split out where
    the request has a reasoning parser (its tokens counted), then its tool calls parsed out of the
    content when the request has tools (finish_reason "tool_calls" when it made any; an answer cut by
    max_tokens stays text)."""
    if r.reasoning is not None:
        reasoning, content, thought = r.reasoning.split_pieces(pieces)
        content = (echo + (content or "")) or None
    else:
        reasoning, content, thought = None, echo + "".join(pieces), 0
    mine = {"reasoning": reasoning, "reasoning_tokens": thought}
    if content is None or r.tools is None or not r.tools.parsed or finish != "stop":
        return Choice(content, finish, **mine)
    s = CallStream(r.tool_format)  # as the stream would send it: the same content, the same calls
    sent = s.add(content)
    rest, calls, finish = s.finish(finish)
    if not calls:
        return Choice(content, finish, **mine)
    return Choice((sent + rest) or None, finish, tool_calls=calls, **mine)


def response(r: Request, choices: list[Choice], u: gen_pb.Usage) -> dict:
    """The whole (non-streamed) answer: `choices` by index."""

    # vLLM's keys: stop_reason always; the others only when asked for, the prompt's on each choice of
    # completions and on the response itself for chat (one prompt)
    def prompt_extras(c: Choice) -> dict:
        return {
            **({"prompt_logprobs": c.prompt_logprobs} if r.prompt_logprobs is not None else {}),
            **({"prompt_token_ids": c.prompt_token_ids} if r.return_token_ids else {}),
        }

    def own_extras(c: Choice) -> dict:
        return {"stop_reason": c.stop_reason, **({"token_ids": c.token_ids} if r.return_token_ids else {})}

    if r.kind == "completion":
        out = [
            {
                "index": i,
                "text": c.text,
                "logprobs": c.logprobs,
                "finish_reason": c.finish,
                **own_extras(c),
                **prompt_extras(c),
            }
            for i, c in enumerate(choices)
        ]
        return {**_envelope(r, "text_completion"), "choices": out, "usage": usage(u)}
    out = []
    for i, c in enumerate(choices):
        message = {"role": r.role, "content": c.text}
        if r.reasoning is not None:  # vLLM's field, and the name it had before (reasoning_content)
            thought = c.reasoning if r.include_reasoning else None
            message |= {"reasoning": thought, "reasoning_content": thought}
        if c.tool_calls:
            message["tool_calls"] = [t.to_openai() for t in c.tool_calls]
        out.append(
            {
                "index": i,
                "message": message,
                "logprobs": c.logprobs,
                "finish_reason": c.finish,
                **own_extras(c),
            }
        )
    return {**_envelope(r, "chat.completion"), "choices": out, "usage": usage(u), **prompt_extras(choices[0])}


def chunk(
    r: Request,
    text: str | None,
    finish: str | None = None,
    *,
    first: bool = False,
    logprobs: dict | None = None,
    index: int = 0,
    tool_calls: tuple[Call, ...] = (),
    token_ids: tuple[int, ...] = (),
    prompt_token_ids: tuple[int, ...] | None = None,
    stop_reason: str | int | None = None,
    reasoning: str | None = None,
    usage_so_far: tuple[int, int] | None = None,
) -> dict:
    """One streamed piece of choice `index`: `text` added (chat: a delta, with the role on the
    first), or the finish. With return_token_ids, the piece's `token_ids`, and the prompt's ids where
    given (completions: each choice's first chunk; chat: the stream's first, on the chunk itself)."""
    prompt_ids = {} if prompt_token_ids is None else {"prompt_token_ids": list(prompt_token_ids)}
    ids = {"token_ids": list(token_ids)} if r.return_token_ids else {}
    if r.kind == "completion":
        choice = {
            "index": index,
            "text": text or "",
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            **prompt_ids,
            **ids,
        }
        out = {**_envelope(r, "text_completion"), "choices": [choice]}
    else:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = r.role
        if reasoning:  # vLLM's delta field, and its older name
            delta |= {"reasoning": reasoning, "reasoning_content": reasoning}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [t.to_openai(j) for j, t in enumerate(tool_calls)]
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            **ids,
        }
        out = {**_envelope(r, "chat.completion.chunk"), "choices": [choice], **prompt_ids}
    if r.include_usage:  # null, or with continuous_usage (prompt tokens, the choice's tokens so far)
        p, c = usage_so_far or (0, 0)
        out["usage"] = (
            {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c} if r.continuous_usage else None
        )
    return out


def usage_chunk(r: Request, u: gen_pb.Usage) -> dict:
    """`stream_options.include_usage`: the last chunk, no choices, the usage."""
    obj = "text_completion" if r.kind == "completion" else "chat.completion.chunk"
    return {**_envelope(r, obj), "choices": [], "usage": usage(u)}


def model_list(models, owned_by: str, max_model_len: int | None = None) -> dict:
    """/v1/models from the router's ListModels (base first). Unservable variants are omitted (a request
    for one gets 400 with the reason). `max_model_len` (vLLM's card field: the context every model of
    the family shares), where the gateway knows the base's config (--tokenizer)."""
    base = next((m.model_id for m in models if m.is_base), None)
    data = []
    for m in models:
        if not m.servable:
            continue
        entry = {
            "id": m.model_id,
            "object": "model",
            "created": 0,
            "owned_by": owned_by,
            "root": m.model_id if m.is_base else base,
            "parent": None if m.is_base else base,
            "base_model": m.base_model,  # the base this variant's delta was built for (the base: itself)
            "delta_bytes": m.delta_bytes,  # the size of its 1-bit delta; 0 for the base
        }
        if max_model_len is not None:
            entry["max_model_len"] = max_model_len
        data.append(entry)
    return {"object": "list", "data": data}
