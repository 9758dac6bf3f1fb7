"""Several choices of one prompt (`n > 1`): one prefill, n decodes, one merged event stream.

Choice 0 is submitted alone. Once its prompt has been prefilled (its first token, or its end,
arrives), its full prompt blocks are in the prefix cache, and choices 1..n-1 are submitted: each
reuses those blocks through the block pool's reference counts (only the prompt's last partial
block, under one block of tokens, is computed again per choice), decodes on its own, and frees
its references when it ends, so the shared blocks go back to the pool with the last choice.
Each choice has its own seed (`seed + index` when the request set one) and its own grammar
matcher. A later choice refused by admission fails the whole request (429, or an error chunk
once a stream has started) and aborts the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from magnitude.server.async_engine import Delta, Event, Failed, Finished, RequestStream


class ChoiceStreams:
    """Runs the choices of one request and merges their events as (choice index, event)."""

    def __init__(self, first: RequestStream, n: int, submit: Callable[[int], RequestStream]) -> None:
        self.streams: list[RequestStream] = [first]
        self._n = n
        self._submit = submit  # submit(i) -> the stream of choice i; raises when refused

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for ev in stream:
                    await queue.put((i, ev))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(0, self.streams[0]))]
        live, started = 1, self._n == 1
        try:
            while live:
                i, ev = await queue.get()
                if ev is None:
                    live -= 1
                    continue
                if not started and i == 0 and isinstance(ev, (Delta, Finished)):
                    started = True
                    for j in range(1, self._n):  # the prompt is cached now: the others reuse it
                        stream = self._submit(j)
                        self.streams.append(stream)
                        tasks.append(asyncio.create_task(pump(j, stream)))
                        live += 1
                if not started and i == 0 and isinstance(ev, Failed):
                    started = True  # nothing to share; the request fails with choice 0
                yield i, ev
        finally:
            for t in tasks:
                t.cancel()
            self.abort()

    def abort(self) -> None:
        for s in self.streams:
            s.abort()
