"""Tools (function calling) in OpenAI's shapes: definitions and `tool_choice` checked, the grammar
that enforces `required` and a named function, and the model's text parsed back into `tool_calls`.

    tools = parse_tools(body)                     # None without tools; ToolError naming the field
    constraint = tools.constraint(ToolFormat.HERMES)   # required / named: a grammar; else None
    content, calls = parse_calls(text, ToolFormat.HERMES)

How a model writes a call is its chat template's convention (`ToolFormat.of_template`):
- `HERMES` (Qwen2.5, Hermes, and the default): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, text before them is the message's content;
- `LLAMA_JSON` (Llama 3.1/3.2's JSON tool calling): the whole answer is `{"name": ..., "parameters": {...}}`;
- `MISTRAL` (Mistral 7B v0.3, Nemo, Small): `[TOOL_CALLS]` and a JSON list of {name, arguments}, or
  `[TOOL_CALLS]name[ARGS]{...}` per call (tokenizers v11 on); ids of 9 letters and digits;
- `GRANITE` (Granite 3): `<|tool_call|>` and a JSON list of {name, arguments};
- `PHI4_MINI` (Phi-4-mini-instruct, with a template that teaches it, as vLLM's phi4_mini_json parser
  reads it): `functools` and a JSON list of {name, arguments}.
Mistral's and Granite's openers are special tokens: a request with tools keeps special tokens' text.

`required` is one or more calls (exactly one with `parallel_tool_calls: false`), a named function
exactly one call of it; the grammar fixes the name to a defined tool and the arguments to its
`parameters` schema. `auto` leaves the model free (the arguments are then the model's, not
checked against the schema: vLLM's `auto` does the same), and `none` returns text only.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from bitdelta.generation import Constraint, ConstraintKind
from bitdelta.grammar import lark_json

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MISTRAL_OPENER, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
GRANITE_OPENER = "<|tool_call|>"
PHI4_OPENER = "functools"
MAX_TOOLS = 128
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tool definition or tool_choice out of shape; `param` is the request field (protocol answers 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def invalid(param: str, message: str) -> ToolError:
    return ToolError(param, message)


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA_JSON = "llama3_json"
    # Mistral's: `[TOOL_CALLS]` then a JSON list of {name, arguments} (tokenizers before v11), or each
    # call as `[TOOL_CALLS]name[ARGS]{arguments}` (v11 on); a call's id is 9 letters and digits, which
    # Mistral's templates check when the conversation comes back
    MISTRAL = "mistral"
    # Granite 3's (vLLM's granite parser): `<|tool_call|>` then a JSON list of {name, arguments}
    GRANITE = "granite"
    # Phi-4-mini's (vLLM's phi4_mini_json parser): `functools` then a JSON list of {name, arguments}
    PHI4_MINI = "phi4_mini_json"

    @classmethod
    def of_template(cls, source: str) -> ToolFormat:
        """The convention a chat template teaches: Mistral's where it writes [TOOL_CALLS], Phi-4-mini's
        where it writes functools[, Granite's where it writes <|tool_call|>, Hermes' tags where it writes
        them, Llama's JSON where it asks for "parameters" without them, else Hermes."""
        if MISTRAL_OPENER in source:
            return cls.MISTRAL
        if PHI4_OPENER + "[" in source:
            return cls.PHI4_MINI
        if GRANITE_OPENER in source:
            return cls.GRANITE
        if "<tool_call>" in source:
            return cls.HERMES
        return cls.LLAMA_JSON if '"parameters"' in source else cls.HERMES

    @property
    def arguments_key(self) -> str:
        return "parameters" if self is ToolFormat.LLAMA_JSON else "arguments"

    @property
    def opener(self) -> str:
        """The text a call begins with (Llama's: an answer that begins with "{")."""
        return {ToolFormat.HERMES: "<tool_call>", **LISTED}.get(self, "{")

    @property
    def special_opener(self) -> bool:
        """Whether a call begins with a special token (Mistral's, Granite's): its text must stay in the output."""
        return self in (ToolFormat.MISTRAL, ToolFormat.GRANITE)


# the formats whose calls follow an opener (Mistral's and Granite's special tokens, Phi-4-mini's word)
# as a JSON list
LISTED = {ToolFormat.MISTRAL: MISTRAL_OPENER, ToolFormat.GRANITE: GRANITE_OPENER, ToolFormat.PHI4_MINI: PHI4_OPENER}


class Mode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema of the arguments object

    def to_template(self) -> dict:
        """As transformers hands tools to a chat template (OpenAI's own shape)."""
        f = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": f}

    def call_schema(self, fmt: ToolFormat) -> dict:
        """The JSON schema of one call of this tool in `fmt`."""
        return {
            "type": "object",
            "properties": {"name": {"const": self.name}, fmt.arguments_key: self.parameters},
            "required": ["name", fmt.arguments_key],
            "additionalProperties": False,
        }


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's tool_calls carry it

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class Tools:
    tools: tuple[Tool, ...]
    mode: Mode
    name: str = ""  # Mode.NAMED: the function
    parallel: bool = True

    @property
    def parsed(self) -> bool:
        """Whether the answer's text is read for tool calls (not with tool_choice none)."""
        return self.mode is not Mode.NONE

    def constraint(self, fmt: ToolFormat) -> Constraint | None:
        """The grammar of a `required` or named answer; None for auto and none."""
        if self.mode not in (Mode.REQUIRED, Mode.NAMED):
            return None
        chosen = [t for t in self.tools if self.mode is Mode.REQUIRED or t.name == self.name]
        schemas = [t.call_schema(fmt) for t in chosen]
        one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        if fmt is ToolFormat.LLAMA_JSON:
            return Constraint(ConstraintKind.GRAMMAR, f"start: {lark_json(one)}")
        if fmt in LISTED:  # the opener and a list (Mistral's list form, which every Mistral parser reads)
            more = ' (", " call)*' if self.mode is Mode.REQUIRED and self.parallel else ""
            text = f'start: "{LISTED[fmt]}[" call{more} "]"\ncall: {lark_json(one)}'
            return Constraint(ConstraintKind.GRAMMAR, text)
        more = ' ("\\n" call)*' if self.mode is Mode.REQUIRED and self.parallel else ""
        text = f'start: call{more}\ncall: "<tool_call>\\n" {lark_json(one)} "\\n</tool_call>"'
        return Constraint(ConstraintKind.GRAMMAR, text)


def _tool(i: int, t: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise invalid("tools", f'{where} must be {{"type": "function", "function": {{name, description, parameters}}}}')
    f = t["function"]
    extra = set(f) - {"name", "description", "parameters", "strict"}
    if extra or set(t) - {"type", "function"}:
        raise invalid("tools", f"{where}: unknown keys {sorted(extra or set(t) - {'type', 'function'})}"[:200])
    name = f.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid("tools", f"{where}.function.name must be 1-64 letters, digits, '_' or '-'")
    desc = f.get("description", "")
    if not isinstance(desc, str):
        raise invalid("tools", f"{where}.function.description must be a string")
    if not isinstance(f.get("strict", False), (bool, type(None))):
        raise invalid("tools", f"{where}.function.strict must be true or false")
    params = f.get("parameters")
    params = EMPTY_PARAMETERS if params is None else params
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise invalid("tools", f"{where}.function.parameters must be a JSON schema of an object")
    return Tool(name, desc, params)


def parse_tools(body: dict) -> Tools | None:
    """The request's tools, tool_choice and parallel_tool_calls; None without tools."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, (bool, type(None))):
        raise invalid("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise invalid("tools", f"tools must be a list of at most {MAX_TOOLS} function definitions")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools", "tools: two functions have the same name")
    name = ""
    if choice is None:
        mode = Mode.AUTO
    elif choice in ("none", "auto", "required"):
        mode = Mode(choice)
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        mode, name = Mode.NAMED, choice["function"]["name"]
        if name not in names:
            raise invalid("tool_choice", f"tool_choice names {name[:64]!r}, which is not one of the tools")
    else:
        raise invalid(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
        )
    return Tools(tools, mode, name, parallel is not False)


def _call(obj: Any, fmt: ToolFormat) -> Call | None:
    """One call from its JSON object (either key for the arguments: models mix them), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(fmt.arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    if fmt is ToolFormat.MISTRAL:  # Mistral's templates accept only ids of 9 letters and digits
        call_id = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    else:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
    return Call(call_id, obj["name"], json.dumps(args, ensure_ascii=False))


def _listed_calls(text: str, fmt: ToolFormat) -> tuple[str | None, tuple[Call, ...]]:
    """The calls after the first opener (Mistral's [TOOL_CALLS], Granite's <|tool_call|>, Phi-4-mini's
    functools): one JSON list (or object), or Mistral's `name[ARGS]{...}` after each [TOOL_CALLS]; the
    text before is content (Mistral's and Granite's openers are special tokens, whose text a request
    with tools keeps). Anything else: all content."""
    opener = LISTED[fmt]
    at = text.find(opener)
    if at < 0:
        return text, ()
    content, rest, calls = text[:at], text[at:], []
    decoder = json.JSONDecoder()
    while rest.startswith(opener):
        rest = rest[len(opener) :].lstrip()
        name, sep, after = rest.partition(MISTRAL_ARGS)
        try:
            if rest[:1] in ("[", "{"):
                obj, end = decoder.raw_decode(rest)
                objs = obj if isinstance(obj, list) else [obj]
            elif fmt is ToolFormat.MISTRAL and sep and NAME.fullmatch(name):
                args, end = decoder.raw_decode(after)
                objs, end = [{"name": name, "arguments": args}], len(name) + len(sep) + end
            else:
                return text, ()
        except ValueError:
            return text, ()
        made = [_call(o, fmt) for o in objs]
        if not made or any(c is None for c in made):
            return text, ()
        calls += made
        rest = rest[end:].lstrip()
    if rest:  # text after the calls: not a call answer
        return text, ()
    return (content if content.strip() else None), tuple(calls)


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_calls(text: str, fmt: ToolFormat) -> tuple[str | None, tuple[Call, ...]]:
    """(content, calls) of a finished answer: every well-formed call, and the text that is not part of
    one (None when only blanks). An answer with no well-formed call is all content."""
    if fmt in LISTED:
        return _listed_calls(text, fmt)
    if fmt is ToolFormat.HERMES:
        calls, spans = [], []
        for m in HERMES_CALL.finditer(text):
            try:
                c = _call(json.loads(m.group(1)), fmt)
            except ValueError:
                c = None
            if c is not None:
                calls.append(c)
                spans.append(m.span())
        if not calls:
            return text, ()
        rest, last = [], 0
        for a, b in spans:
            rest.append(text[last:a])
            last = b
        rest.append(text[last:])
        content = "".join(rest)
        return content if content.strip() else None, tuple(calls)
    body = text.strip()
    try:
        c = _call(json.loads(body), fmt) if body.startswith("{") else None
    except ValueError:
        c = None
    return (text, ()) if c is None else (None, (c,))


class CallStream:
    """One streamed choice's text: content goes out as it comes, except from where a tool call may
    begin (Hermes' `<tool_call>` or Mistral's `[TOOL_CALLS]`, or a prefix of it at the end; Llama's
    answer starting with "{"), which is held until the answer ends and then sent as tool_calls, or as
    content if it is none."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.opener = fmt.opener
        self.held, self.holding, self.started = "", False, False  # started: content other than blanks went out

    def add(self, text: str) -> str:
        """The content to send now."""
        if self.holding:
            self.held += text
            return ""
        buf, self.held = self.held + text, ""
        if self.fmt is ToolFormat.LLAMA_JSON:
            if self.started:
                return buf
            if not buf.strip():
                self.held = buf
                return ""
            self.started = True
            if buf.lstrip().startswith("{"):
                self.holding, self.held = True, buf
                return ""
            return buf
        k = buf.find(self.opener)
        if k >= 0:
            self.holding, self.held = True, buf[k:]
            return buf[:k]
        for j in range(min(len(self.opener) - 1, len(buf)), 0, -1):
            if self.opener.startswith(buf[-j:]):
                self.held = buf[-j:]
                return buf[:-j]
        return buf

    def finish(self, finish: str) -> tuple[str, tuple[Call, ...], str]:
        """(content still to send, the calls, the finish reason) once the choice has ended."""
        held, self.held = self.held, ""
        if self.holding and finish == "stop":
            content, calls = parse_calls(held, self.fmt)
            if calls:
                return content or "", calls, "tool_calls"
        return held, (), finish
