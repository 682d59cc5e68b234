"""The variant registry: model_id -> the delta in the store and the base it was built for.

Refreshed from the delta store's `List` every `refresh_s` and, for an id it does not know, by a
`List` that starts after the request arrived (one call in flight at a time, shared by every
request that missed meanwhile), so a variant uploaded with `Put` is servable at once, without a
restart, and a deleted one stops with a clear error.
While the store is unreachable the last list stays in use (resident variants keep serving).

    registry = Registry(store_client, refresh_s=5.0)
    v = await registry.lookup("coder", base)   # Variant, or NotFound / FailedPrecondition
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass

from bitdelta.generation import SamplingDefaults
from bitdelta.model_files import TemplateSource
from bitdelta.rpc.clients.delta_store import DeltaStoreClient
from bitdelta.rpc.errors import RpcError, clip
from services.router.errors import FailedPrecondition, NotFound, Unavailable
from services.router.periodic import Periodic
from services.router.pool import BaseInfo

log = logging.getLogger("services.router.registry")
MAX_REMEMBERED_DELETIONS = 1000


@dataclass(frozen=True)
class Variant:
    """One requestable model: the base itself, or a delta in the store."""

    model_id: str
    base_model: str
    base_fingerprint: str
    delta_bytes: int = 0
    is_base: bool = False
    # its fine-tune's own chat template and sampling defaults, from its delta (None: the base's)
    chat_template: TemplateSource | None = None
    sampling: SamplingDefaults | None = None
    malformed: str = ""  # why its delta's own chat template or sampling defaults cannot be read
    tokenizer_sha256: str = ""  # its fine-tune's own tokenizer's, which the workers serve it with; "": the base's

    @classmethod
    def of_delta(cls, d) -> Variant:
        """A delta as the store lists it (its DeltaInfo, with the header's metadata the store checked)."""
        md = d.metadata
        template = TemplateSource.from_json(md["chat_template"], d.name) if "chat_template" in md else None
        sampling = (
            SamplingDefaults.from_config(json.loads(md["sampling_defaults"])) if "sampling_defaults" in md else None
        )
        return cls(
            d.name,
            d.base_model,
            d.base_fingerprint,
            d.size_bytes,
            chat_template=template,
            sampling=sampling,
            tokenizer_sha256=md.get("tokenizer_sha256", ""),
        )

    @property
    def key(self) -> str | None:
        """The delta's name on the workers (None for the base)."""
        return None if self.is_base else self.model_id

    def mismatch(self, base: BaseInfo) -> str:
        """Why this variant cannot run on `base` ("" when it can)."""
        if self.malformed:
            return self.malformed
        if self.is_base or self.base_fingerprint == base.fingerprint:
            return ""
        return (
            f"variant {self.model_id!r} was built for base {self.base_model!r} (fingerprint "
            f"{self.base_fingerprint[:12]}…), but the workers serve {base.name!r} ({base.fingerprint[:12]}…); "
            f"compress it again against this base"
        )


class Registry:
    def __init__(self, store: DeltaStoreClient, *, refresh_s: float, call_timeout_s: float = 5.0):
        self.store, self.refresh_s, self.call_timeout_s = store, refresh_s, call_timeout_s
        self.variants: dict[str, Variant] = {}
        self.deleted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.last_error = "not refreshed yet"
        self._started = float("-inf")  # when the current (or last) List call started
        self._refreshing: asyncio.Task | None = None
        self._refresher = Periodic(self.refresh, refresh_s, "variant list refresh")

    async def start(self) -> None:
        """Read the store's list once, then every `refresh_s` in the background."""
        await self._refresher.start()

    async def close(self) -> None:
        await self._refresher.close()

    async def refresh(self, since: float | None = None) -> bool:
        """Re-read the store's list with a List call that started at or after `since` (monotonic;
        default now); one call in flight however many callers. Returns whether it succeeded."""
        since = time.monotonic() if since is None else since
        while True:
            task = self._refreshing
            if task is not None and self._started >= since:
                return await asyncio.shield(task)
            if task is not None and not task.done():
                await asyncio.shield(task)  # too old for this caller: wait, then start a fresh one
                continue
            self._started = time.monotonic()
            self._refreshing = asyncio.create_task(self._refresh())

    async def _refresh(self) -> bool:
        try:
            deltas = await self.store.list(timeout_s=self.call_timeout_s)
        except RpcError as e:
            if self.last_error != str(e):
                log.warning(
                    "cannot refresh the variant list from the delta store (keeping %d known): %s", len(self.variants), e
                )
            self.last_error = str(e)
            return False
        fresh = {}
        for d in deltas:
            try:
                fresh[d.name] = Variant.of_delta(d)
            except ValueError as e:  # the store checks the metadata it lists: a store of another version
                why = f"variant {d.name!r}: its delta's own chat template or sampling defaults are malformed ({e})"
                log.warning("%s", why)
                fresh[d.name] = Variant(d.name, d.base_model, d.base_fingerprint, d.size_bytes, malformed=why)
        for gone in self.variants.keys() - fresh.keys():
            log.info("variant %r was deleted from the delta store", gone)
            self.deleted[gone] = None
        for name in fresh:
            if name not in self.variants:
                self.deleted.pop(name, None)
                if self.variants:  # not the first list
                    log.info("new variant %r in the delta store", name)
        while len(self.deleted) > MAX_REMEMBERED_DELETIONS:
            self.deleted.popitem(last=False)
        self.variants, self.last_error = fresh, ""
        return True

    async def lookup(self, model_id: str, base: BaseInfo | None) -> Variant:
        """The variant for `model_id` ("" or the base's name: the base), servable on `base`."""
        if base is None:
            raise Unavailable("no worker has reported its base model yet (none is up); retry shortly")
        if model_id in ("", base.name):
            return Variant(base.name, base.name, base.fingerprint, is_base=True)
        v = self.variants.get(model_id)
        if v is None:
            if not await self.refresh():
                raise Unavailable(
                    f"cannot tell whether {clip(model_id)} exists: the delta store is unreachable "
                    f"({self.last_error[:200]}); retry later"
                )
            v = self.variants.get(model_id)
        if v is None:
            if model_id in self.deleted:
                raise NotFound(
                    f"model {clip(model_id)} was deleted from the delta store; ListModels lists the "
                    f"models this router serves"
                )
            raise NotFound(
                f"unknown model {clip(model_id)}; ListModels (or `bitdelta models --router HOST:PORT`) "
                f"lists the base and every variant this router serves"
            )
        why = v.mismatch(base)
        if why:
            raise FailedPrecondition(why)
        return v

    def all(self) -> list[Variant]:
        return sorted(self.variants.values(), key=lambda v: v.model_id)
