"""The gateway tests' helpers: the official openai client on a gateway process, and the text the
router's own Generate gives for the same model, prompt and sampling (the gateway's reference)."""

from __future__ import annotations

import json

import openai

from bitdelta.generation import Sampling
from bitdelta.router.v1 import router_pb2 as rpb
from bitdelta.rpc.clients.router import RouterClient


def oai(gateway, timeout: float = 120) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{gateway.address}/v1", api_key="k", max_retries=0, timeout=timeout)


async def routers_text(router: RouterClient, model: str, prompt: str, templated: bool = False, **sampling) -> str:
    """The router's text for `prompt` (`templated`: a rendered chat prompt, as the gateway sends it)."""
    req = rpb.GenerateRequest(model_id=model, prompt=prompt, sampling=Sampling(**sampling).to_pb(), templated=templated)
    return "".join([t.text async for m in router.generate_request(req) for t in m.tokens])


def http(gateway, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, parsed JSON or text) of one raw HTTP request."""
    import http.client

    host, port = gateway.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        data = r.read().decode()
    finally:
        conn.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data
