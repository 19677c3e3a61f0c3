"""A request's stream of chunks, as both engines hand it to their callers.

The scheduler's thread sends each request's chunks to its sink, then None (it ended) or the
exception that ended it. `stream_async` is that sink on an asyncio loop: the in-process engine's
`generate_async` and the Ray coordinator's `generate_stream` both stream through it, so a closed or
cancelled stream cancels its request (and frees its caches) the same way in both.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.config import SamplingParams
    from specdec.engine.request import GenerationRequest
    from specdec.engine.request_state import StreamChunk
    from specdec.engine.scheduler import Scheduler
    from specdec.engine.step import RequestObserver, ScheduledRequest


def received(item):
    """What a request's sink received, for its stream: a chunk; None once it has ended; a failure is
    raised (the request is already out of the scheduler then)."""
    if isinstance(item, BaseException):
        raise item
    return item


async def stream_async(scheduler: Scheduler, request: GenerationRequest, prompt_token_ids: list[int],
                       sampling: SamplingParams, observer: RequestObserver | None = None,
                       submitted: Callable[[ScheduledRequest], None] | None = None) -> AsyncIterator[StreamChunk]:
    """Submit a checked request and yield its chunks on the running event loop (the scheduler runs in
    a thread of its own, so many requests stream from one loop); `submitted` is told once it is
    queued. Closing or cancelling the stream cancels the request."""
    loop = asyncio.get_running_loop()
    out: asyncio.Queue = asyncio.Queue()
    item = scheduler.submit(request, prompt_token_ids, sampling,
                            lambda x: loop.call_soon_threadsafe(out.put_nowait, x), observer=observer)
    try:
        if submitted is not None:
            submitted(item)
        while (chunk := received(await out.get())) is not None:
            yield chunk
    finally:
        scheduler.cancel(item)  # a no-op once the request has ended
