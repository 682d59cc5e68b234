"""The worker's Generate stream in the generation vocabulary (`bitdelta.generation`): its servicer
writes `TokenEvent`s with `event_to_pb`, its client reads them back with `event_of_pb`, so the two
ends share one mapping (the arrival state is the worker's `DeltaState` on this hop).
"""

from __future__ import annotations

from bitdelta.generation import ArrivalState, FinishReason, Logprobs, Request, TokenEvent, Ttft, Usage
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb

ARRIVAL_PB = {
    ArrivalState.BASE: pb.DELTA_STATE_UNSPECIFIED,
    ArrivalState.RESIDENT: pb.DELTA_STATE_RESIDENT,
    ArrivalState.LOADING: pb.DELTA_STATE_LOADING,
    ArrivalState.COLD: pb.DELTA_STATE_ABSENT,
}
ARRIVAL_OF_PB = {v: k for k, v in ARRIVAL_PB.items()}


def event_to_pb(ev: TokenEvent) -> pb.GenerateResponse:
    return ev.fill_pb(pb.GenerateResponse(), ARRIVAL_PB)


def event_of_pb(msg: pb.GenerateResponse) -> TokenEvent:
    first = msg.HasField("ttft")
    return TokenEvent(
        token_id=msg.token_id,
        text=msg.text,
        elapsed_ms=msg.elapsed_ms,
        finish_reason=FinishReason.from_pb(msg.finish_reason),
        usage=Usage.from_pb(msg.usage) if msg.HasField("usage") else None,
        ttft=Ttft.from_pb(msg.ttft) if first else None,
        arrival=ARRIVAL_OF_PB.get(msg.arrival_state, ArrivalState.BASE) if first else None,
        logprobs=Logprobs.from_pb(msg.logprobs) if msg.HasField("logprobs") else None,
        index=msg.index,
        prompt_logprobs=tuple(Logprobs.from_pb(lp) for lp in msg.prompt_logprobs),
    )


def request_to_pb(req: Request) -> pb.GenerateRequest:
    """The worker's GenerateRequest (the deadline travels as the call's own)."""
    return pb.GenerateRequest(
        model_id=req.model_id,
        prompt=req.prompt,
        sampling=req.sampling.to_pb(),
        request_id=req.request_id,
        templated=req.templated,
        priority=req.priority,
        cache_salt=req.cache_salt,
    )
