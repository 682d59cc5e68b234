"""The S3-compatible backend: `s3://<bucket>/<prefix><name>.safetensors` (boto3).

boto3 is blocking, so every request runs on this backend's own thread pool
(backend stalls never starve the threads that hash and read files). Reads are
ranged GETs pinned to the object's ETag (If-Match: a concurrent overwrite
fails the read instead of mixing two versions); a sequential reader keeps a
few GETs in flight ahead of the consumer. Uploads are multipart uploads to
the final key: S3 shows the object only when the upload completes, so a
half-uploaded delta never appears; `abort` discards the parts. Timeouts are
short and retries few, so an unreachable store fails fast as
BackendUnavailable; boto3 reconnects by itself once it is back.
"""

from __future__ import annotations

import asyncio
import functools
import math
from concurrent.futures import ThreadPoolExecutor

import boto3
import botocore.exceptions
from botocore.config import Config as BotoConfig

from services.delta_store.backends import SUFFIX, Backend, ObjectInfo, Reader, Upload, check_name
from services.delta_store.errors import AlreadyExists, BackendUnavailable, InvalidName, NotFound

MIN_PART_BYTES = 8 * 1024 * 1024  # S3 needs ≥ 5 MiB per part but the last
MAX_PARTS = 10_000
READ_AHEAD = 3  # ranged GETs in flight ahead of a sequential reader


class S3Backend(Backend):
    kind = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint: str | None = None,
        region: str = "us-east-1",
        timeout_s: float = 5.0,
        access_key: str | None = None,
        secret_key: str | None = None,
        max_threads: int = 16,
    ):
        self.bucket, self.prefix = bucket, prefix
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="s3-backend")
        self._s3 = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=region,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=BotoConfig(
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
                retries={"max_attempts": 2, "mode": "standard"},
                max_pool_connections=max_threads,
                s3={"addressing_style": "path"},
            ),
        )
        self._where = f"s3 {endpoint or 'aws'}/{bucket}/{prefix}"

    def _key(self, name: str) -> str:
        return self.prefix + check_name(name) + SUFFIX

    async def _call(self, name: str | None, fn, /, **kw):
        """Run one boto3 call on the pool, mapping its errors to the store's."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, **kw))
        except botocore.exceptions.ClientError as e:
            err = e.response.get("Error", {})
            code, status = str(err.get("Code", "")), e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("NoSuchKey", "404", "NotFound") and name is not None:
                raise NotFound(name) from None
            if code == "NoSuchBucket":
                raise BackendUnavailable(
                    f"{self._where}: the bucket does not exist; create it or fix --s3-bucket"
                ) from None
            if code in ("PreconditionFailed", "412"):
                raise BackendUnavailable(f"{self._where}: {name!r} changed while it was read; retry") from None
            raise BackendUnavailable(f"{self._where}: {code or status} {err.get('Message', '')}".rstrip()) from None
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            raise BackendUnavailable(f"{self._where} is unreachable: {e}") from None

    async def list(self) -> list[ObjectInfo]:
        out, token = [], None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": self.prefix}
            if token:
                kw["ContinuationToken"] = token
            page = await self._call(None, self._s3.list_objects_v2, **kw)
            for o in page.get("Contents", []):
                rest = o["Key"][len(self.prefix) :]
                if not rest.endswith(SUFFIX):
                    continue
                try:
                    name = check_name(rest[: -len(SUFFIX)])
                except InvalidName:
                    continue
                out.append(ObjectInfo(name, o["Size"], o["ETag"]))
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    async def head(self, name: str) -> ObjectInfo:
        h = await self._call(name, self._s3.head_object, Bucket=self.bucket, Key=self._key(name))
        return ObjectInfo(name, h["ContentLength"], h["ETag"])

    async def open(self, name: str) -> Reader:
        return _S3Reader(self, name, await self.head(name))

    async def _get(self, name: str, etag: str, offset: int, length: int) -> bytes:
        def get():
            r = self._s3.get_object(
                Bucket=self.bucket, Key=self._key(name), IfMatch=etag, Range=f"bytes={offset}-{offset + length - 1}"
            )
            with r["Body"] as body:
                return body.read()

        return await self._call(name, get)

    async def begin_upload(self, name: str, size: int) -> Upload:
        part = max(MIN_PART_BYTES, math.ceil(size / MAX_PARTS))
        return _S3Upload(self, name, self._key(name), part)

    async def delete(self, name: str) -> None:
        await self.head(name)  # S3 deletes of absent keys succeed; the API promises NOT_FOUND
        await self._call(name, self._s3.delete_object, Bucket=self.bucket, Key=self._key(name))

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _S3Reader(Reader):
    def __init__(self, backend: S3Backend, name: str, info: ObjectInfo):
        self._b, self._name, self._etag, self.size = backend, name, info.version, info.size
        self._ahead: dict[tuple[int, int], asyncio.Task] = {}
        self._next = -1

    def _start(self, offset: int, length: int) -> asyncio.Task:
        t = self._ahead.pop((offset, length), None)
        return t or asyncio.ensure_future(self._b._get(self._name, self._etag, offset, length))

    async def readinto(self, offset: int, buf: memoryview) -> int:
        n = min(len(buf), self.size - offset)
        if n <= 0:
            return 0
        sequential = offset == self._next
        task = self._start(offset, n)
        if not sequential:  # a jump: what was fetched ahead is of no use
            await self.aclose()
        self._next = offset + n
        o = offset + n
        for _ in range(READ_AHEAD if sequential else 0):
            if o >= self.size:
                break
            k = (o, min(len(buf), self.size - o))
            if k not in self._ahead:
                self._ahead[k] = asyncio.ensure_future(self._b._get(self._name, self._etag, *k))
            o += k[1]
        data = await task
        buf[: len(data)] = data
        return len(data)

    async def aclose(self) -> None:
        for t in self._ahead.values():
            t.cancel()
        if self._ahead:
            await asyncio.gather(*self._ahead.values(), return_exceptions=True)
        self._ahead.clear()


class _S3Upload(Upload):
    def __init__(self, backend: S3Backend, name: str, key: str, part_bytes: int):
        self._b, self._name, self._key, self._part_bytes = backend, name, key, part_bytes
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict] = []

    async def _flush_part(self) -> None:
        b = self._b
        if self._upload_id is None:
            r = await b._call(self._name, b._s3.create_multipart_upload, Bucket=b.bucket, Key=self._key)
            self._upload_id = r["UploadId"]
        number = len(self._parts) + 1
        body, self._buf = bytes(self._buf), bytearray()
        r = await b._call(
            self._name,
            b._s3.upload_part,
            Bucket=b.bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        self._parts.append({"PartNumber": number, "ETag": r["ETag"]})

    async def write(self, data) -> None:
        self._buf += data
        if len(self._buf) >= self._part_bytes:
            await self._flush_part()

    async def commit(self, overwrite: bool) -> ObjectInfo:
        b = self._b
        if not overwrite:
            # S3's atomic If-None-Match is not in every S3 implementation (Swift 2.30 lacks it):
            # check, then complete. Two concurrent Puts of one name may both pass; the last wins.
            try:
                await b.head(self._name)
            except NotFound:
                pass
            else:
                raise AlreadyExists(f"a delta named {self._name!r} exists; Delete it first or Put with overwrite=true")
        if self._upload_id is None:
            await b._call(self._name, b._s3.put_object, Bucket=b.bucket, Key=self._key, Body=bytes(self._buf))
        else:
            if self._buf:
                await self._flush_part()
            await b._call(
                self._name,
                b._s3.complete_multipart_upload,
                Bucket=b.bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},
            )
            self._upload_id = None
        return await b.head(self._name)

    async def abort(self) -> None:
        self._buf = bytearray()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            try:
                await self._b._call(
                    self._name,
                    self._b._s3.abort_multipart_upload,
                    Bucket=self._b.bucket,
                    Key=self._key,
                    UploadId=upload_id,
                )
            except (BackendUnavailable, NotFound):
                pass  # the store's lifecycle rules reap abandoned uploads
