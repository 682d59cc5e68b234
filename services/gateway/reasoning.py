"""vLLM's reasoning parsers (`--reasoning-parser`): a thinking model's `<think> … </think>` text
answered apart from its content, as chat's `reasoning` (and `reasoning_content`, the name vLLM used
before it), whole or streamed.

Two parsers, under vLLM's names, for the families this system serves that think in those tags:

- `deepseek_r1` (DeepSeek-R1 and its distills into Qwen and Llama, QwQ): the template opens the
  thinking in the prompt, so the output is reasoning up to `</think>` and content after it; an
  output without `</think>` (cut by max_tokens) is all reasoning.
- `qwen3` (Qwen3, and its fine-tunes): the same, except that with `chat_template_kwargs`
  `enable_thinking: false` (the template then closes an empty thinking in the prompt) an output
  without `</think>` is all content.

Either way a `<think>` the model writes itself at the very start of its output (templates that do
not open it in the prompt) is dropped. Unlike vLLM's qwen3 parser, a `<tool_call>` inside the
thinking does not end it (Qwen3.5's habit; Qwen3.5 is not a family served here). The split is the
same whole or streamed: `ReasoningStream` holds back only text that may be the start of a tag.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoning:
    """One chat request's parser: `thinking` False (qwen3's enable_thinking: false) makes an output
    without END all content."""

    parser: str
    thinking: bool = True

    @classmethod
    def of(cls, parser: str | None, template_kwargs: dict[str, Any]) -> Reasoning | None:
        if parser is None:
            return None
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        thinking = parser != "qwen3" or template_kwargs.get("enable_thinking", True) is not False
        return cls(parser, thinking)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output, as the stream sends them (None: none)."""
        return self.split_pieces([text])[:2]

    def split_pieces(self, pieces: Iterable[str]) -> tuple[str | None, str | None, int]:
        """(reasoning, content, the thinking's pieces) of an output given piece by piece (its tokens'
        texts), in one pass as the stream does."""
        s = ReasoningStream(self)
        parts = [s.add(p) for p in pieces]
        parts.append(s.finish())
        reasoning, content = "".join(a for a, _ in parts), "".join(b for _, b in parts)
        return (reasoning if s.reasoned else None), (content or None), s.pieces


class ReasoningStream:
    """One choice's text as it streams: add(piece) -> (reasoning, content) ready to send; finish()
    -> what was held. Only text that may still become a tag is held."""

    def __init__(self, reasoning: Reasoning):
        self.thinking = reasoning.thinking  # False: qwen3 with thinking off, unless the output opens it
        self.at_start = True  # no text yet: a START here is dropped (and opens the thinking)
        self.ended = False  # past the thinking: all content from here
        self.reasoned = False  # some text was reasoning (the answer's reasoning field is not null)
        self.held = ""
        self.pieces = 0  # pieces (tokens) of the thinking, the one that ends it included

    def add(self, piece: str) -> tuple[str, str]:
        open_before = not self.ended
        out = self._add(piece)
        self.pieces += open_before and self.thinking
        return out

    def _add(self, piece: str) -> tuple[str, str]:
        if self.ended:
            return "", piece
        text, self.held = self.held + piece, ""
        if self.at_start:
            if START.startswith(text):  # may still be START
                self.held = text
                return "", ""
            self.at_start = False
            if text.startswith(START):
                text, self.thinking = text[len(START) :], True
            if not self.thinking:  # thinking off: all content (vLLM's stream with enable_thinking false)
                self.ended = True
                return "", text
        self.reasoned = True
        at = text.find(END)
        if at >= 0:
            self.ended = True
            return text[:at], text[at + len(END) :]
        keep = _partial_tail(text, END)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held: a cut-off thinking is all reasoning; a thinking never opened, content."""
        held, self.held = self.held, ""
        if self.at_start:  # the whole output was (a beginning of) START, or nothing
            self.at_start = False
            if held == START:
                held, self.thinking = "", True
        if self.thinking and not self.ended:
            self.reasoned = True
            return held, ""
        return "", held


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
