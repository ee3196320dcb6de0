"""Server-sent events framing, and the channel that carries one request's engine events to the
event loop.

A stream is `data: <json>\\n\\n` per chunk and `data: [DONE]\\n\\n` at the end; an error after the
stream began is one `data: {"error": {...}}` event before [DONE] (what the openai client raises).

The engine calls `Channel.sink` on its own thread; the sink only schedules the hand-over on the
event loop (`call_soon_threadsafe`), so the loop never waits on the engine and the engine never
touches an asyncio object.
"""

from __future__ import annotations

import asyncio
import json

from hetero_run.runtime.engine.api import GenerationEvent

DONE = b"data: [DONE]\n\n"


def event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Channel:
    """One request's events, from the engine's thread to the coroutine serving the request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, observe=None):
        self.loop = loop
        self.queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self.observe = observe  # called on the engine's thread first (metrics)
        self.finished = False

    def sink(self, event: GenerationEvent) -> None:
        if self.observe is not None:
            self.observe(event)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass

    async def next(self) -> GenerationEvent:
        event = await self.queue.get()
        self.finished = self.finished or event.final
        return event
