"""The router's core: validate, look up, admit, place, stream from a worker, retry once.

    router = Router(config, pool, registry)
    async for ready in router.generate(Request(model_id="coder", prompt="def f(")):
        ...   # [TokenEvent]: the worker's, timed from the router; the first says where and how long

Admission. A request runs on a worker with room (`max_in_flight_per_worker`); when every
candidate is full it waits in a bounded queue (`admission.Admission`: per variant and in total; by the
request's priority, lower first, then FIFO); beyond those bounds it gets RESOURCE_EXHAUSTED at once.
While anyone waits, newcomers queue behind them. The priority travels on to the worker.

Placement (`placement.choose_worker`) keeps a variant on the workers that already hold it, so
concurrent requests share one resident delta and one load. A request that fails with a
retryable status (UNAVAILABLE) before its first token is retried once on another worker; after
its first token a failure reaches the client (tokens cannot be taken back).

Streaming. The worker's messages are read as they come (`_read_ahead`, a task) into a queue; each
time the servicer is ready to write, it takes every token the queue holds (`take_ready`): a client
that keeps up gets one token per message, a slower one fewer, fuller messages, never a later token.

Deadlines and cancellation: the worker call gets the time the client has left; a client that
goes away cancels the handler, which cancels the worker call, which frees the sequence.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from bitdelta.generation import ArrivalState, Request, TokenEvent, Ttft
from bitdelta.rpc import telemetry
from bitdelta.rpc.errors import RpcError, clip, clip_message
from bitdelta.rpc.security import Principal
from bitdelta.rpc.streams import first_alone, take_ready
from bitdelta.rpc.wire.gpu_worker import request_to_pb
from services.router.admission import Admission
from services.router.config import RouterConfig
from services.router.errors import DeadlineExceeded, InvalidArgument, PermissionDenied, Unavailable, WorkerFailed
from services.router.placement import choose_worker
from services.router.pool import WorkerPool
from services.router.registry import Registry, Variant

log = logging.getLogger("services.router")


@dataclass(frozen=True)
class ModelEntry:
    """One row of ListModels."""

    variant: Variant
    servable: bool
    reason: str
    resident_on: tuple[str, ...]
    loading_on: tuple[str, ...]
    in_flight: int


@dataclass(frozen=True)
class WorkerEntry:
    """One row of ListWorkers."""

    address: str
    up: bool
    reason: str
    device: str
    resident: frozenset[str]
    in_flight: int
    capacity: int
    used_bytes: int
    budget_bytes: int


class Router:
    def __init__(self, config: RouterConfig, pool: WorkerPool, registry: Registry):
        self.config, self.pool, self.registry = config, pool, registry
        self.admission = Admission(config.max_queue, config.max_queue_per_variant)
        self.in_flight: collections.Counter[str] = collections.Counter()  # model_id -> admitted, not finished
        pool.on_change = self.admission.wake_all

    async def start(self) -> None:
        await self.pool.start()
        await self.registry.start()

    async def close(self) -> None:
        await self.registry.close()
        await self.pool.close()

    # -- Generate ------------------------------------------------------------------------------------
    def validate(self, p: Request) -> None:
        p.validate()
        if not p.prompt and not p.prompt_token_ids:
            raise InvalidArgument("prompt: must not be empty")
        limit = self.config.max_prompt_bytes
        if p.prompt_token_ids:  # as on the wire: up to 4 bytes an id
            if 4 * len(p.prompt_token_ids) > limit:
                raise InvalidArgument(
                    f"prompt_token_ids: {len(p.prompt_token_ids)} ids (4 bytes each) is more than this router "
                    f"accepts ({limit} bytes)"
                )
        elif (n := len(p.prompt.encode("utf-8", "surrogatepass"))) > limit:
            raise InvalidArgument(f"prompt: {n} bytes is more than this router accepts ({limit})")
        if p.sampling.max_new_tokens > self.config.max_new_tokens_limit:
            raise InvalidArgument(
                f"sampling.max_new_tokens: {p.sampling.max_new_tokens} is more than this router allows "
                f"({self.config.max_new_tokens_limit})"
            )

    async def generate(self, p: Request, principal: Principal | None = None) -> AsyncIterator[list[TokenEvent]]:
        """The worker's events, timed from their arrival at the router, each item every token ready
        when the caller asks (the worker's stream is read ahead, so a caller slower than the worker
        gets several per item; at most --stream-max-tokens); the first token, alone in the first
        item, carries the worker, the
        arrival state and the whole TTFT (queue_ms and total_ms the router's). `principal`: the
        caller's token (None: auth off), checked before the lookup."""
        t0 = time.monotonic()
        self.validate(p)
        if self.pool.family_base() is None:
            await self.pool.poll_all()  # no worker has answered yet (e.g. just started): ask now
        if principal is not None:
            self.check_allowed(principal, p.model_id)  # before the lookup: a refusal says nothing of what exists
        variant = await self.registry.lookup(p.model_id, self.pool.family_base())
        deadline = p.deadline if p.deadline is not None else t0 + self.config.request_timeout_s
        request = request_to_pb(dataclasses.replace(p, model_id=variant.key or ""))
        self.in_flight[variant.model_id] += 1
        tried: list[str] = []
        try:
            while True:
                with telemetry.tracer().start_as_current_span("router.placement") as span:
                    address, arrival = await self._place(variant, tried, deadline, p.priority)
                    span.set_attributes({"worker": address, "arrival_state": arrival.value, "retry": bool(tried)})
                queue_ms = (time.monotonic() - t0) * 1e3
                w = self.pool.workers[address]
                started = False
                source = w.client.stream(request, timeout_s=max(0.001, deadline - time.monotonic()))
                relay = _read_ahead(source, t0, self.config.stream_max_tokens)
                try:
                    async for ready in relay:
                        first, started = not started, True
                        if first:
                            ev = ready[0]
                            if variant.key is not None:
                                self.pool.note_resident(address, variant.key)
                                if ev.arrival is not None:  # the worker knows the truth; our view may be stale
                                    arrival = ev.arrival
                            ttft = ev.ttft or Ttft()
                            ready[0] = dataclasses.replace(
                                ev,
                                worker=address,
                                arrival=arrival,
                                ttft=dataclasses.replace(ttft, queue_ms=queue_ms, total_ms=ev.elapsed_ms),
                            )
                        for message in first_alone(ready, first):  # the first token alone, as from the worker
                            yield message
                    return
                except RpcError as e:
                    log.info("request for %r on %s: %s", variant.model_id, address, clip_message(str(e)))
                    if started or not e.retryable or tried:
                        raise WorkerFailed(e) from None
                    tried.append(address)
                    if not await self.pool.poll(address):  # the worker itself is gone, not just this call
                        self.pool.mark_down(address, f"Generate failed: {e.details[:200]}")
                    if not self.pool.any_up(exclude=tried):
                        await self.pool.poll_all(exclude=tried)  # the view may be a poll old: ask now
                    if not self.pool.any_up(exclude=tried):
                        raise WorkerFailed(e) from None
                    log.warning(
                        "request for %r failed on %s before its first token (%s); retrying elsewhere",
                        variant.model_id,
                        address,
                        e.code.name,
                    )
                finally:
                    try:
                        await relay.aclose()  # now, not when collected: it cancels the worker call
                    finally:
                        self.pool.release(address, variant.key)
        finally:
            self.in_flight[variant.model_id] -= 1
            if self.in_flight[variant.model_id] <= 0:
                del self.in_flight[variant.model_id]

    def check_allowed(self, who: Principal, model_id: str) -> None:
        """PERMISSION_DENIED unless `who`'s token may use `model_id` ("" or the base's name: the base)."""
        base = self.pool.family_base()
        is_base = not model_id or (base is not None and model_id == base.name)
        name = base.name if is_base and base is not None else (model_id or "base")
        if not who.may_use(name, is_base):
            shown = "the base" if is_base else f"model {clip(model_id)}"
            raise PermissionDenied(f"token {who.name!r} may not use {shown}; it may use {who.shown_variants()}")

    async def _place(
        self, variant: Variant, exclude: list[str], deadline: float, priority: int = 0
    ) -> tuple[str, ArrivalState]:
        """A worker with room for `variant` (acquired), waiting in the admission queue if all are full."""
        if not len(self.admission):  # FIFO: while anyone waits, newcomers queue behind them
            placed = self._try_place(variant, exclude)
            if placed is not None:
                return placed
        self._check_any_up(variant, exclude)
        ticket = self.admission.join(variant.model_id, clip(variant.model_id), priority)
        queued = telemetry.tracer().start_span(
            "router.admission_queue", attributes={"queue_depth": len(self.admission)}
        )
        try:
            while True:
                try:
                    await asyncio.wait_for(self.admission.wait(ticket), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(
                        f"the deadline passed while the request waited for a worker "
                        f"({len(self.admission)} requests wait)"
                    ) from None
                placed = self._try_place(variant, exclude)
                if placed is not None:
                    return placed
                self._check_any_up(variant, exclude)
        except BaseException as e:
            queued.record_exception(e)
            queued.set_status(telemetry.Status(telemetry.StatusCode.ERROR, str(e)))
            raise
        finally:
            queued.end()
            self.admission.leave(ticket)

    def _try_place(self, variant: Variant, exclude: list[str]) -> tuple[str, ArrivalState] | None:
        view = choose_worker(variant.key, variant.delta_bytes, self.pool.views(), exclude)
        if view is None:
            return None
        if variant.key is None:
            arrival = ArrivalState.BASE
        elif variant.key in view.resident:
            arrival = ArrivalState.RESIDENT
        elif variant.key in view.loading or view.in_flight_by_variant.get(variant.key, 0) > 0:
            arrival = ArrivalState.LOADING
        else:
            arrival = ArrivalState.COLD
        self.pool.acquire(view.address, variant.key)
        return view.address, arrival

    def _check_any_up(self, variant: Variant, exclude: list[str]) -> None:
        if not self.pool.any_up(exclude):
            why = "; ".join(
                f"{w.address}: {self.pool.why_not_up(w) or 'failed this request'}" for w in self.pool.workers.values()
            )
            log.warning("no worker can serve %r: %s", variant.model_id, why)  # the addresses stay in the log
            raise Unavailable(
                f"no worker can serve {clip(variant.model_id)} now (none of {len(self.pool.workers)} is up; "
                "ListWorkers, with an admin token, says why); retry later"
            )

    # -- ListModels ----------------------------------------------------------------------------------------
    async def models(self) -> list[ModelEntry]:
        base = self.pool.family_base()
        if not self.registry.variants and self.registry.last_error:
            await self.registry.refresh()
        out = []
        if base is not None:
            up = tuple(v.address for v in self.pool.views() if v.up)
            out.append(
                ModelEntry(
                    Variant(base.name, base.name, base.fingerprint, is_base=True),
                    True,
                    "",
                    up,
                    (),
                    self.in_flight.get(base.name, 0),
                )
            )
        for v in self.registry.all():
            why = v.mismatch(base) if base is not None else "no worker is up to serve it"
            resident, loading = self.pool.where(v.model_id)
            out.append(ModelEntry(v, not why, why, tuple(resident), tuple(loading), self.in_flight.get(v.model_id, 0)))
        return out

    def workers(self) -> list[WorkerEntry]:
        out = []
        for w in self.pool.workers.values():
            why = self.pool.why_not_up(w)
            out.append(
                WorkerEntry(
                    w.address,
                    not why,
                    why,
                    w.device,
                    frozenset(w.resident),
                    w.in_flight,
                    self.pool.capacity,
                    w.used_bytes,
                    w.budget_bytes,
                )
            )
        return out


_END = object()  # the worker's stream ended


async def _read_ahead(
    source: AsyncIterator[list[TokenEvent]], t0: float, limit: int
) -> AsyncIterator[list[TokenEvent]]:
    """`source`'s events, read by a task as they come (each stamped with its arrival, ms since
    `t0`), handed on as every event ready when the caller asks (at most `limit`; 0: all). The
    source's error is raised after the events that came before it; leaving the loop (or being
    cancelled) cancels the task, which closes `source` (the worker call)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for events in source:
                ms = (time.monotonic() - t0) * 1e3
                for ev in events:
                    queue.put_nowait(dataclasses.replace(ev, elapsed_ms=ms))
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            queue.put_nowait(e)

    task = asyncio.create_task(pump())
    try:
        while True:
            ready, end = [], None
            for item in await take_ready(queue, limit):
                if isinstance(item, TokenEvent):
                    ready.append(item)
                else:
                    end = item
                    break
            if ready:
                yield ready
            if end is _END:
                return
            if end is not None:
                raise end
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
