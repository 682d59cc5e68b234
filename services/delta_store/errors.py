"""What can go wrong in the delta store, as domain exceptions.

The core raises these; the server's one interceptor maps them to gRPC status
codes (see `server.STATUS_OF`) through the shared `bitdelta.rpc` layer.
Messages are written for the person who reads them: they say what was asked,
what is wrong and, where it helps, what to do.
"""

from __future__ import annotations

from bitdelta.rpc.wire.delta_store import TENSOR_METADATA_KEY


class StoreError(Exception):
    """Base of the delta store's errors."""


class InvalidName(StoreError):
    """A variant name that is not a plain name (path separators, `..`, control characters, ...)."""


class NotFound(StoreError):
    """No stored delta has this name."""

    def __init__(self, name: str):
        super().__init__(f"no delta named {name!r} in the store (List shows the stored deltas)")
        self.name = name


class AlreadyExists(StoreError):
    """Put without overwrite of a name that exists."""


class InvalidUpload(StoreError):
    """An uploaded delta is not a valid delta file, or the upload is malformed."""


class CorruptDelta(StoreError):
    """A stored delta's bytes do not match its header: truncated or corrupted in the backend."""

    def __init__(self, name: str, message: str, tensor: str | None = None):
        super().__init__(
            f"delta {name!r} is corrupted in the backend: {message}; re-upload it with Put(overwrite=true)"
        )
        self.name = name
        self.tensor = tensor

    @property
    def trailers(self) -> dict[str, str]:
        """Sent as the status's trailing metadata: the bad tensor's name for the client."""
        return {TENSOR_METADATA_KEY: self.tensor} if self.tensor else {}


class BackendUnavailable(StoreError):
    """The storage backend cannot be reached or failed; retrying later may succeed."""
