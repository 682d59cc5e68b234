"""What can go wrong in the delta store, as domain exceptions.

The core raises these; each class carries its gRPC status code (the RPC layer's
`ServiceError` family), which the shared server's one interceptor answers with.
Messages are written for the person who reads them: they say what was asked,
what is wrong and, where it helps, what to do.
"""

from __future__ import annotations

import grpc

from bitdelta.rpc.errors import ServiceError
from bitdelta.rpc.wire.delta_store import TENSOR_METADATA_KEY


class StoreError(ServiceError):
    """Base of the delta store's errors."""


class InvalidName(StoreError):
    """A variant name that is not a plain name (path separators, `..`, control characters, ...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidShard(StoreError):
    """A Fetch's shard names a tensor the delta lacks or a slice outside its shape."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ShardNeedsVerifiedReads(StoreError):
    """A slice has no sha256 of its own: only a store that verifies what it reads can serve one."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(StoreError):
    """No stored delta has this name."""

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, name: str):
        super().__init__(f"no delta named {name!r} in the store (List shows the stored deltas)")
        self.name = name


class AlreadyExists(StoreError):
    """Put without overwrite of a name that exists."""

    code = grpc.StatusCode.ALREADY_EXISTS


class InvalidUpload(StoreError):
    """An uploaded delta is not a valid delta file, or the upload is malformed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class BaseMismatch(StoreError):
    """A Fetch expected another base fingerprint than the delta's (`bitdelta.format.check_base`'s message)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class CorruptDelta(StoreError):
    """A stored delta's bytes do not match its header: truncated or corrupted in the backend.
    Its trailers name the bad tensor for the client."""

    code = grpc.StatusCode.DATA_LOSS

    def __init__(self, name: str, message: str, tensor: str | None = None):
        super().__init__(
            f"delta {name!r} is corrupted in the backend: {message}; re-upload it with Put(overwrite=true)"
        )
        self.name = name
        self.tensor = tensor
        self.trailers = {TENSOR_METADATA_KEY: tensor} if tensor else {}


class BackendUnavailable(StoreError):
    """The storage backend cannot be reached or failed; retrying later may succeed."""

    code = grpc.StatusCode.UNAVAILABLE
