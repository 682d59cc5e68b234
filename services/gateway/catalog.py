"""Each variant's own chat template and sampling defaults, as the router lists them (its delta
records its fine-tune's where they are not the base's: `bitdelta.model_files`), kept for `ttl_s`
seconds. A model the catalog has not seen refreshes the list at once; either refresh happens at
most once per `MIN_REFRESH_S` (so that requests for unknown names, or a router that is down, cannot
turn into a ListModels each); requests that arrive while a listing is under way take its result;
a listing that fails keeps what was known. What the gateway's own flags say for a variant comes
first (`Templates`, `GenerationConfigs`); the base's flags serve a variant without its own.

    catalog = Catalog(lambda md: router.list_models(metadata=md), ttl_s=5.0)
    own = await catalog.own("writer", metadata)      # Own(template, defaults), either None: the base's
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from bitdelta.generation import GenerationError, SamplingDefaults
from bitdelta.model_files import ModelFileError, TemplateSource
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.rpc.clients.router import RouterCallError
from services.gateway.chat import ChatTemplate, ChatTemplateError

MIN_REFRESH_S = 1.0

Metadata = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Own:
    """A variant's own chat template and sampling defaults (None: the base's); `error`: why its own
    cannot serve (a template that does not compile), answered for its requests (500)."""

    template: ChatTemplate | None = None
    defaults: SamplingDefaults | None = None
    error: str = ""
    own_tokenizer: bool = False  # its fine-tune's own tokenizer reads its text (on the workers), not the base's


NONE = Own()


class Catalog:
    def __init__(
        self,
        list_models: Callable[[Metadata], Awaitable[list[pb.ModelInfo]]],
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.list_models, self.ttl_s, self.clock = list_models, ttl_s, clock
        self.models: dict[str, Own] = {}
        self.fetched = self.tried = -float("inf")
        self._lock = asyncio.Lock()
        self._compiled: dict[tuple[str, tuple], ChatTemplate | str] = {}  # (source, specials) -> template or error

    def _due(self, model: str) -> bool:
        """Stale, or a name not seen; either at most once per MIN_REFRESH_S (a router that is down
        is asked once a second, not by every request)."""
        now = self.clock()
        return (now - self.fetched > self.ttl_s or model not in self.models) and now - self.tried > MIN_REFRESH_S

    async def own(self, model: str, metadata: Metadata = ()) -> Own:
        if self._due(model) or self._lock.locked():
            async with self._lock:  # one listing at a time: requests arriving meanwhile take its result
                if self._due(model):
                    self.tried = self.clock()
                    try:
                        self.update(await self.list_models(metadata))
                    except RouterCallError:
                        pass  # keep what is known; the generation's own call reports the router's state
        return self.models.get(model, NONE)

    def update(self, models: list[pb.ModelInfo]) -> None:
        """Take a listing (the /v1/models handler's too)."""
        self.models = {m.model_id: self._own(m) for m in models if not m.is_base}
        self.fetched = self.clock()

    def _own(self, m: pb.ModelInfo) -> Own:
        template, defaults, error = None, None, ""
        try:
            if m.HasField("sampling_defaults"):
                defaults = SamplingDefaults.from_pb(m.sampling_defaults)
            if m.HasField("chat_template"):
                t = TemplateSource.from_pb(m.chat_template, f"variant {m.model_id!r}'s own chat template")
                key = (t.source, tuple(sorted(t.specials.items())))
                if key not in self._compiled:
                    try:
                        self._compiled[key] = ChatTemplate.of(t)
                    except ChatTemplateError as e:
                        self._compiled[key] = str(e)
                    while len(self._compiled) > 4 * max(len(self.models), 16):  # templates of deltas gone
                        self._compiled.pop(next(iter(self._compiled)))
                compiled = self._compiled[key]
                template, error = (compiled, "") if isinstance(compiled, ChatTemplate) else (None, compiled)
        except (GenerationError, ModelFileError) as e:
            error = f"variant {m.model_id!r}: its own chat template or sampling defaults are malformed ({e})"
        return Own(template, defaults, error, own_tokenizer=bool(m.tokenizer_sha256))
