"""A ``podman system service`` of fusion-oci's own, for when no podman socket answers.

Started only when a task (or ``gc``) needs the engine, never to answer ``availability()``: on
a private socket in an owner-stamped scratch folder, under :mod:`fusion_oci.shims.watchdog`, so
the service ends and its folder goes when :meth:`PodmanService.stop` runs or when the owning
process dies, ``kill -9`` included (podman is daemonless: this is what `podman` itself does
per command, kept alive for the task). A user who runs the socket unit
(``systemctl --user enable --now podman.socket``) never gets one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from fusion_oci.engines.base import API_TIMEOUT_S, EngineAdapter
from fusion_oci.engines.endpoints import Endpoint, preflight
from fusion_oci.engines.errors import engine_errors
from fusion_oci.errors import RuntimeUnavailableError
from fusion_oci.host.scratch import make_scratch, process_start
from fusion_oci.shims import WATCHDOG

SERVICE_START_S = 20.0


class PodmanService:
    """One started service; :meth:`start` returns an adapter on it, :meth:`stop` ends it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.process: subprocess.Popen[bytes] | None = None
        """The watchdog that runs the service (None before start and after stop)."""
        self.folder: str | None = None
        """The scratch folder holding the service's socket and log."""

    def start(self, tried: Sequence[Endpoint]) -> EngineAdapter:
        from fusion_oci.engines.podman import PodmanAdapter

        where = ", ".join(f"{e.url} ({e.source})" for e in tried)
        podman_bin = shutil.which("podman", path=self.env.get("PATH"))
        if podman_bin is None:
            raise RuntimeUnavailableError(
                "podman",
                f"podman is not installed and no API socket answers at {where}",
                "install podman (apt-get install podman), or set podman.url",
            )
        folder = make_scratch("podman", "service")
        self.folder = str(folder)
        url = f"unix://{folder}/podman.sock"
        log = folder / "service.log"
        pid = os.getpid()
        with log.open("wb") as out:
            # Under the watchdog, in its own session: a Ctrl-C of the caller's group does not
            # hit it (dispose still needs it), stop() or the owner's death ends its group.
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-S",
                    "-E",
                    str(WATCHDOG),
                    str(pid),
                    process_start(pid) or "0",
                    str(folder),
                    "--",
                    podman_bin,
                    "system",
                    "service",
                    "--time=0",
                    url,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        endpoint = Endpoint(
            url,
            f"`podman system service` started by fusion-oci "
            f"(pid {self.process.pid}; no socket answered at {where})",
        )
        deadline = time.monotonic() + SERVICE_START_S
        adapter = PodmanAdapter.open(endpoint, timeout=API_TIMEOUT_S)
        while True:
            try:
                with engine_errors("podman", "ping", endpoint):
                    preflight(endpoint)  # no HTTP (and no half-open socket) before it exists
                    adapter.probe()
                return adapter
            except RuntimeUnavailableError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-400:]
                    adapter.close()
                    self.stop()
                    raise RuntimeUnavailableError(
                        "podman",
                        f"`podman system service` did not come up: {tail}",
                        "run `podman info` to see what is wrong with podman here",
                    ) from None
                time.sleep(0.1)

    def stop(self) -> None:
        service, self.process = self.process, None
        if service is not None and service.poll() is None:
            # The watchdog ends the service's group and removes the folder, then exits.
            with contextlib.suppress(ProcessLookupError):
                service.send_signal(signal.SIGTERM)
            try:
                service.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(service.pid, signal.SIGKILL)
                service.wait()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
