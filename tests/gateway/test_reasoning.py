"""The reasoning parsers' split (services/gateway/reasoning.py) against vLLM's rules, whole and
streamed in every cut of the text: the stream holds back only what may still be a tag, and sends
the same reasoning and content as the whole answer."""

from __future__ import annotations

import random

import pytest

from services.gateway.reasoning import END, START, Reasoning, ReasoningStream


def vllm_rule(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """vLLM's qwen3/deepseek_r1 whole-output rule as its docs state it, for an output whose START
    (if any) opens it: START dropped; split at the first END; no END: all reasoning while thinking,
    else all content."""
    if text.startswith(START):
        text, thinking = text[len(START) :], True
    if not thinking:
        return None, text or None
    if END in text:
        reasoning, _, content = text.partition(END)
        return reasoning, content or None
    return text, None


CASES = [
    "plain answer",
    "thinking</think>answer",
    f"{START}thinking{END}answer",
    f"{START}thinking{END}",
    f"{END}answer",
    "cut off in the thinking",
    "a < b and </thin",  # a partial END at the end: reasoning
    "<thi",  # a partial START, the whole output
    f"{START}",
    "",
    f"one{END}two{END}three",  # the first END splits
    f"x{START}y{END}z",  # a START later is text
]


@pytest.mark.parametrize("parser,kwargs", [("deepseek_r1", {}), ("qwen3", {}), ("qwen3", {"enable_thinking": False})])
@pytest.mark.parametrize("text", CASES)
def test_whole_and_every_stream_cut_follow_vllms_rule(parser, kwargs, text):
    r = Reasoning.of(parser, kwargs)
    want = vllm_rule(text, r.thinking)
    assert r.split(text) == want
    rng = random.Random(len(text))
    for _ in range(20):  # the text in random pieces, as tokens arrive
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s, reasoning, content = ReasoningStream(r), "", ""
        for p in pieces:
            a, b = s.add(p)
            reasoning, content = reasoning + a, content + b
        a, b = s.finish()
        reasoning, content = reasoning + a, content + b
        assert ((reasoning if s.reasoned else None), content or None) == want, pieces


def test_a_stream_holds_only_what_may_be_a_tag():
    s = ReasoningStream(Reasoning.of("deepseek_r1", {}))
    assert s.add("I think a <") == ("I think a ", "")  # "<" may begin </think>
    assert s.add("b") == ("<b", "")
    assert s.add("</th") == ("", "")
    assert s.add("ink>Yes") == ("", "Yes")
    assert s.add(" and </think> is text now") == ("", " and </think> is text now")


def test_parser_names_are_vllms():
    assert Reasoning.of(None, {}) is None
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        Reasoning.of("granite", {})
    assert not Reasoning.of("qwen3", {"enable_thinking": False}).thinking
    assert Reasoning.of("deepseek_r1", {"enable_thinking": False}).thinking  # R1 has no switch
