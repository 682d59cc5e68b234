"""Chat templates as Hugging Face tokenizers ship them, rendered without torch or transformers.

    t = ChatTemplate.load(Path("data/base"))   # chat_template.jinja, or tokenizer_config.json's chat_template
    prompt = t.render([{"role": "user", "content": "Hi"}])   # add_generation_prompt=True

Rendering follows `transformers`' `apply_chat_template`: a sandboxed, immutable Jinja
environment with `trim_blocks` and `lstrip_blocks`, the `raise_exception(msg)` and
`strftime_now(fmt)` helpers, a `tojson` that keeps non-ASCII text, loop controls, the
`{% generation %}` tag (rendered as its body), and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) as variables. A template that calls `raise_exception`
(e.g. "roles must alternate") gives `ChatTemplateError`, which the gateway answers with 400.

A message's content reaches the template as vLLM hands it over (`--chat-template-content-format`):
"string", its text parts joined by newlines; or "openai", a list of {type: text, text} parts (a
string as one part) for templates that loop over a message's content (Gemma 3's, Llama 3.2
Vision's). "auto" (`ChatTemplate.content_format`) finds such a loop in the template's syntax tree,
as vLLM's detection does. A tool message's parts are joined in either.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bitdelta.model_files import (
    CONFIG_NAME,
    JINJA_NAME,
    SPECIAL_TOKEN_KEYS,
    ModelFileError,
    TemplateSource,
    read_chat_template,
)

MAX_TEMPLATE_KWARGS = 32  # vLLM's chat_template_kwargs in one request
CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's --chat-template-content-format


class ChatTemplateError(ValueError):
    """A template that cannot be loaded, or that refuses the messages (`raise_exception`)."""


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with it): the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# the variables the renderer sets itself (and the environment's helpers): a request may not set them
_RENDERER_NAMES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", *SPECIAL_TOKEN_KEYS}
    | set(_environment().globals)
)


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """vLLM's chat_template_kwargs (e.g. Qwen3's enable_thinking): an object of at most
    MAX_TEMPLATE_KWARGS variables for the template, none of the names the renderer sets itself
    (messages, tools, the flags, the special tokens, the helpers). Raises ChatTemplateError."""
    if not isinstance(kwargs, dict):
        raise ChatTemplateError("chat_template_kwargs must be an object of template variables")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ChatTemplateError(f"chat_template_kwargs: {len(kwargs)} variables; at most {MAX_TEMPLATE_KWARGS}")
    for name in kwargs:
        if not name.isidentifier() or name in _RENDERER_NAMES:
            raise ChatTemplateError(f"chat_template_kwargs: {name[:40]!r} is not a variable a request may set")
    return dict(kwargs)


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` reads one of `names` (with `key`: its item or attribute `key`), through filters,
    tests and slices (`messages[1:]`, `message['content'] | list`)."""
    while isinstance(node, (nodes.Filter, nodes.Test)) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        node = node.node
        if node is None:
            return False
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, nodes.Getitem):
        keyed = isinstance(node.arg, nodes.Const) and node.arg.value == key
    elif isinstance(node, nodes.Getattr):
        keyed = node.attr == key
    else:
        return False
    return keyed and _reads(node.node, names)


def _loop_targets(tree: nodes.Template, names: set[str], key: str | None = None) -> set[str]:
    """The names `{% for x in ... %}` binds over one of `names` (or their item `key`)."""
    return {
        f.target.name
        for f in tree.find_all(nodes.For)
        if isinstance(f.target, nodes.Name) and _reads(f.iter, names, key)
    }


def detect_content_format(source: str) -> str:
    """ "openai" where the template loops over a message's content (`{% for part in message['content'] %}`,
    a message being the loop variable over `messages` or over a variable assigned from it), else
    "string": vLLM's rule for --chat-template-content-format auto."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateError:
        return "string"
    lists, todo = {"messages"}, ["messages"]
    while todo:  # every variable assigned from messages, or from one of those (`loop_messages = messages[1:]`)
        name = todo.pop()
        for a in tree.find_all(nodes.Assign):
            if isinstance(a.target, nodes.Name) and a.target.name not in lists and _reads(a.node, {name}):
                lists.add(a.target.name)
                todo.append(a.target.name)
    messages = _loop_targets(tree, lists)
    return "openai" if messages and _loop_targets(tree, messages, "content") else "string"


def _texts(content: Any) -> list[str] | None:
    """A message's content as its text parts (None for null)."""
    if content is None:
        return None
    return [content] if isinstance(content, str) else [p["text"] for p in content]


def _shaped(message: dict[str, Any], fmt: str) -> dict[str, Any]:
    """The message with its content as the template gets it in format `fmt` (see the module docstring)."""
    texts = _texts(message.get("content"))
    if fmt == "openai" and message.get("role") != "tool":
        content: Any = [{"type": "text", "text": t} for t in texts or ()]
    else:
        content = "\n".join(texts or ())
    return {**message, "content": content}


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the template text
    origin: str  # where it came from (for messages and logs)
    specials: dict[str, str]  # bos_token, eos_token, ... -> text

    @classmethod
    def load(cls, path: Path) -> ChatTemplate:
        """From a tokenizer directory, a tokenizer_config.json (or any JSON with `chat_template`) or a
        template file (`bitdelta.model_files.read_chat_template`). Raises ChatTemplateError naming the
        path when there is none or it does not compile."""
        try:
            found = read_chat_template(Path(path))
        except (ModelFileError, FileNotFoundError) as e:
            raise ChatTemplateError(str(e)) from None
        if found is None:
            raise ChatTemplateError(
                f"{path} has no chat template (looked for {JINJA_NAME} and the chat_template of {CONFIG_NAME})"
            )
        return cls.of(found)

    @classmethod
    def of(cls, t: TemplateSource) -> ChatTemplate:
        """A template's text with its special tokens (a file's, or a delta's own); ChatTemplateError
        where it does not compile."""
        out = cls(t.source, t.origin, dict(t.specials))
        out._compiled()  # fail where it is loaded, not on the first request
        return out

    @property
    def content_format(self) -> str:
        """How this template takes a message's content: "openai" or "string" (`detect_content_format`)."""
        fmt = self.__dict__.get("_format")
        if fmt is None:
            fmt = detect_content_format(self.source)
            object.__setattr__(self, "_format", fmt)
        return fmt

    @property
    def reads_documents(self) -> bool:
        """Whether the template reads `documents` (a RAG form: Command R's, Granite's), where a
        request's documents go."""
        reads = self.__dict__.get("_documents")
        if reads is None:
            reads = "documents" in meta.find_undeclared_variables(_environment().parse(self.source))
            object.__setattr__(self, "_documents", reads)
        return reads

    def _compiled(self) -> jinja2.Template:
        cached = self.__dict__.get("_template")
        if cached is None:
            try:
                cached = _environment().from_string(self.source)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"chat template from {self.origin} does not compile: {e}") from None
            object.__setattr__(self, "_template", cached)
        return cached

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        content_format: str = "auto",
        documents: list[dict[str, str]] | None = None,
    ) -> str:
        """The prompt text for `messages` (OpenAI's role/content dicts, with assistant tool_calls and
        tool results), ending with the assistant's turn (`add_generation_prompt`); `tools` as
        transformers passes them (OpenAI's function definitions; None: no tools).
        `continue_final_message`: instead the text ends inside the last message, right after its
        content, for the model to go on with it (transformers' way: the content is rendered with a
        marker after it and the text cut there; a template that does not write the content as it
        is refuses). `template_kwargs`: further template variables (`check_template_kwargs`).
        A message's content: a string, a list of {type: text, text} parts or None, handed over in
        `content_format` (CONTENT_FORMATS; "auto": `self.content_format`). `documents`: the template's
        `documents` variable, as transformers passes it (a RAG template's; None: none)."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message needs add_generation_prompt: false")
        fmt = self.content_format if content_format == "auto" else content_format
        if fmt not in CONTENT_FORMATS[1:]:
            raise ValueError(f"content_format must be one of {', '.join(CONTENT_FORMATS)}, got {content_format!r}")
        messages = [_shaped(m, fmt) for m in messages]
        if continue_final_message:
            marker = f"BITDELTA_CONTINUE_{uuid.uuid4().hex} "  # its space shows whether the template trims
            last, final = messages[-1], "\n".join(_texts(messages[-1].get("content")) or ())
            if not final:
                raise ChatTemplateError("continue_final_message: the final message has no text to continue")
            if isinstance(last["content"], str):
                content: Any = last["content"] + marker
            else:  # the marker after the last part's text (transformers looks for the last part's)
                content = [*last["content"][:-1], {**last["content"][-1], "text": last["content"][-1]["text"] + marker}]
            messages = [*messages[:-1], {**last, "content": content}]
            final = _texts(last["content"])[-1]
        try:
            text = self._compiled().render(
                **dict(template_kwargs or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                **self.specials,
            )
        except _TemplateRaised as e:
            raise ChatTemplateError(f"the chat template refuses these messages: {e}") from None
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError
            raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        if not continue_final_message:
            return text
        at = text.rfind(marker.strip())
        if at < 0 or final.strip() not in text:
            raise ChatTemplateError(
                "continue_final_message: the chat template does not write the final message's text as it is"
            )
        return text[:at] if text.startswith(marker, at) else text[:at].rstrip()
