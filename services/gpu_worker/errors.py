"""Domain errors of the worker, of the RPC layer's `ServiceError` family: each class carries its
status code. The servicer never builds status codes itself: the shared server's one interceptor
(`bitdelta.rpc.serve`) answers with these codes (and maps the format errors of `bitdelta.format`
through `STATUS_OF`) with the message unchanged, so it must tell a user what to do.
"""

from __future__ import annotations

import grpc

from bitdelta.format import BaseMismatchError, DeltaFormatError
from bitdelta.rpc.errors import ServiceError
from bitdelta.rpc.errors import status_of as rpc_status_of


class WorkerError(ServiceError):
    """Base class of the worker's errors."""

    code = grpc.StatusCode.INTERNAL


class NotFound(WorkerError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(WorkerError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(WorkerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(WorkerError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(WorkerError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(WorkerError):
    """The operation was overtaken by another one (a load cancelled by EvictDelta); retrying may work."""

    code = grpc.StatusCode.ABORTED


class SamplingError(WorkerError):
    """Picking the next token of one sequence failed (non-finite probabilities); only that sequence ends."""

    code = grpc.StatusCode.INTERNAL


class NoTokenLeft(SamplingError):
    """The request's own masks (allowed_token_ids, bad_words, min_tokens) rule out every token at a
    step: the request's fault, so INVALID_ARGUMENT, never a token picked from -inf logits."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeltaLoadError(WorkerError):
    """A delta could not be made resident; `cause` is the original error (its type picks the code)."""

    def __init__(self, name: str, cause: BaseException, where: str = ""):
        """where: which tensor-parallel rank failed ("rank 1 of 2"), or ""."""
        super().__init__(f"delta {name!r} could not be loaded{' on ' + where if where else ''}: {cause}")
        self.name, self.cause = name, cause
        self.code = status_of(cause)


# Exceptions of the core library and the standard library, by status; a ServiceError (WorkerError,
# and RpcError from a call downstream) keeps its own code (bitdelta.rpc.errors.status_of).
STATUS_OF: dict[type, grpc.StatusCode] = {
    BaseMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    DeltaFormatError: grpc.StatusCode.DATA_LOSS,
    FileNotFoundError: grpc.StatusCode.NOT_FOUND,
}


def status_of(e: BaseException) -> grpc.StatusCode:
    """The gRPC status code for any error the worker raises."""
    return rpc_status_of(e, STATUS_OF)
