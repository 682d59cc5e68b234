"""The router's domain errors, of the RPC layer's `ServiceError` family: each class carries its
status code (the shared interceptor answers with it).

Errors from a worker or the store arrive as `bitdelta.rpc.errors.RpcError` with
their own code and pass through unchanged, so a worker's INVALID_ARGUMENT
reaches the client as INVALID_ARGUMENT.
"""

from __future__ import annotations

import grpc

from bitdelta.rpc.errors import ServiceError


class RouterError(ServiceError):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(RouterError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RouterError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RouterError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(RouterError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(RouterError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RouterError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RouterError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
