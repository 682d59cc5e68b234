"""The gateway's catalog of variants' own chat templates and sampling defaults: kept for its TTL, an
unknown model refreshes at most once per MIN_REFRESH_S, a failing listing keeps what was known, and
a template that does not compile is an error of that variant only. The listing is a function here
(the caller passes the clock too); test_gateway_variant_files.py runs it against a real router."""

from __future__ import annotations

import grpc
import pytest

from bitdelta.generation import SamplingDefaults
from bitdelta.model_files import TemplateSource
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.rpc.clients.router import RouterCallError
from services.gateway.catalog import MIN_REFRESH_S, Catalog

pytestmark = pytest.mark.asyncio


def info(name: str, template: str | None = None, temperature: float | None = None, base=False) -> pb.ModelInfo:
    m = pb.ModelInfo(model_id=name, is_base=base)
    if template is not None:
        m.chat_template.CopyFrom(TemplateSource(template, "", {"eos_token": "</s>"}).to_pb())
    if temperature is not None:
        m.sampling_defaults.CopyFrom(SamplingDefaults(temperature=temperature).to_pb())
    return m


class Listing:
    def __init__(self, models):
        self.models, self.calls, self.fail = models, 0, False

    async def __call__(self, metadata):
        self.calls += 1
        if self.fail:
            raise RouterCallError("ListModels: down", grpc.StatusCode.UNAVAILABLE, service="router")
        return self.models


async def test_kept_for_the_ttl_refreshed_after_and_unknown_names_rate_limited():
    now = [0.0]
    listing = Listing([info("base", base=True), info("a", "{{ eos_token }}!", 0.5), info("b")])
    c = Catalog(listing, ttl_s=10.0, clock=lambda: now[0])
    a = await c.own("a")
    assert a.template.render([]) == "</s>!" and a.defaults.temperature == 0.5 and not a.error
    b = await c.own("b")
    assert b.template is None and b.defaults is None  # the base's
    assert (await c.own("base")).template is None and listing.calls == 1
    for _ in range(5):  # unknown names: one listing per MIN_REFRESH_S at most
        assert (await c.own("nope")).template is None
    assert listing.calls == 1
    now[0] += MIN_REFRESH_S + 0.1
    for _ in range(5):
        await c.own("nope")
    assert listing.calls == 2
    listing.models = [info("a", "new {{ eos_token }}")]
    assert (await c.own("a")).template.render([]) == "</s>!"  # within the TTL
    now[0] += 10.1
    assert (await c.own("a")).template.render([]) == "new </s>" and listing.calls == 3
    listing.fail = True
    now[0] += 10.1
    assert (await c.own("a")).template.render([]) == "new </s>"  # the router is down: what was known
    calls = listing.calls
    for _ in range(5):  # ... asked once a second, not by every request
        await c.own("a")
    assert listing.calls == calls
    now[0] += MIN_REFRESH_S + 0.1
    await c.own("a")
    assert listing.calls == calls + 1


async def test_a_template_that_does_not_compile_is_that_variants_error():
    c = Catalog(Listing([info("bad", "{% for %}"), info("good", "ok")]), ttl_s=10.0)
    bad = await c.own("bad")
    assert bad.template is None and "bad" in bad.error
    assert (await c.own("good")).template.render([]) == "ok"


async def test_requests_arriving_together_share_one_listing():
    import asyncio

    listing = Listing([info("a", "x")])
    slow = asyncio.Event()

    async def wait_then_list(metadata):
        await slow.wait()
        return await listing(metadata)

    c = Catalog(wait_then_list, ttl_s=10.0)
    waiting = [asyncio.ensure_future(c.own("a")) for _ in range(8)]
    await asyncio.sleep(0.01)
    slow.set()
    assert all(o.template.render([]) == "x" for o in await asyncio.gather(*waiting)) and listing.calls == 1
