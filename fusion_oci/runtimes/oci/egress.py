"""One egress container's rendezvous: FIFOs for the hook (or runsc's launch script), and the
slirp4netns it waits on (:mod:`fusion_oci.runtimes.linux.egress`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

from fusion_oci.errors import SandboxSetupError
from fusion_oci.oci.ops import EgressHook


class EgressLink:
    """Attaches slirp4netns once the container reports its pid; says ``go`` or ``no``.

    Both FIFOs are opened read-write here, so neither side's open() blocks and the hook's
    read sees EOF (and fails) as soon as we close them, whatever state we are in. Anything but
    ``go`` fails the hook, so the command never starts without its network path.
    """

    def __init__(self, hook: EgressHook, log: Path) -> None:
        self.hook = hook
        self.request = Path(hook.request)
        self.reply = Path(hook.reply)
        self.log = log
        self.error: SandboxSetupError | None = None
        self._fds: list[int] = []
        self._task: asyncio.Task[Any] | None = None

    def start(self, slirp: str) -> None:
        for fifo in (self.request, self.reply):
            os.mkfifo(fifo, 0o600)
            self._fds.append(os.open(fifo, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
        self._task = asyncio.ensure_future(self._attach(slirp))

    async def _attach(self, slirp: str) -> Any:
        from fusion_oci.runtimes.linux.egress import Egress
        from fusion_oci.runtimes.linux.pipes import read_json

        state = await read_json(self._fds[0])
        try:
            if not state or not isinstance(state.get("pid"), int):
                raise SandboxSetupError(
                    "the egress hook sent no container pid", f"state: {state!r}"
                )
            link = await Egress.attach(state["pid"], slirp=slirp, log=self.log)
        except SandboxSetupError as exc:
            self.error = exc
            os.write(self._fds[1], b"no\n")
            return None
        os.write(self._fds[1], b"go\n")
        return link

    async def close(self) -> None:
        link = None
        if self._task is not None:
            if not self._task.done():
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                link = await self._task
        if link is not None:
            await link.stop()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for path in (self.request, self.reply, self.log):
            path.unlink(missing_ok=True)
