"""Validate a delta against this base and stream it into a slot.

`plan_delta` checks every announced tensor against the slot layout (names,
roles, dtypes, shapes) and sizes the delta BEFORE any byte moves, so a wrong
delta fails fast and the budget is reserved exactly.

`SlotWriter` is the sink the sources write into. Every tensor has one host
buffer: on CPU the slot memory itself (bytes land where the kernels read them,
no copy), on CUDA a staging buffer (pinned) that is copied to the slot on a
side stream so loading never waits for, or stalls, the decode stream. Each
chunk's crc32 (ISA-L when installed: several GB/s) is checked on the bytes as
they lie in the buffer, and each tensor's sha256 unless the source verified it
already (`check_sha256=False`: the delta store hashed it once, when the delta
entered the store), on worker threads as bytes arrive; the slot becomes usable
only after all of them passed (the manager flips the state).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import os
import threading
from dataclasses import dataclass

import torch

from bitdelta.format import DTYPES, DeltaFormatError
from bitdelta.rpc.checksums import crc32 as crc32_of
from kernels.bits import packed_cols
from services.gpu_worker.errors import ChecksumError
from services.gpu_worker.slots import EMBED, HEAD, BigTensor, NormPlace, ProjPlace, SlotExtras, SlotLayout, SlotTensors
from services.gpu_worker.sources import DeltaInfo, TensorSpec

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# Threads verifying complete tensors (sha256 releases the GIL): hashing keeps up with a fast disk.
HASH_THREADS = min(4, os.cpu_count() or 1)
HASH_TASK_BYTES = 1 << 20  # small tensors are verified together: one task per ~1 MiB


@dataclass
class Placement:
    """Where one tensor of a delta goes."""

    spec: TensorSpec
    kind: str  # "proj_sign" | "proj_alpha" | "norm" | "big_dense" | "big_sign" | "big_alpha"
    proj: ProjPlace | None = None
    norm: NormPlace | None = None
    big: str | None = None  # EMBED or HEAD


@dataclass
class DeltaPlan:
    name: str
    placements: list[Placement]
    slot_bytes: int  # one slot of the stacks
    extra_bytes: int  # embedding / head tensors outside the stacks

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes + self.extra_bytes


def _bad(name: str, t: TensorSpec, why: str) -> DeltaFormatError:
    return DeltaFormatError(f"delta {name!r}: tensor {t.name} {why}", tensor=t.name)


def plan_delta(layout: SlotLayout, info: DeltaInfo) -> DeltaPlan:
    """Map every tensor of `info` to its place, or raise DeltaFormatError naming the tensor."""
    a = layout.args
    out: list[Placement] = []
    seen: dict[str, set[str]] = {}
    extra = 0
    big_roles: dict[str, set[str]] = {}
    for t in info.tensors:
        param, role = t.param, t.role
        seen.setdefault(param, set()).add(role)
        numel = 1
        for d in t.shape:
            numel *= d
        if t.dtype not in DTYPES or numel * DTYPES[t.dtype].itemsize != t.nbytes:
            raise _bad(info.name, t, f"has dtype {t.dtype} and shape {list(t.shape)} but {t.nbytes} bytes")
        if param in layout.proj:
            p = layout.proj[param]
            d_out = p.r1 - p.r0
            if role == "sign":
                if t.dtype != "U8" or t.shape != (d_out, packed_cols(p.d_in)):
                    raise _bad(
                        info.name,
                        t,
                        f"must be uint8 [{d_out}, {packed_cols(p.d_in)}] for this base, is {t.dtype} {list(t.shape)}",
                    )
                out.append(Placement(t, "proj_sign", proj=p))
            elif role == "alpha":
                if t.dtype != "F32" or t.shape not in ((d_out,), (1,)):
                    raise _bad(info.name, t, f"must be float32 [{d_out}] or [1], is {t.dtype} {list(t.shape)}")
                out.append(Placement(t, "proj_alpha", proj=p))
            else:
                raise _bad(info.name, t, "replaces a projection densely; the worker serves compressed projections only")
        elif param in layout.norms:
            if role != "dense" or t.shape != (a.dim,) or t.dtype not in FLOAT_DTYPES:
                raise _bad(info.name, t, f"must be a dense float [{a.dim}] norm weight")
            out.append(Placement(t, "norm", norm=layout.norms[param]))
        elif param in (EMBED, HEAD):
            big_roles.setdefault(param, set()).add(role)
            if role == "dense":
                if t.shape != layout.embed_shape or t.dtype not in FLOAT_DTYPES:
                    raise _bad(info.name, t, f"must be a dense float {list(layout.embed_shape)}")
                kind = "big_dense"
            elif role == "sign":
                if t.dtype != "U8" or t.shape != (a.vocab_size, packed_cols(a.dim)):
                    raise _bad(info.name, t, f"must be uint8 [{a.vocab_size}, {packed_cols(a.dim)}]")
                kind = "big_sign"
            else:
                if t.dtype != "F32" or t.shape not in ((a.vocab_size,), (1,)):
                    raise _bad(info.name, t, f"must be float32 [{a.vocab_size}] or [1]")
                kind = "big_alpha"
            extra += layout.extra_bytes(param, role, t.shape)
            out.append(Placement(t, kind, big=param))
        else:
            raise _bad(info.name, t, "names a parameter this base does not have (or the worker cannot place)")
    for param, roles in seen.items():
        if (param in layout.proj or roles & {"sign", "alpha"}) and roles & {"sign", "alpha"} != {"sign", "alpha"}:
            raise DeltaFormatError(
                f"delta {info.name!r}: {param} has {sorted(roles)} but needs both .sign and .alpha", tensor=param
            )
    for param, roles in big_roles.items():
        if "dense" in roles and roles & {"sign", "alpha"}:
            raise DeltaFormatError(f"delta {info.name!r}: {param} is both dense and compressed", tensor=param)
    return DeltaPlan(info.name, out, layout.slot_bytes, extra)


class SlotWriter:
    """The sink for one load into one slot (see module docstring). Not reusable."""

    def __init__(self, plan: DeltaPlan, slots: SlotTensors, slot: int, load_stream=None, check_sha256: bool = True):
        self.plan, self.slots, self.slot = plan, slots, slot
        self.check_sha256 = check_sha256
        self.device = slots.device
        self.cuda = self.device.type == "cuda"
        self.stream = load_stream
        dtype = slots.layout.dtype
        a = slots.layout.args
        self.extras = SlotExtras()
        bigs: dict[str, BigTensor] = {}
        # On CUDA everything a load does runs on the load stream: the reset is ordered before the
        # copies, and the extras come from that stream's pool, never from blocks the decode stream
        # just freed while its kernels may still read them.
        with _on_stream(self.stream):
            slots.reset_slot(slot)
            for p in plan.placements:  # extras (embedding / head) are allocated per delta
                if p.big is None:
                    continue
                bt = bigs.setdefault(p.big, BigTensor())
                if p.kind == "big_dense":
                    bt.weight = torch.empty(a.vocab_size, a.dim, dtype=dtype, device=self.device)
                elif p.kind == "big_sign":
                    bt.signs = torch.empty(a.vocab_size, packed_cols(a.dim), dtype=torch.uint8, device=self.device)
                else:
                    bt.alpha = torch.empty(a.vocab_size, dtype=torch.float32, device=self.device)
        self.extras.embed = bigs.get(EMBED)
        self.extras.head = bigs.get(HEAD) or (self.extras.embed if a.tie_embeddings else None)
        # The final place of every tensor, and a host buffer bytes land in.
        self.dest: list[torch.Tensor] = []
        self.host: list[memoryview | None] = []
        self._host_t: list[torch.Tensor | None] = []
        self.staged: list[bool] = []
        for p in plan.placements:
            d = self._dest_of(p, bigs)
            self.dest.append(d)
            src_dtype = DTYPES[p.spec.dtype]
            direct = (
                not self.cuda and d.dtype == src_dtype and tuple(d.shape) == tuple(p.spec.shape) and d.is_contiguous()
            )
            self.staged.append(not direct)
            self._host_t.append(d if direct else None)
            self.host.append(_bytes_view(d) if direct else None)
        n = len(plan.placements)
        self._got = [0] * n
        self._next = [0] * n
        self._hash = [hashlib.sha256() for _ in range(n)]
        self._in_order = [True] * n  # chunks came through `put` in order: the running hash is valid
        self._done = [False] * n
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        # `put` chunks are copied and hashed in arrival order on one thread; complete tensors are
        # verified (and staged ones copied to the device) on a small pool, in parallel.
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"load-{plan.name}")
        self._pool = concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix=f"verify-{plan.name}")
        self._last: concurrent.futures.Future | None = None
        self._verifies: list[concurrent.futures.Future] = []
        for i, p in enumerate(plan.placements):
            if p.spec.nbytes == 0:
                self._complete(i)

    def _dest_of(self, p: Placement, bigs: dict[str, BigTensor]) -> torch.Tensor:
        if p.kind == "proj_sign":
            return self.slots.proj_views(self.slot, p.proj)[0]
        if p.kind == "proj_alpha":
            return self.slots.proj_views(self.slot, p.proj)[1]
        if p.kind == "norm":
            return self.slots.norm_view(self.slot, p.norm)
        bt = bigs[p.big]
        return {"big_dense": bt.weight, "big_sign": bt.signs, "big_alpha": bt.alpha}[p.kind]

    # -- Sink interface (any thread) -------------------------------------------------------------
    def direct(self, i: int) -> memoryview:
        with self._lock:
            if self.host[i] is None:
                n = self.plan.placements[i].spec.nbytes
                t = torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda)
                self._host_t[i] = t
                self.host[i] = memoryview(t.numpy())
            return self.host[i]

    def put(self, i: int, offset: int, data, crc32: int | None = None) -> None:
        self._last = self._io.submit(self._guard, self._put, i, offset, data, crc32)

    async def flushed(self) -> None:
        """Until every `put` so far has copied its bytes (errors are kept for `finish`)."""
        if self._last is not None:
            await asyncio.wait([asyncio.wrap_future(self._last)])

    def landed(self, pieces: list[tuple[int, int, int]]) -> None:
        """(tensor, offset, n) pieces were written into `direct(tensor)`; thread-safe."""
        complete = []
        with self._lock:
            for i, _, n in pieces:
                self._in_order[i] = False  # hashed whole once complete, in parallel with further reads
                self._got[i] += n
                if self._got[i] >= self.plan.placements[i].spec.nbytes:
                    complete.append(i)
        # Verify in tasks of about HASH_TASK_BYTES: small tensors share one, big ones get their own.
        group, size = [], 0
        for i in complete:
            group.append(i)
            size += self.plan.placements[i].spec.nbytes
            if size >= HASH_TASK_BYTES:
                self._complete(*group)
                group, size = [], 0
        if group:
            self._complete(*group)

    def _guard(self, fn, *args) -> None:
        if self._error is None:
            try:
                fn(*args)
            except BaseException as e:  # reported by finish()
                self._error = e

    def _account(self, i: int, n: int) -> None:
        with self._lock:
            self._got[i] += n
            complete = self._got[i] >= self.plan.placements[i].spec.nbytes
        if complete:
            self._complete(i)

    def _complete(self, *tensors: int) -> None:
        f = self._pool.submit(self._guard, self._finish_tensors, tensors)
        with self._lock:
            self._verifies.append(f)

    def _finish_tensors(self, tensors) -> None:
        for i in tensors:
            self._finish_tensor(i)

    # -- on the writer threads --------------------------------------------------------------------
    def _put(self, i: int, offset: int, data, crc32: int | None) -> None:
        spec = self.plan.placements[i].spec
        n = len(data)
        if offset + n > spec.nbytes:
            raise DeltaFormatError(
                f"tensor {spec.name}: chunk [{offset}, {offset + n}) runs past its {spec.nbytes} bytes",
                tensor=spec.name,
            )
        if crc32 is None and not self.check_sha256:
            raise DeltaFormatError(
                f"delta {self.plan.name!r}: tensor {spec.name}: a chunk without a crc32 while "
                "sha256 checks are off: its bytes could not be verified",
                tensor=spec.name,
            )
        dst = self.direct(i)[offset : offset + n]
        dst[:] = data
        if crc32 is not None and crc32_of(dst) != crc32:  # the bytes as they lie where they will be used
            raise ChecksumError(
                f"delta {self.plan.name!r}: tensor {spec.name}: chunk at offset {offset} fails "
                "its crc32 (corrupted in transit)",
                tensor=spec.name,
            )
        if offset == self._next[i] and self._in_order[i]:
            if self.check_sha256:
                self._hash[i].update(dst)
            self._next[i] = offset + n
        elif not self.check_sha256:  # only in-order chunks prove, with their crc32s, that every byte came
            raise DeltaFormatError(
                f"delta {self.plan.name!r}: tensor {spec.name}: chunk at offset {offset} out of "
                f"order (expected offset {self._next[i]})",
                tensor=spec.name,
            )
        else:
            self._in_order[i] = False
        self._account(i, n)

    def _finish_tensor(self, i: int) -> None:
        p = self.plan.placements[i]
        spec = p.spec
        if self._got[i] != spec.nbytes:
            raise DeltaFormatError(
                f"tensor {spec.name}: received {self._got[i]} of {spec.nbytes} bytes", tensor=spec.name
            )
        if not self.check_sha256:
            digest = spec.sha256  # verified by the source; every chunk passed its crc32 above
        elif self._in_order[i]:
            digest = self._hash[i].hexdigest()
        else:
            digest = hashlib.sha256(self.host[i] if spec.nbytes else b"").hexdigest()
        if digest != spec.sha256:
            raise ChecksumError(
                f"delta {self.plan.name!r}: tensor {spec.name}: sha256 mismatch "
                "(the data is corrupted; re-upload or re-compress the delta)",
                tensor=spec.name,
            )
        if self.staged[i] and spec.nbytes:
            src = self._host_t[i].view(DTYPES[spec.dtype]).reshape(spec.shape)
            dst = self.dest[i]
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    staged = src.to(self.device, non_blocking=True)
                    dst.copy_(staged.to(dst.dtype).expand_as(dst))
            else:
                dst.copy_(src.to(dst.dtype).expand_as(dst))
            self._host_t[i] = None  # staging freed as soon as it is copied
            self.host[i] = None
        self._done[i] = True

    # -- completion --------------------------------------------------------------------------------
    async def finish(self) -> SlotExtras:
        """Wait for every queued write and check; raises the first error. Returns the slot's extras."""
        try:
            if self._last is not None:
                await asyncio.wrap_future(self._last)
            with self._lock:
                verifies = list(self._verifies)
            for f in verifies:
                await asyncio.wrap_future(f)
            if self._error is not None:
                raise self._error
            missing = [p.spec.name for p, d in zip(self.plan.placements, self._done) if not d]
            if missing:
                raise DeltaFormatError(
                    f"delta {self.plan.name!r}: stream ended before tensor {missing[0]} was complete", tensor=missing[0]
                )
            if self.cuda and self.stream is not None:
                await asyncio.to_thread(self.stream.synchronize)
            return self.extras
        finally:
            self._io.shutdown(wait=False)
            self._pool.shutdown(wait=False)

    def abort(self) -> None:
        self._error = self._error or RuntimeError("load aborted")
        self._io.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(bytearray())
