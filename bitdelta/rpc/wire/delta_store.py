"""The delta store's protocol beyond `protos/bitdelta/delta_store/v1/delta_store.proto`:
limits both ends size their messages by, the trailer that names a bad tensor, and the
shared-memory lease a receiver may count on.
"""

from __future__ import annotations

MAX_CHUNK_BYTES = 16 * 1024 * 1024  # largest Fetch chunk payload the store sends (FetchRequest.chunk_bytes is capped)
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)  # a chunk plus the first message's header listing
TENSOR_METADATA_KEY = "bitdelta-tensor"  # trailing metadata of DATA_LOSS: the bad tensor's name
SHARED_LEASE_S = 60.0  # how long a shared Fetch stays open after its last chunk for the receiver to end it
