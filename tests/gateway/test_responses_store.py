"""The gateway's kept responses (services/gateway/responses.py, ResponseStore and turns), without a
server: the least recently used answer goes first past the count or the bytes, each owner reads only
its own, and a response's output becomes the chat turns a next request continues. The served routes
are tested through the openai SDK in test_gateway.py."""

from __future__ import annotations

from services.gateway.responses import ResponsesInfo, ResponseStore, turns


def answer(text: str, *calls: tuple[str, str, str]) -> dict:
    out = [{"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}]
    if text:
        out.append({"type": "message", "content": [{"type": "output_text", "text": text, "annotations": []}]})
    out += [{"type": "function_call", "call_id": c, "name": n, "arguments": a} for c, n, a in calls]
    return {"object": "response", "output": out}


def info(rid: str) -> ResponsesInfo:
    return ResponsesInfo(rid, 0, None, None, {"type": "text"}, conversation=({"role": "user", "content": rid},))


def test_least_recently_used_goes_first_past_the_count_or_the_bytes():
    s = ResponseStore(capacity=2, max_bytes=10_000)
    for rid in ("a", "b"):
        s.put("me", info(rid), answer(rid))
    assert s.get("me", "a") is not None  # a is now the most recent
    s.put("me", info("c"), answer("c"))
    assert s.get("me", "b") is None and s.get("me", "a") and s.get("me", "c")
    one = ResponseStore(capacity=100, max_bytes=10_000)
    one.put("me", info("a"), answer("a" * 60))
    small = ResponseStore(capacity=100, max_bytes=int(2.5 * one.bytes))  # room for two answers of that size
    for rid in ("a", "b", "c"):
        small.put("me", info(rid), answer(rid * 60))
    assert small.bytes <= small.max_bytes and small.get("me", "c") and small.get("me", "b")
    assert not small.get("me", "a")
    small.put("me", info("huge"), answer("x" * 1000))  # alone past the bytes: not kept, nothing dropped
    assert small.get("me", "huge") is None and small.get("me", "c")


def test_each_owner_reads_and_deletes_only_its_own():
    s = ResponseStore(capacity=4, max_bytes=10_000)
    mine, theirs = ResponseStore.owner("Bearer one"), ResponseStore.owner("Bearer two")
    assert mine != theirs and ResponseStore.owner(None) == ""
    s.put(mine, info("a"), answer("hi"))
    assert s.get(theirs, "a") is None and not s.delete(theirs, "a")
    kept = s.get(mine, "a")
    assert kept.response["output"][1]["content"][0]["text"] == "hi"
    assert kept.conversation == ({"role": "user", "content": "a"}, {"role": "assistant", "content": "hi"})
    assert s.delete(mine, "a") and s.get(mine, "a") is None and s.bytes == 0


def test_turns_are_the_assistant_text_with_its_calls_and_no_reasoning():
    assert turns(answer("Let me look.", ("call_1", "f", '{"x": 1}'), ("call_2", "g", "{}"))["output"]) == [
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        }
    ]
    calls_alone = turns(answer("", ("call_3", "f", "{}"))["output"])
    assert calls_alone == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_3", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        }
    ]


def test_update_replaces_the_object_and_keeps_the_conversation():
    # a background response's status changes (queued, in_progress, failed, cancelled) in place
    s = ResponseStore(capacity=4, max_bytes=10_000)
    s.put("me", info("a"), {**answer(""), "status": "queued"})
    s.update("me", "a", {**answer(""), "status": "failed"})
    got = s.get("me", "a")
    assert got.response["status"] == "failed" and got.conversation == ({"role": "user", "content": "a"},)
    s.update("other", "a", {"status": "cancelled"})  # another owner's id: nothing
    s.update("me", "gone", {"status": "cancelled"})  # not kept: nothing
    assert s.get("me", "a").response["status"] == "failed" and s.get("me", "gone") is None
