"""``egress`` networking: slirp4netns on a fresh network namespace, host loopback closed.

The namespace's only way out is slirp4netns, a user-mode TCP/IP stack running on the host side:
outbound connections are NATed through the host's sockets, while ``--disable-host-loopback``
refuses anything addressed to the host's own 127.0.0.0/8 (as the gateway 10.0.2.2 or
otherwise). Inside, 127.0.0.1 is the namespace's own loopback, so the host's dashboard on
127.0.0.1:4040 or a database on :5432 is simply not there.

Attaching needs the namespace before the command runs: the launcher reports its child pid
(bwrap ``--info-fd``) and holds the command (``--block-fd``) until :func:`attach` returns.

Two ordering details, both learnt the hard way:

* bwrap sets up the namespace's loopback itself with an exclusive RTM_NEWADDR; slirp4netns
  ``--configure`` also brings ``lo`` up, and if it wins the race the kernel has already added
  127.0.0.1 and bwrap dies ("Failed RTM_NEWADDR"). So we wait until 127.0.0.1 shows in the
  namespace's local table before starting slirp4netns.
* With ``--disable-userns`` bwrap moves its child into a second, nested user namespace that has
  no rights over the network namespace. slirp4netns must join the namespace's *owning* user
  namespace, which ``ioctl(NS_GET_USERNS)`` on the netns hands us, race-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.errors import SandboxSetupError
from fusion_oci.models import NetworkMode
from fusion_oci.runtimes.linux.pipes import close_all, read_byte
from fusion_oci.services.inside import PUBLISH_KEY

if TYPE_CHECKING:
    from fusion_oci.resolve import ResolvedTask

NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1), linux/nsfs.h
SLIRP_GATEWAY = "10.0.2.2"
SLIRP_DNS = "10.0.2.3"
SLIRP_MTU = 65520
TAP = "tap0"
RESOLV_CONF = f"nameserver {SLIRP_DNS}\n"
"""/etc/resolv.conf inside an egress namespace: slirp's DNS forwarder, which works whatever the
host uses (a 127.0.0.53 stub resolver would be unreachable from inside)."""


def slirp_argv(
    slirp: str,
    *,
    netns: str,
    userns: str,
    ready_fd: int,
    exit_fd: int,
    as_root: bool,
    mtu: int = SLIRP_MTU,
    tap: str = TAP,
) -> list[str]:
    """The slirp4netns command line. Pure.

    ``--enable-sandbox`` (its own mount namespace, capabilities dropped) only as root: run by
    an unprivileged user from the host's user namespace it fails ("setegid(0)").
    """
    hardening = ["--enable-sandbox", "--enable-seccomp"] if as_root else ["--enable-seccomp"]
    return [
        slirp,
        "--configure",
        f"--mtu={mtu}",
        "--disable-host-loopback",
        *hardening,
        f"--ready-fd={ready_fd}",
        f"--exit-fd={exit_fd}",
        f"--userns-path={userns}",
        "--netns-type=path",
        netns,
        tap,
    ]


def tun_usable(path: Path = Path("/dev/net/tun")) -> bool:
    return path.exists() and os.access(path, os.R_OK | os.W_OK)


def loopback_ready(pid: int) -> bool:
    """True once 127.0.0.1 exists in the namespace of ``pid`` (bwrap's loopback is set up)."""
    try:
        return "127.0.0.1" in Path(f"/proc/{pid}/net/fib_trie").read_text()
    except OSError:
        return False


@dataclass
class Egress:
    """A running slirp4netns attached to one command's network namespace."""

    process: asyncio.subprocess.Process
    exit_w: int
    log: Path

    @classmethod
    async def attach(cls, pid: int, *, slirp: str, log: Path, timeout_s: float = 10.0) -> Egress:
        deadline = time.monotonic() + timeout_s
        while not loopback_ready(pid):
            if time.monotonic() > deadline or not _alive(pid):
                raise _error(
                    "the sandbox's network namespace never came up",
                    f"no loopback in /proc/{pid}/net after {timeout_s:.0f}s",
                )
            await asyncio.sleep(0.0005)
        netns = userns = ready_r = ready_w = exit_r = exit_w = None
        try:
            netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            userns = fcntl.ioctl(netns, NS_GET_USERNS)
            ready_r, ready_w = os.pipe()
            exit_r, exit_w = os.pipe()
            with log.open("wb") as log_fh:
                process = await asyncio.create_subprocess_exec(
                    *slirp_argv(
                        slirp,
                        netns=f"/proc/self/fd/{netns}",
                        userns=f"/proc/self/fd/{userns}",
                        ready_fd=ready_w,
                        exit_fd=exit_r,
                        as_root=os.geteuid() == 0,
                    ),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=log_fh,
                    pass_fds=(netns, userns, ready_w, exit_r),
                    start_new_session=True,
                )
        except OSError as exc:
            close_all(netns, userns, ready_r, ready_w, exit_r, exit_w)
            raise _error("slirp4netns could not be started", str(exc)) from exc
        close_all(netns, userns, ready_w, exit_r)
        egress = cls(process, exit_w, log)
        try:
            ready = await read_byte(ready_r, max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            ready = b""
        finally:
            close_all(ready_r)
        if ready != b"1":
            await egress.stop()
            raise _error(
                "slirp4netns did not configure the sandbox's network", _tail(log) or "no output"
            )
        return egress

    def kill(self) -> None:
        """End slirp4netns now (the command is over: nothing of its network is worth keeping).

        It takes ~25 ms to exit on its exit pipe or on SIGTERM; it holds no state worth a clean
        exit (the namespace dies with the sandbox), so it gets SIGKILL.
        """
        close_all(self.exit_w)
        self.exit_w = -1
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        """Kill and reap slirp4netns."""
        self.kill()
        await self.process.wait()


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _tail(log: Path) -> str:
    try:
        return "; ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
    except OSError:
        return ""


def _error(what: str, why: str) -> SandboxSetupError:
    return SandboxSetupError(
        what,
        why,
        "check `slirp4netns --version` and that /dev/net/tun is readable and writable; "
        "or use network none/host",
    )


def proxy_socket(task: ResolvedTask) -> str | None:
    """``network: filtered``: the host path of the task's egress proxy socket, which the
    runtime binds into the sandbox (its agent forwards 127.0.0.1:3128 to it); None for any
    other network. A filtered task without a proxy is refused: it would have no way out."""
    if task.spec.network is not NetworkMode.FILTERED:
        return None
    if task.egress is None:
        raise SandboxSetupError(
            "network filtered needs the task's egress proxy",
            "none was started for this task",
            "prepare the task through fusion_oci.Sandbox",
        )
    return str(task.egress.unix_socket)


def service_relays(task: ResolvedTask) -> tuple[tuple[str, str], ...] | None:
    """``policy.hostServices``: each grant (canonical) and its relay's host socket, which the
    runtime binds into the sandbox (fusion_oci.services.inside); then each unix grant and the
    path it resolved to on the host (``unix-target:`` + grant). None without grants. A task
    with grants but no relays is refused: its services would not be there."""
    if not task.spec.host_services and not task.spec.published_ports:
        return None
    if (task.services is None and task.spec.host_services) or (
        task.ports is None and task.spec.published_ports
    ):
        raise SandboxSetupError(
            "hostServices and publishPorts need the task's relays",
            "none were started for this task",
            "prepare the task through fusion_oci.Sandbox",
        )
    out: list[tuple[str, str]] = []
    if task.services is not None:
        out += [(str(r.grant), str(r.socket)) for r in task.services.relays]
        out += [
            (TARGET + str(r.grant), r.target)
            for r in task.services.relays
            if r.grant.kind == "unix"
        ]
    if task.ports is not None:  # publishPorts: each port's relay, as publish:N
        out += [(f"{PUBLISH_KEY}{i}", path) for i, path in task.ports.sockets().items()]
    return tuple(out)


TARGET = "unix-target:"
"""Prefix of a unix grant's resolved-path entry in :func:`service_relays`."""


def split_relays(
    relays: tuple[tuple[str, str], ...] | None,
) -> tuple[dict[str, str] | None, dict[str, str]]:
    """:func:`service_relays` as (grant → socket, unix grant → resolved path). Pure."""
    if relays is None:
        return None, {}
    sockets = {k: v for k, v in relays if not k.startswith(TARGET)}
    targets = {k[len(TARGET) :]: v for k, v in relays if k.startswith(TARGET)}
    return sockets, targets
