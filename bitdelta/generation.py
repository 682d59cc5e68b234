"""The generation vocabulary: what every hop (gateway, router, worker) says about one generation,
in one torch-free module, converted to and from protobuf here and nowhere else.

    s = Sampling(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=5)
    s.validate()                         # GenerationError naming the field, e.g. "sampling.top_p: ..."
    msg = s.to_pb(); Sampling.from_pb(msg) == s

- `Sampling`: how to pick tokens and when to stop. On the wire (`bitdelta.common.v1.SamplingParams`)
  a zero means "unset" (proto3), so `from_pb` turns zeros into the defaults the fields document.
- `FinishReason` and `ArrivalState`: why a generation ended, where its variant was on arrival.
- `Ttft`: where the time to first token went.
- `TokenEvent`: one streamed token, as the worker's engine makes it and the router passes it on.
- `check_model_id`: the one rule for model (variant, delta) names, the store's, router's and
  worker's alike; `MODEL_ID_RULE` says it in words.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field

import grpc

from bitdelta.common.v1 import generation_pb2 as pb
from bitdelta.rpc.errors import ServiceError, clip

# -- names -----------------------------------------------------------------------------------------------

MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_ID_RULE = "1-128 letters, digits, '_', '-' or '.', starting with a letter or digit, without '..'"


class GenerationError(ServiceError, ValueError):
    """A request field out of its rule; `field` names it (dotted, e.g. "sampling.top_p"), and the
    message starts with it. Every service answers it with INVALID_ARGUMENT (a `ServiceError`)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def is_model_id(name: object) -> bool:
    """Whether `name` is a model name: no path separator, parent directory, hidden file or control
    character can pass, so the store may use it as a file or object name."""
    return isinstance(name, str) and MODEL_ID.fullmatch(name) is not None and ".." not in name


def check_model_id(name: str, field: str = "model_id") -> str:
    """`name`, or GenerationError naming `field` (the empty string, the base, is not checked here)."""
    if not is_model_id(name):
        raise GenerationError(field, f"{clip(str(name))} is not a model name: {MODEL_ID_RULE}")
    return name


# -- sampling --------------------------------------------------------------------------------------------

MIN_TEMPERATURE = 1e-3  # below this logits / temperature overflows fp32; 0 means greedy
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # stop strings are searched on the engine thread every token


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens and when to stop (defaults: greedy, the server's max_new_tokens)."""

    max_new_tokens: int = 0  # 0: the server's default
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p; 1: all
    stop: tuple[str, ...] = ()  # end when the text contains one of these (not returned)
    seed: int | None = None  # same seed, same tokens, whatever else is batched; None: a random seed

    def validate(self) -> Sampling:
        """self, or GenerationError naming the first field out of its rule."""
        t = self.temperature
        if not (t == 0 or (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise GenerationError(
                "sampling.temperature", f"{t!r} must be 0 (greedy) or between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}"
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise GenerationError("sampling.top_p", f"{self.top_p!r} must be in (0, 1] (1: no truncation)")
        if self.max_new_tokens < 0:
            raise GenerationError(
                "sampling.max_new_tokens", f"{self.max_new_tokens} must be >= 0 (0: the server's default)"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise GenerationError("sampling.stop", f"{len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_CHARS:
                raise GenerationError("sampling.stop", f"{clip(s)} must be 1 to {MAX_STOP_CHARS} characters long")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise GenerationError("sampling.seed", f"{self.seed} must be in [0, 2**64)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_pb(self) -> pb.SamplingParams:
        return pb.SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=0.0 if self.top_p == 1.0 else self.top_p,
            stop=list(self.stop),
            seed=self.seed,
        )

    @classmethod
    def from_pb(cls, m: pb.SamplingParams) -> Sampling:
        """The message's values, zeros read as unset (not validated: call `validate`)."""
        return cls(
            max_new_tokens=m.max_new_tokens,
            temperature=m.temperature,
            top_p=m.top_p or 1.0,
            stop=tuple(m.stop),
            seed=m.seed if m.HasField("seed") else None,
        )


MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True)
class Request:
    """One generation asked of a router or a worker."""

    model_id: str  # a variant; "" or the base's name: the base
    prompt: str
    sampling: Sampling = field(default_factory=Sampling)
    request_id: str = ""  # the caller's id, echoed in traces and logs
    deadline: float | None = None  # time.monotonic() by which it must end; None: the server's timeout
    templated: bool = False  # a rendered chat template: the tokenizer adds no special tokens (BOS) of its own

    def validate(self) -> Request:
        """self, or GenerationError naming the field (the prompt's limits are each service's)."""
        if self.model_id:
            check_model_id(self.model_id)
        if len(self.request_id) > MAX_REQUEST_ID_CHARS:
            raise GenerationError("request_id", f"{len(self.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
        self.sampling.validate()
        return self

    @classmethod
    def from_pb(cls, m, deadline: float | None = None) -> Request:
        """From a router's or a worker's GenerateRequest (the same four fields); not validated."""
        return cls(m.model_id, m.prompt, Sampling.from_pb(m.sampling), m.request_id, deadline, m.templated)


# -- events ----------------------------------------------------------------------------------------------


class FinishReason(enum.Enum):
    """Why a generation ended."""

    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # the model's end-of-sequence token
    STOP = "stop"  # a stop string
    CANCELLED = "cancelled"  # cancelled, or its deadline passed

    def to_pb(self) -> int:
        return _FINISH_PB[self]

    @classmethod
    def from_pb(cls, value: int) -> FinishReason | None:
        """None for FINISH_REASON_UNSPECIFIED (not finished)."""
        return _FINISH_OF_PB.get(value)


_FINISH_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
_FINISH_OF_PB = {v: k for k, v in _FINISH_PB.items()}


class ArrivalState(enum.Enum):
    """Where a request's variant was on the worker that served it, when the request arrived."""

    BASE = "base"  # the base itself: always resident
    RESIDENT = "resident"
    LOADING = "loading"  # being loaded for another request
    COLD = "cold"  # absent: this request's arrival caused the load


@dataclass(frozen=True)
class Ttft:
    """Where the time to first token went, in milliseconds; parts that do not apply are 0."""

    queue_ms: float = 0.0  # the router's admission queue and placement
    delta_load_ms: float = 0.0  # waiting for the variant's delta to become resident
    schedule_ms: float = 0.0  # waiting for a batch slot and KV-cache space
    prefill_ms: float = 0.0  # the prompt through the model
    total_ms: float = 0.0  # arrival to the first token leaving the hop that reports it

    def to_pb(self) -> pb.TtftBreakdown:
        return pb.TtftBreakdown(
            queue_ms=self.queue_ms,
            delta_load_ms=self.delta_load_ms,
            schedule_ms=self.schedule_ms,
            prefill_ms=self.prefill_ms,
            total_ms=self.total_ms,
        )

    @classmethod
    def from_pb(cls, m: pb.TtftBreakdown) -> Ttft:
        return cls(m.queue_ms, m.delta_load_ms, m.schedule_ms, m.prefill_ms, m.total_ms)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_pb(self) -> pb.Usage:
        return pb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)

    @classmethod
    def from_pb(cls, m: pb.Usage) -> Usage:
        return cls(m.prompt_tokens, m.completion_tokens)


@dataclass(frozen=True)
class TokenEvent:
    """One streamed token. The first event of a generation carries `ttft` and `arrival` (and, from
    the router, `worker`); the last carries `finish_reason` and `usage`."""

    token_id: int
    text: str  # what the token adds (may be empty while a multi-byte character is incomplete)
    elapsed_ms: float  # since the request reached the hop that sends the event
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    ttft: Ttft | None = None
    arrival: ArrivalState | None = None
    worker: str = ""  # the worker that served it (the router's events)
    prefill_batch: int = field(default=0, compare=False)  # sequences in the step that began its prefill (traces)
