"""The router's core: validate, look up, admit, place, stream from a worker, retry once.

    router = Router(config, pool, registry)
    async for ev in router.generate(GenerateParams(model_id="coder", prompt="def f(")):
        ...   # RoutedToken: the worker's message plus, on the first, where and how long

Admission. A request runs on a worker with room (`max_in_flight_per_worker`); when every
candidate is full it waits in a bounded FIFO (`admission.Admission`: per variant and in total); beyond
those bounds it gets RESOURCE_EXHAUSTED at once. While anyone waits, newcomers queue behind them.

Placement (`placement.choose_worker`) keeps a variant on the workers that already hold it, so
concurrent requests share one resident delta and one load. A request that fails with a
retryable status (UNAVAILABLE) before its first token is retried once on another worker; after
its first token a failure reaches the client (tokens cannot be taken back).

Deadlines and cancellation: the worker call gets the time the client has left; a client that
goes away cancels the handler, which cancels the worker call, which frees the sequence.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
from bitdelta.rpc import telemetry
from bitdelta.rpc.errors import RpcError, clip
from bitdelta.rpc.security import Principal
from services.router.admission import Admission
from services.router.config import RouterConfig
from services.router.errors import DeadlineExceeded, InvalidArgument, PermissionDenied, Unavailable
from services.router.placement import choose_worker
from services.router.pool import WorkerPool
from services.router.registry import Registry, Variant

log = logging.getLogger("services.router")
MODEL_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-3  # below this the softmax overflows; 0 means greedy


class Arrival(enum.Enum):
    """Where the variant was on the chosen worker when the request arrived."""

    BASE = "base"
    RESIDENT = "resident"
    LOADING = "loading"
    COLD = "cold"


WORKER_ARRIVAL = {
    wpb.DELTA_STATE_RESIDENT: Arrival.RESIDENT,
    wpb.DELTA_STATE_LOADING: Arrival.LOADING,
    wpb.DELTA_STATE_ABSENT: Arrival.COLD,
}


@dataclass(frozen=True)
class GenerateParams:
    """A Generate request in domain form."""

    model_id: str
    prompt: str
    max_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    request_id: str = ""
    deadline: float | None = None  # time.monotonic() by which the request must end
    principal: Principal | None = None  # the caller's token (None: auth off); checked before the lookup


@dataclass(frozen=True)
class FirstToken:
    """Router-side facts sent with the first token."""

    worker: str
    arrival: Arrival
    queue_ms: float  # admission wait + placement, including a retry's
    total_ms: float  # arrival at the router -> first token ready to leave it


@dataclass(frozen=True)
class RoutedToken:
    msg: wpb.GenerateResponse  # the worker's message (token, text, finish, usage, the worker's TTFT)
    elapsed_ms: float  # since the request reached the router
    first: FirstToken | None = None


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
    def validate(self, p: GenerateParams) -> None:
        c = self.config
        if p.model_id and not MODEL_ID_RE.fullmatch(p.model_id):
            raise InvalidArgument(
                f"model_id {clip(p.model_id)} is not a model name: 1-128 letters, digits, '.', "
                f"'_' or '-', starting with a letter or digit"
            )
        if not p.prompt:
            raise InvalidArgument("prompt: must not be empty")
        n = len(p.prompt.encode("utf-8", "surrogatepass"))
        if n > c.max_prompt_bytes:
            raise InvalidArgument(f"prompt: {n} bytes is more than this router accepts ({c.max_prompt_bytes})")
        if not (p.temperature == 0 or MIN_TEMPERATURE <= p.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(
                f"sampling.temperature: {p.temperature} must be 0 (greedy) or between "
                f"{MIN_TEMPERATURE} and {MAX_TEMPERATURE}"
            )
        if not (math.isfinite(p.top_p) and 0.0 <= p.top_p <= 1.0):
            raise InvalidArgument(f"sampling.top_p: {p.top_p} must be between 0 and 1")
        if p.max_new_tokens > c.max_new_tokens_limit:
            raise InvalidArgument(
                f"sampling.max_new_tokens: {p.max_new_tokens} is more than this router allows "
                f"({c.max_new_tokens_limit})"
            )
        if len(p.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in p.stop):
            raise InvalidArgument(
                f"sampling.stop: at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters"
            )
        if len(p.request_id) > 128:
            raise InvalidArgument(f"request_id: {len(p.request_id)} characters; at most 128")

    async def generate(self, p: GenerateParams) -> AsyncIterator[RoutedToken]:
        t0 = time.monotonic()
        self.validate(p)
        if self.pool.family_base() is None:
            await self.pool.poll_all()  # no worker has answered yet (e.g. just started): ask now
        if p.principal is not None:
            self.check_allowed(p.principal, p.model_id)  # before the lookup: a refusal says nothing of what exists
        variant = await self.registry.lookup(p.model_id, self.pool.family_base())
        deadline = p.deadline if p.deadline is not None else t0 + self.config.request_timeout_s
        request = wpb.GenerateRequest(
            model_id=variant.key or "",
            prompt=p.prompt,
            request_id=p.request_id,
            sampling=gen_pb.SamplingParams(
                max_new_tokens=p.max_new_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                stop=list(p.stop),
                seed=p.seed,
            ),
        )
        self.in_flight[variant.model_id] += 1
        tried: list[str] = []
        try:
            while True:
                with telemetry.tracer().start_as_current_span("router.placement") as span:
                    address, arrival = await self._place(variant, tried, deadline)
                    span.set_attributes({"worker": address, "arrival_state": arrival.value, "retry": bool(tried)})
                queue_ms = (time.monotonic() - t0) * 1e3
                w = self.pool.workers[address]
                started = False
                try:
                    async for msg in w.client.generate(request, timeout_s=max(0.001, deadline - time.monotonic())):
                        if msg is None:  # grpc's aio stub yields None for bytes it cannot decode: a broken worker
                            raise RpcError(
                                f"worker {address} sent a message that is not a GenerateResponse",
                                grpc.StatusCode.UNAVAILABLE,
                                service=f"worker {address}",
                            )
                        now = time.monotonic()
                        first = None
                        if not started:
                            started = True
                            if variant.key is not None:
                                self.pool.note_resident(address, variant.key)
                            if variant.key is not None:  # the worker knows the truth; our view may be stale
                                arrival = WORKER_ARRIVAL.get(msg.arrival_state, arrival)
                            first = FirstToken(address, arrival, queue_ms, (now - t0) * 1e3)
                        yield RoutedToken(msg, (now - t0) * 1e3, first)
                    return
                except RpcError as e:
                    if started or not e.retryable or tried:
                        raise
                    tried.append(address)
                    if not await self.pool.poll(address):  # the worker itself is gone, not just this call
                        self.pool.mark_down(address, f"Generate failed: {e.details[:200]}")
                    if not self.pool.any_up(exclude=tried):
                        raise
                    log.warning(
                        "request for %r failed on %s before its first token (%s); retrying elsewhere",
                        variant.model_id,
                        address,
                        e.code.name,
                    )
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

    async def _place(self, variant: Variant, exclude: list[str], deadline: float) -> tuple[str, Arrival]:
        """A worker with room for `variant` (acquired), waiting in the admission queue if all are full."""
        if not len(self.admission):  # FIFO: while anyone waits, newcomers queue behind them
            placed = self._try_place(variant, exclude)
            if placed is not None:
                return placed
        self._check_any_up(variant, exclude)
        ticket = self.admission.join(variant.model_id, clip(variant.model_id))
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

    def _try_place(self, variant: Variant, exclude: list[str]) -> tuple[str, Arrival] | None:
        view = choose_worker(variant.key, variant.delta_bytes, self.pool.views(), exclude)
        if view is None:
            return None
        if variant.key is None:
            arrival = Arrival.BASE
        elif variant.key in view.resident:
            arrival = Arrival.RESIDENT
        elif variant.key in view.loading or view.in_flight_by_variant.get(variant.key, 0) > 0:
            arrival = Arrival.LOADING
        else:
            arrival = Arrival.COLD
        self.pool.acquire(view.address, variant.key)
        return view.address, arrival

    def _check_any_up(self, variant: Variant, exclude: list[str]) -> None:
        if not self.pool.any_up(exclude):
            why = "; ".join(
                f"{w.address}: {self.pool.why_not_up(w) or 'failed this request'}" for w in self.pool.workers.values()
            )
            raise Unavailable(f"no worker can serve {clip(variant.model_id)} now ({why}); retry later")

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
