"""Streaming a run as an async iterator, for callers who prefer it to ``RunOptions.on_output``.

    async for item in stream_run(sandbox, "pnpm test"):
        if isinstance(item, OutputChunk):
            sys.stdout.buffer.write(item.data)
        else:
            result = item              # the RunResult, always last

Closing the iterator early aborts the command: its whole tree is ended, as cancelling
``Sandbox.run`` does. A ``break`` alone closes it only when the generator is collected, so
leave early inside ``contextlib.aclosing``::

    async with contextlib.aclosing(stream_run(sandbox, cmd)) as items:
        async for item in items:
            if too_much(item):
                break                  # the command is aborted here, not later
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusion_oci.models import OutputStream, RunOptions, RunResult

if TYPE_CHECKING:
    from fusion_oci.sandbox import Sandbox


@dataclass(frozen=True)
class OutputChunk:
    """Bytes the command wrote to one stream, as it wrote them."""

    stream: OutputStream
    data: bytes


async def stream_run(
    sandbox: Sandbox, command: str | Sequence[str], opts: RunOptions | None = None
) -> AsyncIterator[OutputChunk | RunResult]:
    """Yield each chunk of output while ``command`` runs, then its RunResult."""
    opts = opts or RunOptions()
    queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
    also = opts.on_output

    def on_output(stream: OutputStream, chunk: bytes) -> None:
        queue.put_nowait(OutputChunk(stream, chunk))
        if also is not None:
            also(stream, chunk)

    task = asyncio.ensure_future(
        sandbox.run(command, opts.model_copy(update={"on_output": on_output}))
    )
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (item := await queue.get()) is not None:
            yield item
        yield task.result()
    finally:
        if not task.done():
            task.cancel()  # the consumer left: abort, which ends the tree
            with contextlib.suppress(asyncio.CancelledError):
                await task
