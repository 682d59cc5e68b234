"""The router's domain errors, of the RPC layer's `ServiceError` family: each class carries its
status code (the shared interceptor answers with it).

Errors from a worker arrive as `bitdelta.rpc.errors.RpcError` with their own code and leave as
`WorkerFailed` with that code and the worker's message, so a worker's INVALID_ARGUMENT reaches the
client as INVALID_ARGUMENT, without the worker's address.
"""

from __future__ import annotations

import grpc

from bitdelta.rpc.errors import RpcError, ServiceError


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


class WorkerFailed(RouterError):
    """A worker's refusal or failure, passed on with its code and its own message, without the
    worker's address (the router logs that): a public client learns nothing of the deployment."""

    def __init__(self, e: RpcError):
        super().__init__(e.details or e.code.name)
        self.code, self.trailers = e.code, e.trailers
