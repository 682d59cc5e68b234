"""The delta store's protocol beyond `protos/bitdelta/delta_store/v1/delta_store.proto`:
limits both ends size their messages by, the trailer that names a bad tensor, and the
shared-memory lease a receiver may count on.
"""

from __future__ import annotations

MAX_CHUNK_BYTES = 16 * 1024 * 1024  # largest Fetch chunk payload the store sends (FetchRequest.chunk_bytes is capped)
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)  # a chunk plus the first message's header listing
TENSOR_METADATA_KEY = "bitdelta-tensor"  # trailing metadata of DATA_LOSS: the bad tensor's name
SHARED_LEASE_S = 60.0  # how long a shared Fetch stays open after its last chunk for the receiver to end it


def slice_runs(
    shape: tuple[int, ...], itemsize: int, rows: list[tuple[int, int]] | None, cols: tuple[int, int] | None
) -> list[tuple[int, int]]:
    """(offset, length) runs of a row-major tensor's bytes that make up its slice `rows` (runs of
    the first dim; None: all) x `cols` (one run of the second; None: all), in order: what a
    tensor-parallel rank receives of it (FetchRequest.shard, bitdelta.shard.TensorShard)."""
    row_bytes = itemsize
    for d in shape[1:]:
        row_bytes *= d
    rows = rows if rows is not None else [(0, shape[0] if shape else 1)]
    if cols is None:
        return [(a * row_bytes, (b - a) * row_bytes) for a, b in rows if b > a]
    inner = row_bytes // shape[1]
    c0, c1 = cols
    return [(r * row_bytes + c0 * inner, (c1 - c0) * inner) for a, b in rows for r in range(a, b) if c1 > c0]
