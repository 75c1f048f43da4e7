"""The synchronous facade's loop: it runs for the sandbox's life (what a task serves between
commands keeps being served), a call's error comes back as it is, and dispose ends the loop's
thread and leaves nothing running."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox


def test_the_loop_runs_between_calls_and_dispose_ends_its_thread() -> None:
    sb = SyncSandbox(SandboxSettings(), env={})
    served = threading.Event()
    started: list[asyncio.Task[None]] = []

    async def between() -> None:  # work of the task's, scheduled while no call is made
        served.set()
        await asyncio.sleep(3600)

    sb._loop.call_soon_threadsafe(lambda: started.append(sb._loop.create_task(between())))
    assert served.wait(5)
    thread = sb._thread
    sb.dispose()
    assert not thread.is_alive()
    assert sb._loop.is_closed()
    assert started and started[0].cancelled()  # what was left on the loop was cancelled
    sb.dispose()  # again: nothing to do
    with pytest.raises(RuntimeError, match="disposed"):
        sb._call(asyncio.sleep(0))


def test_a_calls_error_comes_back_as_it_is() -> None:
    with SyncSandbox(SandboxSettings(), env={}) as sb:

        async def fails() -> None:
            raise ValueError("from the loop")

        with pytest.raises(ValueError, match="from the loop"):
            sb._call(fails())
