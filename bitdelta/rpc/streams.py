"""Server streams that send every item ready when a message is written (Generate's tokens).

A hop that writes one message per token spends its CPU on messages once its reader (or its own
event loop) is slower than the model. Each hop therefore puts what it gets in a queue and, each
time it is ready to write, takes everything the queue holds (`take_ready`): a reader that keeps up
still gets one token per message, and nothing ready is ever held back waiting for more.

    items = await take_ready(queue, limit)   # waits for the first item only; then all ready ones
    for message in first_alone(items, first):  # the stream's first item alone, at once
        await write(message)
"""

from __future__ import annotations

import asyncio


async def take_ready(queue: asyncio.Queue, limit: int = 0) -> list:
    """The next item of `queue` (waiting for it) and every item already behind it, at most `limit`
    in all (0: no limit). Never waits for a second item."""
    items = [await queue.get()]
    while not queue.empty() and (not limit or len(items) < limit):
        items.append(queue.get_nowait())
    return items


def first_alone(items: list, first: bool) -> list[list]:
    """The messages to write `items` in: when they start the stream (`first`), its first item alone
    and at once (the reader's time to first token must not wait for the rest), then the others;
    otherwise all of them in one."""
    return [items[:1], items[1:]] if first and len(items) > 1 else [items]
