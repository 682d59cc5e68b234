"""The storage backend contract: one suite, run against every backend (local directory, S3 on a real Swift)."""

import asyncio
import os
import time

import pytest

from services.delta_store.backends import check_name
from services.delta_store.errors import AlreadyExists, BackendUnavailable, InvalidName, NotFound

pytest_plugins = ["tests.support.swift", "tests.support.delta_store"]

BAD_NAMES = [
    "",
    "..",
    "../etc/passwd",
    "a/b",
    "a\\b",
    ".hidden",
    "a..b",
    "-x",
    "a\x00b",
    "a\nb",
    "/abs",
    "x" * 129,
    "naïve",
    "a b",
]


async def upload(backend, name: str, data: bytes, overwrite: bool = False, piece: int = 1 << 20):
    up = await backend.begin_upload(name, len(data))
    try:
        for i in range(0, len(data), piece):
            await up.write(data[i : i + piece])
        return await up.commit(overwrite)
    except BaseException:
        await up.abort()
        raise


async def test_put_list_head_read(backend_under_test):
    b = backend_under_test.make()
    assert await b.list() == []
    data = os.urandom(3 * 1024 * 1024 + 17)
    info = await upload(b, "alpha", data)
    assert (info.name, info.size) == ("alpha", len(data))
    assert [(o.name, o.size) for o in await b.list()] == [("alpha", len(data))]
    assert (await b.head("alpha")).version == info.version
    assert await b.read_range("alpha", 10, 100) == data[10:110]
    assert await b.read_range("alpha", len(data) - 5, 100) == data[-5:]  # short at the end
    async with await b.open("alpha") as r:
        assert r.size == len(data)
        buf = bytearray(1 << 20)
        got, pos = bytearray(), 0
        while n := await r.readinto(pos, memoryview(buf)):  # sequential, as the store reads
            got += buf[:n]
            pos += n
        assert bytes(got) == data
        view = memoryview(bytearray(1000))
        assert await r.readinto(5000, view) == 1000 and bytes(view) == data[5000:6000]  # random access
        assert await r.readinto(len(data), view) == 0
    await b.close()


async def test_multipart_sized_upload_is_invisible_until_commit(backend_under_test):
    b = backend_under_test.make()
    data = os.urandom(9 * 1024 * 1024 + 3)  # more than one S3 part
    up = await b.begin_upload("big", len(data))
    await up.write(data[: 8 * 1024 * 1024 + 1])
    await up.write(data[8 * 1024 * 1024 + 1 :])
    assert await b.list() == []
    with pytest.raises(NotFound):
        await b.head("big")
    with pytest.raises(NotFound):
        await b.open("big")
    info = await up.commit(overwrite=False)
    assert info.size == len(data)
    assert await b.read_range("big", 0, len(data)) == data
    await b.close()


async def test_abort_leaves_nothing(backend_under_test):
    b = backend_under_test.make()
    up = await b.begin_upload("gone", 9 * 1024 * 1024)
    await up.write(os.urandom(9 * 1024 * 1024))
    await up.abort()
    await up.abort()  # idempotent
    assert await b.list() == []
    if backend_under_test.kind == "local":
        assert list((backend_under_test.root / ".partial").iterdir()) == []
    else:
        s3 = backend_under_test.s3
        assert not s3["client"].list_multipart_uploads(Bucket=s3["bucket"]).get("Uploads")
    await b.close()


async def test_overwrite_rules(backend_under_test):
    b = backend_under_test.make()
    first = await upload(b, "v", b"one" * 100)
    with pytest.raises(AlreadyExists, match="overwrite"):
        await upload(b, "v", b"two" * 100)
    assert await b.read_range("v", 0, 300) == b"one" * 100
    second = await upload(b, "v", b"three" * 100, overwrite=True)
    assert second.version != first.version
    assert await b.read_range("v", 0, 500) == b"three" * 100
    await b.close()


async def test_delete_and_missing(backend_under_test):
    b = backend_under_test.make()
    await upload(b, "doomed", b"x" * 10)
    await b.delete("doomed")
    assert await b.list() == []
    for call in (b.head, b.open, b.delete):
        with pytest.raises(NotFound, match="doomed"):
            await call("doomed")
    await b.close()


async def test_bad_names_are_refused_everywhere(backend_under_test):
    b = backend_under_test.make()
    for name in BAD_NAMES:
        for call in (b.head, b.open, b.delete, lambda n: b.begin_upload(n, 1)):
            with pytest.raises(InvalidName):
                await call(name)
    for good in ("coder", "Math-7B_v2.1", "a" * 128):
        assert check_name(good) == good
    await b.close()


async def test_list_ignores_foreign_objects(backend_under_test):
    b = backend_under_test.make()
    backend_under_test.put_raw("ok", b"data")
    backend_under_test.put_raw(".hidden", b"data")
    backend_under_test.put_raw("no-suffix", b"data")  # becomes no-suffix.safetensors: fine
    if backend_under_test.kind == "local":
        (backend_under_test.root / "README").write_text("not a delta")
        (backend_under_test.root / "sub.safetensors").mkdir()
        os.symlink("/etc/hostname", backend_under_test.root / "link.safetensors")
    else:
        s3 = backend_under_test.s3
        s3["client"].put_object(Bucket=s3["bucket"], Key="README", Body=b"not a delta")
        s3["client"].put_object(Bucket=s3["bucket"], Key="dir/x.safetensors", Body=b"nested")
    assert sorted(o.name for o in await b.list()) == ["no-suffix", "ok"]
    if backend_under_test.kind == "local":
        with pytest.raises(NotFound):  # a symlink is never followed out of the store
            await b.open("link")
    await b.close()


async def test_unavailable_fast_then_recovers(backend_under_test):
    b = backend_under_test.make()
    await upload(b, "v", b"payload")
    backend_under_test.down()
    try:
        for call in (b.list, lambda: b.head("v"), lambda: b.read_range("v", 0, 7)):
            t = time.monotonic()
            with pytest.raises(BackendUnavailable):
                await call()
            assert time.monotonic() - t < 5
    finally:
        backend_under_test.up()
    await asyncio.sleep(0.1)
    assert await b.read_range("v", 0, 7) == b"payload"
    assert [o.name for o in await b.list()] == ["v"]
    await b.close()
