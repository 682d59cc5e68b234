"""How a message's content reaches the chat template (`--chat-template-content-format`, vLLM's
flag): "string", the text parts joined by newlines; "openai", a list of {type: text, text} parts (a
string as one part); "auto" by the template's syntax tree, as vLLM detects it: a loop over a
message's content, the message being a loop variable over `messages` or over a variable assigned
from it. Tool messages' parts are joined in either."""

from __future__ import annotations

import pytest

from bitdelta.rpc.config import ConfigError
from services.gateway.chat import ChatTemplate, ChatTemplateError, detect_content_format
from services.gateway.config import GatewayConfig

# Gemma 3's way: a string as it is, a list part by part
LOOPS = (
    "{% for message in messages %}<{{ message['role'] }}>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}[{{ item['type'] }}:{{ item['text'] }}]{% endfor %}{% endif %}"
    "{% endfor %}"
)
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
PARTS = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]


@pytest.mark.parametrize(
    "source, fmt",
    [
        (PLAIN, "string"),
        (LOOPS, "openai"),
        # through a variable assigned from messages, attribute access and a filter
        (
            "{% set rest = messages[1:] %}{% for m in rest %}{% for c in m.content | list %}{{ c.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set a = messages %}{% set b = a %}{% for m in b %}{% for c in m['content'] %}{% endfor %}{% endfor %}",
            "openai",
        ),
        # a loop over something else's content, or a message's other field: string
        ("{% for m in messages %}{% for t in m['tool_calls'] %}{% endfor %}{% endfor %}", "string"),
        ("{% for d in documents %}{% for c in d['content'] %}{% endfor %}{% endfor %}", "string"),
        ("{% if messages[0]['content'] is string %}{{ messages[0]['content'] }}{% endif %}", "string"),
        ("{% for m in messages %", "string"),  # does not parse: string, as vLLM's default
    ],
)
def test_the_format_is_detected_from_the_template(source, fmt):
    assert detect_content_format(source) == fmt


def test_parts_reach_the_template_in_its_format():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PARTS}]
    plain, loops = ChatTemplate(PLAIN, "t", {}), ChatTemplate(LOOPS, "t", {})
    assert (plain.content_format, loops.content_format) == ("string", "openai")
    assert plain.render(msgs) == "<system>Be brief.<user>Hi\nthere"
    assert loops.render(msgs) == "<system>[text:Be brief.]<user>[text:Hi][text:there]"
    # the flag over the detection
    assert loops.render(msgs, content_format="string") == "<system>Be brief.<user>Hi\nthere"
    assert plain.render(msgs, content_format="openai").startswith("<system>[{'type': 'text'")
    # null content: "" as a string, no part as a list; a tool message's parts joined in either
    turns = [{"role": "assistant", "content": None}, {"role": "tool", "content": PARTS, "tool_call_id": "c"}]
    assert plain.render(turns) == "<assistant><tool>Hi\nthere"
    assert loops.render(turns) == "<assistant><tool>Hi\nthere"
    with pytest.raises(ValueError, match="content_format"):
        plain.render(msgs, content_format="json")


def test_continue_final_message_goes_on_after_the_last_part():
    msgs = [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": [*PARTS[:1], {"type": "text", "text": "I am"}]},
    ]
    loops = ChatTemplate(LOOPS, "t", {})
    assert (
        loops.render(msgs, add_generation_prompt=False, continue_final_message=True)
        == "<user>[text:Go]<assistant>[text:Hi][text:I am"
    )
    plain = ChatTemplate(PLAIN, "t", {})
    assert plain.render(msgs, add_generation_prompt=False, continue_final_message=True) == "<user>Go<assistant>Hi\nI am"
    with pytest.raises(ChatTemplateError, match="no text"):
        loops.render([{"role": "assistant", "content": []}], add_generation_prompt=False, continue_final_message=True)


def test_the_flag_takes_vllms_values():
    base = ["--router", "127.0.0.1:1"]
    assert GatewayConfig.from_args(base, env={}).chat_template_content_format == "auto"
    flag = ["--chat-template-content-format", "openai"]
    assert GatewayConfig.from_args([*base, *flag], env={}).chat_template_content_format == "openai"
    with pytest.raises(ConfigError, match="must be one of auto, string, openai"):
        GatewayConfig.from_args([*base, "--chat-template-content-format", "json"], env={})
