"""vLLM's runtime adapter routes, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, for a
client that manages its adapters itself (vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): enabled by
`--lora-base`.

Load: the PEFT adapter at `lora_path` (a directory under `--lora-root`) becomes a delta as
`bitdelta import-lora` makes it, in a child process (the import reads the base with torch; the
gateway stays torch-free and keeps serving meanwhile), is put into the delta store under
`lora_name` with the caller's own token (an admin token where the store checks tokens), and the
answer comes once the router lists it, so the client's next request is served. A name the store
already holds is refused, as vLLM refuses an adapter already loaded (vLLM's `load_inplace` is
refused: the router would serve the old delta until its next refresh; unload, then load). Unload: the delta is deleted from the store, and the answer comes once the router no longer lists
it. One import runs at a time (each holds a copy of the base in memory).

Errors answer in vLLM's words and statuses where it has them (400, 404); a failed import answers
the importer's reason with the base's path left out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from bitdelta.generation import MODEL_ID_RULE, is_model_id
from bitdelta.rpc.clients.delta_store import DeltaStoreClient, DeltaStoreError
from bitdelta.rpc.errors import clip
from services.gateway.protocol import ApiError, error_of_rpc, invalid

log = logging.getLogger(__name__)

# the router's registry: the names it lists now (the caller's token decides what it may see)
ListNames = Callable[[tuple[tuple[str, str], ...]], Awaitable[set[str]]]


@dataclass(frozen=True)
class AdapterSettings:
    base: Path  # the checkpoint the adapters were trained on (the workers' base)
    root: Path  # adapters are read only from under this directory
    store: str  # HOST:PORT of the delta store
    credentials: grpc.ChannelCredentials | None
    timeout_s: float  # one import (the base's read included); again, until the router lists or drops it


class Adapters:
    def __init__(self, settings: AdapterSettings, list_names: ListNames):
        self.settings, self.list_names = settings, list_names
        self._one_import = asyncio.Lock()

    async def load(self, body: object, metadata: tuple[tuple[str, str], ...]) -> str:
        """Import and put the body's adapter; returns vLLM's success text."""
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if not name or not path:
            raise invalid(None, "Both 'lora_name' and 'lora_path' must be provided.", code="missing_field")
        if body.get("load_inplace", False) is not False:  # type: ignore[union-attr]  (a dict: _field checked)
            raise invalid(
                "load_inplace",
                "load_inplace is not supported: the router serves a replaced delta from its next refresh, so "
                "unload the adapter, then load it again",
            )
        _check_name(name)
        adapter = self._adapter_dir(path)
        async with self._store(metadata) as store, self._one_import:
            if await _exists(store, name):  # under the lock: of two loads of one name, the second is refused
                raise invalid("lora_name", f"The lora adapter '{name}' has already been loaded.", code="already_loaded")
            with tempfile.TemporaryDirectory(prefix="bitdelta-lora-") as tmp:
                out = Path(tmp) / "adapter.bitdelta.safetensors"
                await self._import(adapter, out, name)
                try:
                    await store.put(name, out)
                except DeltaStoreError as e:
                    raise error_of_rpc(e.code, e.details or str(e)) from None
        await self._until(metadata, lambda names: name in names, f"the router to list {name!r}")
        log.info("adapter %r loaded from %s", name, adapter)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: object, metadata: tuple[tuple[str, str], ...]) -> str:
        name = _field(body, "lora_name")
        if not name:
            raise invalid("lora_name", "'lora_name' needs to be provided to unload a LoRA adapter.")
        _check_name(name)
        async with self._store(metadata) as store:
            try:
                await store.delete(name)
            except DeltaStoreError as e:
                if e.code == grpc.StatusCode.NOT_FOUND:
                    raise ApiError(
                        404, f"The lora adapter '{name}' cannot be found.", type="NotFoundError", code="not_found"
                    ) from None
                raise error_of_rpc(e.code, e.details or str(e)) from None
        await self._until(metadata, lambda names: name not in names, f"the router to drop {name!r}")
        log.info("adapter %r unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _adapter_dir(self, path: str) -> Path:
        """`path` resolved (links followed) inside the root, or 400 naming neither directory."""
        root = self.settings.root.resolve()
        p = Path(path)
        resolved = (p if p.is_absolute() else root / p).resolve()
        if not resolved.is_relative_to(root):
            raise invalid("lora_path", f"lora_path {clip(path)} is not under this server's adapter directory")
        if not (resolved / "adapter_config.json").is_file():
            raise ApiError(
                404, f"No adapter found at lora_path {clip(path)} (no adapter_config.json)", code="not_found"
            )
        return resolved

    async def _import(self, adapter: Path, out: Path, name: str) -> None:
        argv = ["-m", "bitdelta.cli", "import-lora", "--base", str(self.settings.base), "--adapter", str(adapter)]
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            *argv,
            "--out",
            str(out),
            "--variant",
            name,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )  # the gateway's own environment and directory: bitdelta as the gateway imports it
        try:
            _, err = await asyncio.wait_for(child.communicate(), self.settings.timeout_s)
        except (TimeoutError, asyncio.CancelledError):  # a client that leaves takes its import with it
            child.kill()
            await child.wait()
            raise
        if child.returncode:
            lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
            reason = (lines[-1] if lines else f"exit status {child.returncode}").removeprefix("error: ")
            reason = reason.replace(str(self.settings.base), "the base").replace(str(adapter), "the adapter")
            raise invalid("lora_path", f"cannot load the adapter at lora_path: {reason[:500]}", "invalid_adapter")

    async def _until(self, metadata, done: Callable[[set[str]], bool], what: str) -> None:
        deadline = time.monotonic() + self.settings.timeout_s
        while not done(await self.list_names(metadata)):
            if time.monotonic() > deadline:
                raise ApiError(504, f"timed out waiting for {what}", type="server_error", code="timeout")
            await asyncio.sleep(0.1)

    @contextlib.asynccontextmanager
    async def _store(self, metadata: tuple[tuple[str, str], ...]):
        auth = dict(metadata).get("authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        client = DeltaStoreClient(self.settings.store, credentials=self.settings.credentials, token=token)
        try:
            yield client
        finally:
            await client.close()


def _field(body: object, key: str) -> str:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", code="invalid_json")
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise invalid(key, f"{key} must be a string")
    return v or ""


def _check_name(name: str) -> None:
    if not is_model_id(name):
        raise invalid("lora_name", f"lora_name {clip(name)} is not a model name: {MODEL_ID_RULE}")


async def _exists(store: DeltaStoreClient, name: str) -> bool:
    try:
        await store.stat(name)
    except DeltaStoreError as e:
        if e.code == grpc.StatusCode.NOT_FOUND:
            return False
        raise error_of_rpc(e.code, e.details or str(e)) from None
    return True
