"""The gateway's HTTP application: OpenAI's routes over one `RouterClient`.

    app = create_app(config, templates)      # a Starlette (ASGI) app; `python -m services.gateway` serves it

Why Starlette on uvicorn: vLLM's and SGLang's OpenAI servers run FastAPI, which is Starlette plus
pydantic models, on uvicorn; this gateway checks bodies by hand (to answer in OpenAI's error shape
naming the field), so it needs only Starlette's routing and responses. aiohttp would do too, but
the ASGI pair is what the field's servers and their users deploy and tune.

Cancellation. A generation runs inside `_Generation`, an ASGI response that watches the
connection (`receive()` -> `http.disconnect`) for its whole life, streamed or not, whatever ASGI
spec version the server declares (Starlette's StreamingResponse only watches under spec < 2.4;
under 2.4 it notices a gone client at the next write, which may be a long delta load away). A
client that goes away cancels the handler, which closes the router stream (`call.cancel()`), which
cancels the worker call, which frees the sequence. A background response (/v1/responses with
`background`) runs the same `_Generation` in a task of the app's lifespan instead, its answer
written into the response store; POST /v1/responses/{id}/cancel cancels that task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from bitdelta import grammar
from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.generation import (
    Constraint,
    ConstraintKind,
    FinishReason,
    GenerationError,
    SamplingDefaults,
    stop_reason_of,
)
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.rpc.clients.router import RouterCallError, RouterClient
from bitdelta.rpc.errors import without_addresses
from bitdelta.rpc.metrics import GatewayMetrics
from services.gateway import protocol as api
from services.gateway import responses as rsp
from services.gateway.adapters import Adapters, AdapterSettings
from services.gateway.catalog import Catalog, Own
from services.gateway.chat import ChatTemplate, ChatTemplateError
from services.gateway.config import GatewayConfig
from services.gateway.generation_config import GenerationConfigs
from services.gateway.protocol import ApiError
from services.gateway.reasoning import END, Reasoning, ReasoningStream
from services.gateway.tools import CallStream, ToolFormat

log = logging.getLogger("services.gateway")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # no proxy buffering of the stream


class Templates:
    """The base's chat template and the variants' own ones."""

    def __init__(self, base: ChatTemplate | None = None, variants: dict[str, ChatTemplate] | None = None):
        self.base, self.variants = base, dict(variants or {})

    @classmethod
    def from_config(cls, config: GatewayConfig) -> Templates:
        """Raises ChatTemplateError naming the file (the process then refuses to start)."""
        base = ChatTemplate.load(config.chat_template) if config.chat_template is not None else None
        return cls(base, {name: ChatTemplate.load(p) for name, p in config.variant_templates().items()})

    def for_model(self, model: str, own: ChatTemplate | None = None) -> ChatTemplate:
        """The flags' template of `model`, else its own (its delta's), else the base's."""
        t = self.variants.get(model) or own or self.base
        if t is None:
            raise ApiError(
                400,
                f"no chat template is configured for {model!r}: start the gateway with "
                "--chat-template (the base's tokenizer directory or tokenizer_config.json), or "
                "use /v1/completions with your own prompt",
                param="messages",
                code="chat_template_missing",
            )
        return t


class Tokens:
    """The base's tokenizer (every variant shares it) for /tokenize and /detokenize (vLLM's)."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
        config = Path(directory) / "config.json"
        self.max_model_len = None
        if config.is_file():
            self.max_model_len = json.loads(config.read_text()).get("max_position_embeddings")

    def tokenize(self, text: str, add_special_tokens: bool, token_strs: bool = False) -> dict:
        """vLLM's tokenize response: the ids, their count, the context and (`token_strs`) each id's
        token as the vocabulary spells it (else null)."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        strs = [self.tokenizer.id_to_token(i) for i in ids] if token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, ids: list[int]) -> dict:
        return {"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)}


class EventLog:
    """A background stream's server-sent events as they come, each with its sequence number, for
    any number of readers: the request that started it and later GETs that resume it."""

    def __init__(self, events: tuple[tuple[int, bytes], ...] = (), closed: bool = False) -> None:
        """events: those of an ended stream (closed), kept with its response."""
        self.events: list[tuple[int, bytes]] = list(events)
        self.error: dict | None = None  # the stream's error event, where it ended in one
        self.closed = closed
        self._more = anyio.Event()

    def add(self, data: bytes) -> None:
        """A write of the stream: its events (`event: ...` and `data: {...}` lines, a blank line after)."""
        for chunk in data.split(b"\n\n"):
            line = next((x for x in chunk.split(b"\n") if x.startswith(b"data: ")), None)
            if line is None:
                continue
            event = json.loads(line[len(b"data: ") :])
            self.events.append((event.get("sequence_number", len(self.events)), chunk + b"\n\n"))
            if event.get("type") == "error":
                self.error = event
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._more.set()
        self._more = anyio.Event()

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """The events numbered past `after`, those to come too, until the stream ends."""
        i = 0
        while True:
            more = self._more
            while i < len(self.events):
                seq, event = self.events[i]
                i += 1
                if seq > after:
                    yield event
            if self.closed:
                return
            await more.wait()


@dataclasses.dataclass(frozen=True)
class Background:
    """A background response while it runs: its task's cancel scope, and its events where it streams."""

    scope: anyio.CancelScope
    events: EventLog | None


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _start_events(send: Send) -> None:
    """A 200 whose body is server-sent events."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                *((k.encode(), v.encode()) for k, v in SSE_HEADERS.items()),
            ],
        }
    )


def tokenizer_not_served(model: str, param: str) -> ApiError:
    """400 for what needs a variant's own tokenizer here (its delta's, which only the workers hold)."""
    return api.invalid(
        param,
        f"model {model!r} reads text with its own tokenizer (its fine-tune's, carried in its delta), which only "
        "the workers hold: the gateway tokenizes and writes token ids with the base's only",
        code="tokenizer_not_served",
    )


def _truncated() -> ApiError:
    return ApiError(
        502, "the router's stream ended without a finish reason", type="server_error", code="truncated_stream"
    )


class _Merged:
    """A request's streams as one: every prompt's messages as they arrive (its first already read),
    each token's choice index moved to its prompt's range (prompt k's choice i is k·n + i). A batch
    has one reader task a stream, in the caller's task group; one prompt's stream is read directly
    (no task, no channel on the way). A stream's error is raised by `next` once the messages before
    it are read."""

    def __init__(self, firsts: list[pb.GenerateResponse], streams: list, n: int, tg: anyio.abc.TaskGroup):
        self.ready: list[pb.GenerateResponse] = [self._moved(k, m, n) for k, m in enumerate(firsts)]
        self.ready.reverse()  # popped from the end: prompt 0's first message first
        self.send, self.receive = anyio.create_memory_object_stream(float("inf"))
        self.only = streams[0] if len(streams) == 1 else None
        self.open = len(streams)
        for k, stream in enumerate(streams if self.only is None else ()):
            tg.start_soon(self._read, k, stream, n)

    @staticmethod
    def _moved(k: int, msg: pb.GenerateResponse, n: int) -> pb.GenerateResponse:
        for t in msg.tokens:
            t.index += k * n
        return msg

    async def _read(self, k: int, stream, n: int) -> None:
        try:
            async for msg in stream:
                self.send.send_nowait(self._moved(k, msg, n))
        except RouterCallError as e:
            self.send.send_nowait(e)
        self.send.send_nowait(None)  # this stream's end

    def close(self) -> None:
        self.send.close()
        self.receive.close()

    async def next(self) -> pb.GenerateResponse | None:
        """The next message of any prompt, or None once every stream has ended."""
        if self.ready:
            return self.ready.pop()
        if self.only is not None:
            return await anext(self.only, None)
        while self.open:
            item = await self.receive.receive()
            if item is None:
                self.open -= 1
            elif isinstance(item, RouterCallError):
                raise item
            else:
                return item
        return None


class _Generation(Response):
    """Runs one request's generations against the router (one per prompt, at once) and answers them
    (JSON or server-sent events), cancelling the router calls when the client disconnects (module
    docstring). `echoes`: each prompt's text before its choices' (completions' echo; chat's: the last
    message's content), else None."""

    def __init__(
        self,
        router: RouterClient,
        req: api.Request,
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float,
        echoes: list[str] | None = None,
        responses: rsp.ResponsesInfo | None = None,
        keep: Callable[[dict], None] | None = None,
    ):
        """responses: a /v1/responses request's (its chat request's answer goes out as a response
        object or its events); keep: called with that response object once it is whole (the store's)."""
        self.router, self.req, self.metadata, self.timeout_s, self.echoes = router, req, metadata, timeout_s, echoes
        self.responses, self.keep = responses, keep
        self.prompt_param = "prompt" if req.kind == "completion" else "input" if responses else "messages"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not done:
                    log.info("%s: the client disconnected; cancelling the generation", self.req.id)
                tg.cancel_scope.cancel()

            done = False
            tg.start_soon(watch)
            try:
                await self.run(send)
            finally:
                done = True
                tg.cancel_scope.cancel()

    def _error(self, e: RouterCallError) -> ApiError:
        details = e.details or str(e)
        if e.code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("sampling.constraint:"):
            # found by the worker's compile for its tokenizer (e.g. past llguidance's per-step limits)
            return api.constraint_error(self.req, GenerationError("sampling.constraint", details.split(": ", 1)[1]))
        return api.error_of_rpc(e.code, details, self.prompt_param)

    async def _send_json(self, send: Send, status: int, body: dict) -> None:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": data})

    def _request(self, k: int, prompt: api.Prompt) -> pb.GenerateRequest:
        r = self.req
        return pb.GenerateRequest(
            model_id=r.model,
            prompt=prompt.text,
            prompt_token_ids=prompt.token_ids,
            sampling=r.sampling.to_pb(),
            request_id=r.id if len(r.prompts) == 1 else f"{r.id}-{k}",  # vLLM's ids of a batch's prompts
            templated=not (r.add_special_tokens or prompt.token_ids),  # ids: used as they are
            priority=r.priority,
            cache_salt=r.cache_salt,
        )

    async def run(self, send: Send) -> None:
        """Run the generation and send its answer (or its error) through `send`, ASGI's messages: the
        connection's, or a background response's collector. Cancelling it cancels the router calls."""
        r = self.req
        streams = [
            self.router.generate_request(self._request(k, p), timeout_s=self.timeout_s, metadata=self.metadata)
            for k, p in enumerate(r.prompts)
        ]
        firsts: list[pb.GenerateResponse | BaseException | None] = [None] * len(streams)

        async def first(k: int, tg: anyio.abc.TaskGroup) -> None:
            try:
                firsts[k] = await anext(streams[k])
            except (RouterCallError, StopAsyncIteration) as e:
                firsts[k] = e
                tg.cancel_scope.cancel()  # one refusal answers the request: the other prompts stop

        try:
            async with anyio.create_task_group() as tg:
                # every prompt's first message before anything is sent: errors up to there get their own status
                for k in range(len(streams)):
                    tg.start_soon(first, k, tg)
            refused = next((got for got in firsts if isinstance(got, RouterCallError)), None)
            if refused is not None:
                return await self._fail(send, self._error(refused))
            if not all(isinstance(got, pb.GenerateResponse) for got in firsts):
                return await self._fail(
                    send,
                    ApiError(
                        502, "the router ended the stream without a token", type="server_error", code="empty_stream"
                    ),
                )
            merged: _Merged | None = None
            try:
                async with anyio.create_task_group() as tg:
                    merged = _Merged(firsts, streams, r.sampling.n, tg)
                    try:
                        if r.stream:
                            await self._stream(send, firsts, merged)
                        else:
                            await self._whole(send, firsts, merged)
                    finally:
                        tg.cancel_scope.cancel()  # the readers of streams that a failure left unread
            finally:
                if merged is not None:
                    merged.close()  # once every reader has stopped
        finally:
            with anyio.CancelScope(shield=True):
                for stream in streams:
                    await stream.aclose()  # cancels the router call if it is still running

    async def _fail(self, send: Send, e: ApiError) -> None:
        log.info("%s: %d %s", self.req.id, e.status, e.message[:200])
        await self._send_json(send, e.status, e.body())

    @staticmethod
    def _finish(tok: gen_pb.Token) -> str:
        finish = api.FINISH.get(FinishReason.from_pb(tok.finish_reason))
        if finish is None:
            raise ApiError(
                504,
                "the generation was cancelled before it finished (its deadline passed or the server is shutting down)",
                type="timeout_error",
                code="cancelled",
            )
        return finish

    async def _whole(self, send: Send, firsts: list[pb.GenerateResponse], merged: _Merged) -> None:
        tokens = []
        try:
            while (msg := await merged.next()) is not None:
                tokens.extend(msg.tokens)
        except RouterCallError as e:
            return await self._fail(send, self._error(e))
        r = self.req
        n = r.sampling.n
        by_choice: dict[int, list[gen_pb.Token]] = {}
        for t in tokens:
            by_choice.setdefault(t.index, []).append(t)
        choices, usages = [], {}
        prompt_lps = [api.prompt_logprobs(r, first.prompt_logprobs) for first in firsts]
        for i in range(n * len(r.prompts)):
            mine = by_choice.get(i, [])
            try:
                if not mine:
                    raise ApiError(
                        502, f"the router's stream has no choice {i}", type="server_error", code="truncated_stream"
                    )
                finish = self._finish(mine[-1])
            except ApiError as e:
                return await self._fail(send, e)
            k = i // n
            lps = api.logprobs(
                r, [t.logprobs for t in mine if t.HasField("logprobs")], prompt=firsts[k].prompt_logprobs
            )
            choices.append(
                dataclasses.replace(
                    api.with_tool_calls(r, [t.text for t in mine], finish, self.echoes[k] if self.echoes else ""),
                    logprobs=lps,
                    prompt_logprobs=prompt_lps[k],
                    token_ids=[t.token_id for t in mine],
                    prompt_token_ids=list(firsts[k].prompt_token_ids),
                    stop_reason=stop_reason_of(mine[-1]),
                )
            )
            usages[i] = mine[-1].usage
        if self.responses is not None:  # one choice (to_chat sends no n)
            c = choices[0]
            lps = c.logprobs["content"] if c.logprobs else None  # to_chat asks for them where include says so
            answer = rsp.whole(
                self.responses, r, c.text, c.finish, usages[0], c.tool_calls, c.reasoning, c.reasoning_tokens, lps
            )
            if self.keep is not None:
                self.keep(answer)
            return await self._send_json(send, 200, answer)
        await self._send_json(send, 200, api.response(r, choices, api.total_usage(usages, n)))

    async def _stream_responses(self, send: Send, merged: _Merged) -> None:
        """A /v1/responses stream: its typed events (responses.Events), one write per router message."""
        r = self.req
        ev = rsp.Events(self.responses, r)
        # tools: the text from where a call may begin is held, and sent as function_call items at the end
        calls = CallStream(r.tool_format) if r.tools is not None and r.tools.parsed else None
        thinking = ReasoningStream(r.reasoning) if r.reasoning is not None else None  # a reasoning parser's
        await _start_events(send)
        out = [ev.start()]
        lps: list[dict] = []  # tokens' logprobs not yet sent (a token whose text the next one carries)
        try:
            ended = False
            while not ended:
                msg = await merged.next()
                if msg is None:
                    raise _truncated()
                for tok in msg.tokens:
                    if tok.HasField("logprobs") and r.sampling.logprobs is not None:  # no tools, no parser here
                        lps += api.logprobs(r, [tok.logprobs])["content"]
                    thought, text = ("", tok.text) if thinking is None else thinking.add(tok.text)
                    if thought:
                        out.append(ev.thought(thought))
                    text = text if calls is None else calls.add(text)
                    if text:
                        out.append(ev.delta(text, lps))
                        lps = []
                    if tok.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED or tok.HasField("usage"):
                        finish, made = self._finish(tok), ()
                        if thinking is not None:  # what the parser held: a cut-off thinking, or content
                            thought, held = thinking.finish()
                            if thought:
                                out.append(ev.thought(thought))
                            held = held if calls is None else calls.add(held)
                            if held:
                                out.append(ev.delta(held))
                            ev.reasoning_tokens = thinking.pieces
                        if calls is not None:
                            rest, made, finish = calls.finish(finish)
                            if rest:
                                out.append(ev.delta(rest))
                        ev.logprobs += lps  # a last token of no text of its own
                        out.append(ev.end(finish, tok.usage, made))
                        if self.keep is not None:
                            self.keep(ev.final)
                        ended = True
                        break
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                out.clear()
        except RouterCallError as e:  # after the status went out: an error event ends the stream
            out.append(ev.error(self._error(e)))
        except ApiError as e:
            out.append(ev.error(e))
        await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})

    async def _stream(self, send: Send, firsts: list[pb.GenerateResponse], merged: _Merged) -> None:
        if self.responses is not None:
            return await self._stream_responses(send, merged)
        r = self.req
        await _start_events(send)

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        n = r.sampling.n
        total = n * len(r.prompts)
        counts = [0] * total  # each choice's tokens so far (continuous usage)

        def chunk(text: str | None, *args, index: int, **kw) -> dict:
            """Choice `index`'s chunk; with continuous usage, its prompt's and its own tokens so far."""
            so_far = (len(firsts[index // n].prompt_token_ids), counts[index]) if r.continuous_usage else None
            return api.chunk(r, text, *args, index=index, usage_so_far=so_far, **kw)

        # return_token_ids: the prompt's ids once, on the stream's first chunk (chat, a response's field)
        # or on each choice's first (completions): popped by whichever chunk comes first
        prompt_ids: dict[int, tuple[int, ...]] = {}
        if r.return_token_ids:
            prompt_ids = {i: tuple(firsts[i // n].prompt_token_ids) for i in range(1 if r.kind == "chat" else total)}
        if r.kind == "chat":  # OpenAI's first chat chunk of each choice: the role
            for i in range(total):
                await body(_sse(chunk("", first=True, index=i, prompt_token_ids=prompt_ids.pop(i, None))))
        offsets = [0] * total
        if self.echoes:  # each choice starts with its prompt (and its tokens' logprobs)
            for k, echo in enumerate(self.echoes):
                lp = api.logprobs(r, [], prompt=firsts[k].prompt_logprobs) if r.kind == "completion" else None
                offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp else 0
                for i in range(k * n, (k + 1) * n):
                    offsets[i] = offset
                    await body(_sse(chunk(echo, logprobs=lp, index=i, prompt_token_ids=prompt_ids.pop(i, None))))
        usages: dict[int, gen_pb.Usage] = {}
        # tools: each choice's text from where a call may begin is held, and sent as tool_calls at its end
        calls = [CallStream(r.tool_format) for _ in range(total)] if r.tools is not None and r.tools.parsed else None
        # a reasoning parser: each choice's thinking sent as `reasoning`, only its content reaches the tools
        thinking = [ReasoningStream(r.reasoning) for _ in range(total)] if r.reasoning is not None else None
        # One SSE event per token (the chunks a per-token stream gives), a router message's events in one
        # write: a message holds every token the router had ready, so a slow client costs fewer writes.
        events: list[bytes] = []
        try:
            while len(usages) < total:
                msg = await merged.next()
                if msg is None:
                    raise _truncated()
                for tok in msg.tokens:
                    i = tok.index
                    counts[i] += 1
                    lp = api.logprobs(r, [tok.logprobs], offsets[i]) if tok.HasField("logprobs") else None
                    thought, text = ("", tok.text) if thinking is None else thinking[i].add(tok.text)
                    thought = thought if r.include_reasoning else ""
                    text = text if calls is None else calls[i].add(text)
                    if text or thought or lp is not None or r.return_token_ids:  # every token's id has its chunk
                        ids = prompt_ids.pop(i, None)
                        piece = chunk(
                            text if text or not thought else None,
                            logprobs=lp,
                            index=i,
                            token_ids=(tok.token_id,),
                            prompt_token_ids=ids,
                            reasoning=thought,
                        )
                        events.append(_sse(piece))
                        offsets[i] += len(tok.text)
                    if tok.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED or tok.HasField("usage"):
                        finish = self._finish(tok)
                        if thinking is not None:  # what the parser held: a cut-off thinking, or content
                            thought, held = thinking[i].finish()
                            held = held if calls is None else calls[i].add(held)
                            if (thought and r.include_reasoning) or held:
                                reasoning = thought if r.include_reasoning else ""
                                events.append(_sse(chunk(held or None, index=i, reasoning=reasoning)))
                        if calls is not None:
                            rest, made, finish = calls[i].finish(finish)
                            if rest:
                                events.append(_sse(chunk(rest, index=i)))
                            if made:
                                events.append(_sse(chunk(None, tool_calls=made, index=i)))
                        end = chunk(None if r.kind == "chat" else "", finish, index=i, stop_reason=stop_reason_of(tok))
                        events.append(_sse(end))
                        usages[i] = tok.usage
                        if len(usages) == total:
                            break
                if events:
                    await body(b"".join(events))
                    events.clear()
            if r.include_usage:
                await body(_sse(api.usage_chunk(r, api.total_usage(usages, n))))
        except RouterCallError as e:  # after the first token: the status is sent, so the error is an event
            err = self._error(e)
            log.info("%s: stream ended by %d %s", r.id, err.status, err.message[:200])
            await body(b"".join(events) + _sse(err.body()))
        except ApiError as e:  # the events of the message's tokens before it go first
            await body(b"".join(events) + _sse(e.body()))
        await body(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# vLLM's /tokenize fields, of a prompt and of messages (a field not named is 400)
TOKENIZE_PROMPT = ("model", "prompt", "add_special_tokens", "return_token_strs")
TOKENIZE_CHAT = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens")
TOKENIZE_CHAT += ("chat_template_kwargs", "tools", "return_token_strs")

# The metrics' route label of a path with an id in it (one series per route, whatever the ids): its
# prefix, the suffix after the id, the label; the first that matches
ROUTE_PREFIXES = (
    ("/v1/models/", "", "/v1/models/{model}"),
    ("/v1/responses/", "/cancel", "/v1/responses/{response_id}/cancel"),
    ("/v1/responses/", "", "/v1/responses/{response_id}"),
)
ROUTES = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/health",
    "/ready",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)


class _Measured:
    """ASGI middleware: every HTTP request counted and timed by route, model and status. The model
    label is the request's model only when the router served it with 200 or listed it (`known`);
    anything else is "other", so made-up ids cannot grow the series."""

    def __init__(self, app, metrics: GatewayMetrics, known: set[str]):
        self.app, self.metrics, self.known = app, metrics, known

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), 500

        async def watched(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            path = scope["path"]
            route = (
                path
                if path in ROUTES
                else next((r for p, s, r in ROUTE_PREFIXES if path.startswith(p) and path.endswith(s)), "other")
            )  # an id in the path: one label for the route, not one series per id
            model = scope.get("state", {}).get("model")
            if model and status == 200:
                self.known.add(model)
            label = model if model in self.known else "other" if model else ""
            m = self.metrics
            m.requests.labels(route, label, str(status)).inc()
            m.latency.labels(route, label).observe(time.perf_counter() - t0)
            if status >= 400:
                m.errors.labels(route, label).inc()


def create_app(
    config: GatewayConfig, templates: Templates | None = None, generation: GenerationConfigs | None = None
) -> Starlette:
    """`generation`: the models' sampling defaults (none: neutral ones)."""
    templates = templates or Templates()
    generation = generation or GenerationConfigs()
    catalog = Catalog(lambda md: state["router"].list_models(metadata=md), ttl_s=config.model_refresh_s)
    state: dict[str, RouterClient] = {}
    metrics, known = GatewayMetrics(), set()  # known: models the router listed or served
    kept = rsp.ResponseStore(config.responses_store, config.responses_store_bytes) if config.responses_store else None
    # background responses running: (owner, id) -> its task's cancel scope and, streamed, its events
    running: dict[tuple[str, str], Background] = {}
    tasks: dict[str, anyio.abc.TaskGroup] = {}  # "background": the lifespan's task group

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["router"] = RouterClient(
            config.router,
            timeout_s=config.call_timeout_s,
            generate_timeout_s=config.request_timeout_s,
            credentials=config.channel_credentials(),
        )
        log.info(
            "gateway for router %s; chat template: %s",
            config.router,
            templates.base.origin if templates.base else "none (chat answers 400)",
        )
        for model, d in (("the base", generation.base), *generation.variants.items()):
            if d.changed():  # vLLM warns the same way: a client that sets none of them gets these
                log.warning(
                    "sampling defaults of %s from its generation config (%s): %s; --generation-config vllm "
                    "for neutral ones",
                    model if model == "the base" else repr(model),
                    generation.origin if model == "the base" else "--variant-generation-configs",
                    d.changed(),
                )
        try:
            async with anyio.create_task_group() as tg:
                tasks["background"] = tg
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()  # the background responses still running
        finally:
            await state["router"].close()

    async def read_json(request: HttpRequest) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > config.max_body_bytes:
            raise ApiError(
                413,
                f"request body of {size} bytes is larger than this gateway accepts ({config.max_body_bytes})",
                code="body_too_large",
            )
        chunks, n = [], 0
        async for c in request.stream():
            n += len(c)
            if n > config.max_body_bytes:
                raise ApiError(
                    413,
                    f"request body is larger than this gateway accepts ({config.max_body_bytes})",
                    code="body_too_large",
                )
            chunks.append(c)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise api.invalid(None, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:  # the decoder recurses once per level of nesting
            raise api.invalid(None, "the request body is nested too deeply", code="invalid_json") from None

    def metadata(request: HttpRequest) -> tuple[tuple[str, str], ...]:
        auth = request.headers.get("authorization")
        return (("authorization", auth),) if auth else ()

    async def list_models(request: HttpRequest) -> Response:
        try:
            models = await state["router"].list_models(metadata=metadata(request))  # lists what the token may use
        except RouterCallError as e:
            raise api.error_of_rpc(e.code, e.details or str(e)) from None
        catalog.update(models)
        listed = api.model_list(models, config.owned_by, max_model_len)
        known.update(m["id"] for m in listed["data"])
        return JSONResponse(listed)

    async def get_model(request: HttpRequest) -> Response:
        name = request.path_params["model"]
        request.state.model = name
        try:
            models = await state["router"].list_models(metadata=metadata(request))
        except RouterCallError as e:
            raise api.error_of_rpc(e.code, e.details or str(e)) from None
        for m in api.model_list(models, config.owned_by, max_model_len)["data"]:
            if m["id"] == name:
                return JSONResponse(m)
        raise ApiError(
            404,
            f"model {name!r} does not exist or cannot be served; /v1/models lists the base and every servable variant",
            param="model",
            code="model_not_found",
        )

    async def check_constraint(req: api.Request) -> None:
        """400 at once for a constraint that does not compile (bitdelta.grammar.check: on a thread,
        cached per constraint), before anything reaches the router."""
        for i, t in enumerate(req.tools.tools if req.tools else ()):
            schema = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(t.parameters))
            try:
                await anyio.to_thread.run_sync(grammar.check, schema)
            except GenerationError as e:
                message = str(e).removeprefix("sampling.constraint: ")
                raise api.invalid(
                    "tools", f"tools[{i}].function.parameters: {message}", code="invalid_constraint"
                ) from None
        c = req.sampling.constraint
        if c is not None:
            try:
                await anyio.to_thread.run_sync(grammar.check, c)
            except GenerationError as e:
                raise api.constraint_error(req, e) from None

    tokens = Tokens(config.tokenizer) if config.tokenizer is not None else None
    max_model_len = tokens.max_model_len if tokens is not None else None  # the model cards' (vLLM's)

    def echoes(req: api.Request, own: Own) -> list[str] | None:
        """Each prompt's text for `echo` (token ids decoded with the gateway's tokenizer), else None."""
        if not req.echo:
            return None
        if own.own_tokenizer and any(p.token_ids for p in req.prompts):
            raise tokenizer_not_served(req.model, "echo")
        if tokens is None and any(p.token_ids for p in req.prompts):
            raise api.invalid(
                "echo",
                "echo with a token-id prompt: start the gateway with --tokenizer (the base's directory) "
                "to write the prompt's text",
                code="tokenizer_missing",
            )
        vocab = tokens.tokenizer.get_vocab_size(with_added_tokens=True) if tokens is not None else 0
        out = []
        for k, p in enumerate(req.prompts):
            if p.token_ids and max(p.token_ids) >= vocab:
                raise api.invalid("prompt", f"prompt[{k}]: {max(p.token_ids)} is not a token of this model")
            out.append(tokens.detokenize(list(p.token_ids))["prompt"] if p.token_ids else p.text)
        return out

    async def own_of(request: HttpRequest, body: Any) -> tuple[Own, SamplingDefaults]:
        """The body's model's own chat template and sampling defaults (its delta's, the router lists),
        and the sampling defaults its requests get (the flags', else its own, else the base's)."""
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            return Own(), generation.base  # the parser answers 400
        own = await catalog.own(model, metadata(request))
        if own.error:
            raise ApiError(500, own.error, type="server_error", code="model_files_error")
        return own, generation.for_model(model, own.defaults)

    async def completions(request: HttpRequest) -> Response:
        body = await read_json(request)
        own, defaults = await own_of(request, body)
        req = api.parse_completion(body, config.completion_default_max_tokens, defaults)
        request.state.model = req.model  # the metrics' label (_Measured)
        await check_constraint(req)
        return _Generation(state["router"], req, metadata(request), config.request_timeout_s, echoes(req, own))

    async def chat_completions(request: HttpRequest) -> Response:
        body = await read_json(request)
        own, defaults = await own_of(request, body)
        return await chat_generation(request, api.parse_chat(body, defaults), own)

    async def responses(request: HttpRequest) -> Response:
        body = await read_json(request)
        owner = rsp.ResponseStore.owner(request.headers.get("authorization"))
        previous, prev_id = None, rsp.previous_id(body)
        if prev_id is not None and kept is not None:
            previous = kept.get(owner, prev_id)
            if previous is None:
                raise _no_response(prev_id, "previous_response_id")
        chat, info = rsp.to_chat(body, previous, keeping=kept is not None)
        own, defaults = await own_of(request, body)
        try:
            req = api.parse_chat(chat, defaults)
        except ApiError as e:
            raise rsp.renamed(e) from None
        req.id = info.id
        keep = (lambda answer: kept.put(owner, info, answer)) if info.store else None
        try:
            gen = await chat_generation(request, req, own, info, keep)
        except ApiError as e:
            raise rsp.renamed(e) from None
        if not info.background:
            return gen
        if len(running) >= config.responses_store:
            raise ApiError(
                429,
                f"this gateway runs at most {config.responses_store} background responses at once (its store's size)",
                type="rate_limit_error",
                code="too_many_background_responses",
            )
        queued = rsp.response(info, req, "queued", [])
        kept.put(owner, info, queued)
        bg = running[owner, info.id] = Background(anyio.CancelScope(), EventLog() if req.stream else None)
        tasks["background"].start_soon(in_background, gen, owner, info, bg)
        if bg.events is None:
            return JSONResponse(queued)
        return _events(bg.events, -1)  # a connection that goes away stops reading, not the response

    async def in_background(gen: _Generation, owner: str, info: rsp.ResponsesInfo, bg: Background) -> None:
        """Run a background response: in_progress, then its answer kept by the generation (completed
        or incomplete), or failed with the error its caller would have been answered; a cancelled
        one was stored by the cancel route. A stream's events go to `events` and are kept with it."""
        scope, events = bg.scope, bg.events
        sent: dict[str, Any] = {"body": b""}

        async def collect(message) -> None:
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
            elif message["type"] == "http.response.body" and events is not None and sent.get("status") == 200:
                events.add(message.get("body", b""))
            elif message["type"] == "http.response.body":
                sent["body"] += message.get("body", b"")

        try:
            try:
                with scope:
                    if not scope.cancel_called:  # else cancelled before it started: it stays so
                        kept.update(owner, info.id, rsp.response(info, gen.req, "in_progress", []))
                    await gen.run(collect)
            except Exception:  # the response fails; the gateway and its other responses go on
                log.exception("%s: the background response failed", info.id)
                sent["status"] = 500
            error = None
            if sent.get("status") != 200 and not scope.cancel_called:
                try:
                    error = json.loads(sent["body"])["error"]
                except (ValueError, KeyError, TypeError):
                    error = {"message": "the response could not be generated", "code": "server_error"}
                if events is not None:  # refused before its first event: the stream's one event says why
                    events.add(
                        rsp.Events(info, gen.req).failure(error.get("code"), error["message"], error.get("param"))
                    )
            elif events is not None and events.error is not None:
                error = events.error
            got = kept.get(owner, info.id)  # cancelled: as the cancel route kept it
            if got is None:  # dropped (DELETE, or evicted) while it ran
                return
            response = got.response
            if error is not None:
                response = rsp.response(
                    info, gen.req, "failed", [], error={"code": error.get("code"), "message": error["message"]}
                )
            if events is not None:  # kept with its events, for GET ?stream=true
                kept.put(owner, info, response, tuple(events.events))
            elif error is not None:
                kept.update(owner, info.id, response)
            # else: the generation kept its answer (completed or incomplete), or the cancel route its state
        finally:  # also where the gateway stops it (shutdown): its readers end
            running.pop((owner, info.id), None)
            if events is not None:
                events.close()

    def _no_response(response_id: str, param: str | None = None) -> ApiError:
        return ApiError(
            404,
            f"no stored response {response_id[:64]!r}"
            + ("" if kept is not None else ": this server keeps none (start the gateway with --responses-store N)"),
            param=param,
            code="response_not_found",
        )

    async def stored_response(request: HttpRequest) -> Response:
        """GET /v1/responses/{id}: a kept response object; DELETE: drop it (OpenAI's deleted object).
        404 for one this caller's authorization header did not make."""
        response_id = request.path_params["response_id"]
        if kept is None:
            raise _no_response(response_id)
        owner = rsp.ResponseStore.owner(request.headers.get("authorization"))
        if request.method == "DELETE":
            if not kept.delete(owner, response_id):
                raise _no_response(response_id)
            bg = running.pop((owner, response_id), None)
            if bg is not None:  # a background response still running: its generation stops
                bg.scope.cancel()
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        got = kept.get(owner, response_id)
        if got is None:
            raise _no_response(response_id)
        stream = request.query_params.get("stream", "false")
        if stream not in ("true", "false"):
            raise api.invalid("stream", "stream must be true or false")
        if stream == "false":
            return JSONResponse(got.response)
        after = request.query_params.get("starting_after", "-1")
        if not after.lstrip("-").isdigit() or int(after) < -1:
            raise api.invalid("starting_after", "starting_after must be an event's sequence number (or -1)")
        bg = running.get((owner, response_id))
        live = None if bg is None else bg.events
        if live is None and not got.events:
            raise api.invalid(
                "stream",
                f"response {response_id[:64]!r} has no events to stream (only a background response created with "
                "stream keeps them): GET it without stream",
            )
        return _events(live or EventLog(got.events, closed=True), int(after))

    def _events(events: EventLog, after: int) -> StreamingResponse:
        return StreamingResponse(events.follow(after), media_type="text/event-stream", headers=SSE_HEADERS)

    async def cancel_response(request: HttpRequest) -> Response:
        """POST /v1/responses/{id}/cancel: a background response still queued or in progress stops and
        is answered (and kept) as cancelled; any other is 400, one this caller did not make 404."""
        response_id = request.path_params["response_id"]
        if kept is None:
            raise _no_response(response_id)
        owner = rsp.ResponseStore.owner(request.headers.get("authorization"))
        got = kept.get(owner, response_id)
        if got is None:
            raise _no_response(response_id)
        status = got.response["status"]
        bg = running.get((owner, response_id))
        if bg is None or status not in rsp.RUNNING:
            raise api.invalid(
                "response_id",
                f"cannot cancel a response that is already {status}"
                if got.response.get("background")
                else "cannot cancel a synchronous response (only a background one, while it runs)",
            )
        cancelled = {**got.response, "status": "cancelled"}
        kept.update(owner, response_id, cancelled)
        bg.scope.cancel()
        return JSONResponse(cancelled)

    def rendered(template: ChatTemplate, req: api.Request) -> str:
        """A parsed chat request's prompt as its model's template writes it (messages, tools, documents
        and the template's flags); 400 naming `messages` where the template refuses them."""
        try:
            return template.render(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=[t.to_template() for t in req.tools.tools] if req.tools else None,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.template_kwargs,
                content_format=config.chat_template_content_format,
                documents=req.documents,
            )
        except ChatTemplateError as e:
            raise api.invalid("messages", str(e), code="chat_template_error") from None

    async def chat_generation(
        request: HttpRequest,
        req: api.Request,
        own: Own,
        responses: rsp.ResponsesInfo | None = None,
        keep: Callable[[dict], None] | None = None,
    ) -> _Generation:
        """A parsed chat request rendered with its model's template (and its tools' grammar), checked,
        and run: its answer as chat's, or as a response object (`responses`)."""
        request.state.model = req.model
        template = templates.for_model(req.model, own.template)
        tools = req.tools
        req.reasoning = Reasoning.of(config.reasoning_parser, req.template_kwargs)
        if responses is not None and responses.logprobs and req.reasoning is not None:
            raise api.invalid(
                "include",
                "token logprobs beside a reasoning parser are not served by /v1/responses (the parser splits the "
                "text the tokens make into a thinking and an answer)",
            )
        if req.documents is not None and not template.reads_documents:
            raise api.invalid(
                "documents",
                f"the chat template of {req.model!r} does not read documents: they would be left out of the prompt",
            )
        req.prompts = (api.Prompt(text=rendered(template, req)),)
        if tools is not None:
            req.tool_format = ToolFormat.of_template(template.source)
            if req.tool_format.special_opener and tools.parsed:  # a call's opener is a special token: its
                req.sampling = dataclasses.replace(req.sampling, skip_special_tokens=False)  # text kept, as vLLM's
            c = tools.constraint(req.tool_format)  # required / named: the grammar of the calls
            if c is not None:
                if req.sampling.constraint is not None:
                    raise api.invalid(
                        req.constraint_param,
                        f"tool_choice {tools.mode.value} and {req.constraint_param}: one constraint per request",
                    )
                req.sampling = dataclasses.replace(req.sampling, constraint=c)
                req.constraint_param = "tool_choice"
        bound = req.sampling.constraint
        if req.reasoning is not None and req.reasoning.thinking and bound is not None:
            # as vLLM: the thinking is free, the constraint binds the answer after it
            req.sampling = dataclasses.replace(req.sampling, constraint=dataclasses.replace(bound, after=END))
        await check_constraint(req)
        echo = req.chat_echo()
        return _Generation(
            state["router"],
            req,
            metadata(request),
            config.request_timeout_s,
            None if echo is None else [echo],
            responses=responses,
            keep=keep,
        )

    async def known_model(request: HttpRequest, body: Any) -> str:
        """The body's model, which the router must list (404 otherwise)."""
        if not isinstance(body, dict):
            raise api.invalid(None, "the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise api.invalid("model", "model must be a non-empty string: the variant's id from /v1/models")
        request.state.model = model
        try:
            models = await state["router"].list_models(metadata=metadata(request))
        except RouterCallError as e:
            raise api.error_of_rpc(e.code, e.details or str(e)) from None
        catalog.update(models)  # what own_of reads next: no second listing
        listed = api.model_list(models, config.owned_by, max_model_len)
        if model not in {m["id"] for m in listed["data"]}:
            raise ApiError(404, f"model {model!r} does not exist", param="model", code="model_not_found")
        if tokens is None:
            raise ApiError(
                400, "start the gateway with --tokenizer (the base's directory) to tokenize", code="tokenizer_missing"
            )
        if catalog.models.get(model, Own()).own_tokenizer:
            raise tokenizer_not_served(model, "model")
        return model

    async def tokenize(request: HttpRequest) -> Response:
        """vLLM's /tokenize: a prompt, or messages rendered as chat renders them (their tools too)."""
        body = await read_json(request)
        model = await known_model(request, body)
        chat = "messages" in body
        unknown = next((k for k in body if k not in (TOKENIZE_CHAT if chat else TOKENIZE_PROMPT)), None)
        if unknown is not None:
            shown = str(unknown)[:64]
            raise api.invalid(shown, f"{shown} is not a field of /tokenize with {'messages' if chat else 'a prompt'}")
        strs = body.get("return_token_strs", False)
        if not isinstance(strs, bool):
            raise api.invalid("return_token_strs", "return_token_strs must be true or false")
        if chat:
            r = api.parse_chat({k: v for k, v in body.items() if k != "return_token_strs"})
            text = rendered(templates.for_model(model, (await own_of(request, body))[0].template), r)
            return JSONResponse(tokens.tokenize(text, r.add_special_tokens, strs))
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise api.invalid("prompt", "prompt must be a string (or send messages)")
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise api.invalid("add_special_tokens", "add_special_tokens must be true or false")
        return JSONResponse(tokens.tokenize(prompt, add, strs))

    async def detokenize(request: HttpRequest) -> Response:
        body = await read_json(request)
        await known_model(request, body)
        ids = body.get("tokens")
        vocab = tokens.tokenizer.get_vocab_size(with_added_tokens=True)
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
        ):
            raise api.invalid("tokens", f"tokens must be a list of token ids below {vocab}")
        return JSONResponse(tokens.detokenize(ids))

    async def router_names(md: tuple[tuple[str, str], ...]) -> set[str]:
        try:
            return {m.model_id for m in await state["router"].list_models(metadata=md)}
        except RouterCallError as e:
            raise api.error_of_rpc(e.code, e.details or str(e)) from None

    adapters = None
    if config.lora_base is not None:
        assert config.lora_root is not None and config.delta_store is not None  # GatewayConfig.check_lora
        settings = AdapterSettings(
            config.lora_base, config.lora_root, config.delta_store, config.channel_credentials(), config.lora_timeout_s
        )
        adapters = Adapters(settings, router_names)

    async def load_lora_adapter(request: HttpRequest) -> Response:
        assert adapters is not None
        return PlainTextResponse(await adapters.load(await read_json(request), metadata(request)))

    async def unload_lora_adapter(request: HttpRequest) -> Response:
        assert adapters is not None
        return PlainTextResponse(await adapters.unload(await read_json(request), metadata(request)))

    async def prometheus(request: HttpRequest) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: HttpRequest) -> Response:
        try:
            await state["router"].list_models(timeout_s=min(config.call_timeout_s, 2.0))
        except RouterCallError as e:
            if e.code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                detail = without_addresses(e.details or str(e))
                return JSONResponse({"status": "router unavailable", "detail": detail}, status_code=503)
            # the router answered (it checks tokens and this probe has none): it is up
        return JSONResponse({"status": "ok"})

    async def on_api_error(request: HttpRequest, e: ApiError) -> Response:
        return error_response(e)

    async def on_http_error(request: HttpRequest, e: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code))

    async def on_crash(request: HttpRequest, e: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=e)
        return error_response(
            ApiError(
                500,
                f"internal error ({type(e).__name__}); the gateway's log has the details",
                type="server_error",
                code="internal_error",
            )
        )

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    if adapters is not None:  # vLLM's runtime adapter routes (without: 404, as vLLM's)
        routes += [
            Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(_Measured, metrics=metrics, known=known)],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash},
    )
