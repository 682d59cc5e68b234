"""What the structured-output tests share: a JSON schema whose every output is bounded, and an
`openai` client on a test cluster's gateway that waits until the router lists the variants."""

from __future__ import annotations

import asyncio

import openai

# nested objects, an array of enums, string length limits, an integer range, a pattern, a boolean;
# at most ~200 bytes written compactly (a string's character at most a 12-byte surrogate-pair escape)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 3},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "ok"],
    "additionalProperties": False,
}


async def gateway_client(address: str, variants: set[str], timeout: float) -> openai.AsyncOpenAI:
    """An SDK client on the gateway at `address`, once the router lists `variants` (its registry
    reads the store after it starts); `client.base` is the base's model id."""
    c = openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key="k", max_retries=0, timeout=timeout)
    for _ in range(600):
        if variants <= {m.id for m in (await c.models.list()).data}:
            break
        await asyncio.sleep(0.1)
    c.base = (await c.models.list()).data[0].id
    return c
