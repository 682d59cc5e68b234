"""Domain errors of the worker. The servicer never builds status codes itself:
`server.ErrorInterceptor` maps these (and the format errors of `bitdelta.format`)
to gRPC status codes with the message unchanged, so it must tell a user what to do.
"""

from __future__ import annotations

import grpc

from bitdelta.format import BaseMismatchError, DeltaFormatError


class WorkerError(Exception):
    """Base class; `code` is the gRPC status it maps to."""

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


class ChecksumError(DeltaFormatError):
    """Bytes that arrived do not match the checksum the delta records (names the tensor)."""


class DeltaLoadError(WorkerError):
    """A delta could not be made resident; `cause` is the original error (its type picks the code)."""

    def __init__(self, name: str, cause: BaseException):
        super().__init__(f"delta {name!r} could not be loaded: {cause}")
        self.name, self.cause = name, cause
        self.code = status_of(cause)


def status_of(e: BaseException) -> grpc.StatusCode:
    """The gRPC status code for any error the worker raises."""
    if isinstance(e, WorkerError):
        return e.code
    if isinstance(e, BaseMismatchError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, DeltaFormatError):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(e, FileNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code()
    return grpc.StatusCode.INTERNAL
