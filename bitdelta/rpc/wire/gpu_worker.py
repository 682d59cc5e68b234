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
    msg = pb.GenerateResponse(token_id=ev.token_id, text=ev.text, elapsed_ms=ev.elapsed_ms, index=ev.index)
    if ev.ttft is not None:
        msg.ttft.CopyFrom(ev.ttft.to_pb())
        msg.arrival_state = ARRIVAL_PB[ev.arrival or ArrivalState.BASE]
    if ev.finish_reason is not None:
        msg.finish_reason = ev.finish_reason.to_pb()
    if ev.usage is not None:
        msg.usage.CopyFrom(ev.usage.to_pb())
    if ev.logprobs is not None:
        msg.logprobs.CopyFrom(ev.logprobs.to_pb())
    msg.prompt_logprobs.extend(lp.to_pb() for lp in ev.prompt_logprobs)
    return msg


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
    )
