"""The local-filesystem backend (the embedded default): `<root>/<name>.safetensors`.

Reads land where the caller keeps the bytes. A whole-file `fill` (a cache
entry's load) runs on a thread of its own that reads sequentially without
waiting for the event loop between blocks, so a cold file streams at the
disk's speed while the store checks what it read (measured here: the event
loop's gap between reads, or extra prefetch hints, cost 15-40 % of a fast
disk's sequential speed). Single `readinto`s (streaming without caching) use
aiofiles and ask the kernel to prefetch the next few blocks
(POSIX_FADV_WILLNEED), which bridges the gaps while the caller works.
Uploads go to `<root>/.partial/` and appear by a rename (overwrite) or a hard
link (no overwrite: fails atomically if the name exists), after fsync.
Files are opened with O_NOFOLLOW and only regular files count: a symlink in
the directory is never followed out of it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiofiles

from services.delta_store.backends import SUFFIX, Backend, ObjectInfo, Reader, Upload, check_name
from services.delta_store.errors import AlreadyExists, BackendUnavailable, InvalidName, NotFound

log = logging.getLogger(__name__)
PARTIAL_DIR = ".partial"
READ_AHEAD_BLOCKS = 4  # blocks the kernel is asked to prefetch beyond the one being read


def _nofollow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))


class LocalBackend(Backend):
    kind = "local"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self._partial = self.root / PARTIAL_DIR
        # Uploads interrupted by a crash left these behind; nothing else writes here.
        if self._partial.is_dir():
            for p in self._partial.iterdir():
                log.info("removing an interrupted upload: %s", p)
                p.unlink(missing_ok=True)

    def _path(self, name: str) -> Path:
        return self.root / (check_name(name) + SUFFIX)

    def _fail(self, e: OSError, name: str | None = None):
        """Map an OSError to the store's errors (raises)."""
        if not self.root.is_dir():
            raise BackendUnavailable(f"the local store directory {self.root} is missing (unmounted?)") from None
        if isinstance(e, FileNotFoundError) or e.errno == errno.ELOOP:
            raise NotFound(name) from None
        raise BackendUnavailable(f"local store {self.root}: {e.strerror or e} ({name or ''})") from None

    async def list(self) -> list[ObjectInfo]:
        def scan():
            out = []
            with os.scandir(self.root) as it:
                for e in it:
                    if not e.name.endswith(SUFFIX) or not e.is_file(follow_symlinks=False):
                        continue
                    name = e.name[: -len(SUFFIX)]
                    try:
                        check_name(name)
                    except InvalidName:
                        continue
                    st = e.stat(follow_symlinks=False)
                    out.append(_info(name, st))
            return out

        try:
            return await asyncio.to_thread(scan)
        except OSError as e:
            self._fail(e)

    async def head(self, name: str) -> ObjectInfo:
        path = self._path(name)
        try:
            st = await asyncio.to_thread(os.stat, path, follow_symlinks=False)
        except OSError as e:
            self._fail(e, name)
        if not stat.S_ISREG(st.st_mode):
            raise NotFound(name)  # a symlink or directory is not a stored delta
        return _info(name, st)

    async def open(self, name: str) -> Reader:
        path = self._path(name)
        try:
            f = await aiofiles.open(path, "rb", buffering=0, opener=_nofollow)
        except OSError as e:
            self._fail(e, name)
        try:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise NotFound(name)
        except BaseException:
            await f.close()
            raise
        return _LocalReader(f, st.st_size, self, name)

    async def begin_upload(self, name: str, size: int) -> Upload:
        final = self._path(name)
        try:
            await asyncio.to_thread(self._partial.mkdir, exist_ok=True)
            tmp = self._partial / f"{name}.{uuid.uuid4().hex}"
            f = await aiofiles.open(tmp, "xb", opener=_nofollow)
        except OSError as e:
            self._fail(e, name)
        return _LocalUpload(self, name, final, tmp, f)

    async def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            st = await asyncio.to_thread(os.stat, path, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise NotFound(name)
            await asyncio.to_thread(path.unlink)
        except OSError as e:
            self._fail(e, name)


def _info(name: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(name, st.st_size, f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}")


class _LocalReader(Reader):
    def __init__(self, f, size: int, backend: LocalBackend, name: str):
        self._f, self.size, self._backend, self._name = f, size, backend, name
        self._pos = 0

    async def readinto(self, offset: int, buf: memoryview) -> int:
        try:
            if offset != self._pos:
                await self._f.seek(offset)
                self._pos = offset
            # Ask the kernel to start reading the next blocks now, so the disk stays busy
            # while this process checks and sends what it has (a hint: never blocks).
            os.posix_fadvise(self._f.fileno(), offset + len(buf), READ_AHEAD_BLOCKS * len(buf), os.POSIX_FADV_WILLNEED)
            got = 0
            while got < len(buf):
                n = await self._f.readinto(buf[got:])
                if not n:
                    break
                got += n
            self._pos += got
            return got
        except OSError as e:
            self._backend._fail(e, self._name)

    async def fill(self, view: memoryview, block: int) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        progress: asyncio.Queue = asyncio.Queue()  # positions, then an OSError or None (done)
        stop = threading.Event()
        done = loop.create_future()
        fd = self._f.fileno()

        def post(item) -> None:
            loop.call_soon_threadsafe(progress.put_nowait, item)

        def read() -> None:
            pos, end = 0, None
            try:
                while pos < len(view) and not stop.is_set():
                    n = os.preadv(fd, [view[pos : pos + block]], pos)
                    if n == 0:  # the file is shorter than the view: the caller sees where it ended
                        break
                    pos += n
                    post(pos)
            except OSError as e:
                end = e
            finally:
                post(end)
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        threading.Thread(target=read, name=f"read {self._name}", daemon=True).start()
        try:
            while (item := await progress.get()) is not None:
                if isinstance(item, OSError):
                    self._backend._fail(item, self._name)
                yield item
        finally:
            stop.set()
            await asyncio.shield(done)  # the thread writes nothing into `view` after this

    async def aclose(self) -> None:
        await self._f.close()


class _LocalUpload(Upload):
    def __init__(self, backend: LocalBackend, name: str, final: Path, tmp: Path, f):
        self._b, self._name, self._final, self._tmp, self._f = backend, name, final, tmp, f

    async def write(self, data) -> None:
        try:
            await self._f.write(data)
        except OSError as e:
            self._b._fail(e, self._name)

    async def commit(self, overwrite: bool) -> ObjectInfo:
        def publish():
            if overwrite:
                os.replace(self._tmp, self._final)
            else:
                try:
                    os.link(self._tmp, self._final)  # fails if the name exists, atomically
                except FileExistsError:
                    raise AlreadyExists(
                        f"a delta named {self._name!r} exists; Delete it first or Put with overwrite=true"
                    ) from None
                os.unlink(self._tmp)
            dfd = os.open(self._b.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            return _info(self._name, os.stat(self._final, follow_symlinks=False))

        try:
            await self._f.flush()
            await asyncio.to_thread(os.fsync, self._f.fileno())
            await self._f.close()
            return await asyncio.to_thread(publish)
        except OSError as e:
            self._b._fail(e, self._name)

    async def abort(self) -> None:
        try:
            await self._f.close()
        finally:
            self._tmp.unlink(missing_ok=True)
