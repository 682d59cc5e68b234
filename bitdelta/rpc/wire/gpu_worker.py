"""The worker's Generate stream in the generation vocabulary (`bitdelta.generation`): its servicer
writes each message's `TokenEvent`s with `events_to_pb`, its client reads them back with `events_of_pb`, so the two
ends share one mapping (the arrival state is the worker's `DeltaState` on this hop).
"""

from __future__ import annotations

from collections.abc import Sequence

from bitdelta.generation import ArrivalState, Request, TokenEvent, events_of_stream_pb, fill_stream_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb

ARRIVAL_PB = {
    ArrivalState.BASE: pb.DELTA_STATE_UNSPECIFIED,
    ArrivalState.RESIDENT: pb.DELTA_STATE_RESIDENT,
    ArrivalState.LOADING: pb.DELTA_STATE_LOADING,
    ArrivalState.COLD: pb.DELTA_STATE_ABSENT,
}
ARRIVAL_OF_PB = {v: k for k, v in ARRIVAL_PB.items()}


def events_to_pb(events: Sequence[TokenEvent]) -> pb.GenerateResponse:
    """One stream message holding `events` (every token ready when it is written)."""
    return fill_stream_pb(events, pb.GenerateResponse(), ARRIVAL_PB)


def events_of_pb(msg: pb.GenerateResponse) -> list[TokenEvent]:
    return events_of_stream_pb(msg, ARRIVAL_OF_PB)


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
        prompt_token_ids=req.prompt_token_ids,
    )
