"""Sockets in another network namespace (fusion_oci/services/netns.py), the way the relay of a
task's service containers makes them: as root on a helper thread; as an unprivileged user,
through the one-threaded helper (fusion_oci/shims/nssockets.py) that joins the namespace's
owning user namespace first. A listener in a namespace of its own answers through them, and
nothing of that namespace is on the host's loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.integration.container_cases import checked_rootless_user, rootless_python

PORT = 47311
LISTENER = textwrap.dedent(
    f"""
    import os, socket
    s = socket.socket()
    s.bind(("127.0.0.1", {PORT}))
    s.listen()
    print("ready", os.getpid(), flush=True)
    while True:
        c, _ = s.accept()
        c.sendall(b"inside")
        c.close()
    """
)
CLIENT = textwrap.dedent(
    f"""
    import asyncio, json, sys
    from fusion_oci.services.netns import NetnsSockets

    async def main():
        try:
            sockets = NetnsSockets.of_pid(int(sys.argv[1]))
        except OSError as exc:
            print(json.dumps({{"error": str(exc)}}))
            return
        try:
            got = []
            for _ in range(3):
                sock = await sockets.connect({PORT}, 5.0)
                got.append((await asyncio.get_running_loop().sock_recv(sock, 64)).decode())
                got.append(sock.get_inheritable())
                sock.close()
            print(json.dumps({{"got": got}}))
        finally:
            sockets.close()

    asyncio.run(main())
    """
)


@contextmanager
def listener(prefix: list[str], unshare: str) -> Iterator[int]:
    """A TCP listener on 127.0.0.1:PORT of a new network namespace; its pid."""
    proc = subprocess.Popen(
        # a new namespace's lo is down: up, then the listener in place of the shell
        [
            *prefix,
            "unshare",
            unshare,
            "/bin/sh",
            "-c",
            'ip link set lo up && exec /usr/bin/python3 -c "$0"',
            LISTENER,
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    listener_pid = 0
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline().split()
        assert said[:1] == ["ready"], said
        listener_pid = int(said[1])  # its own word: runuser stays between, as its parent
        yield listener_pid
    finally:
        # the listener first (runuser's child: killing runuser leaves it), then what is left
        if listener_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(listener_pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def as_user(argv: list[str], user: str | None) -> dict[str, object]:
    python = rootless_python()
    prefix = ["runuser", "-u", user, "--"] if user else []
    out = subprocess.run(
        [*prefix, *python, "-c", CLIENT, *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def host_port_closed() -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", PORT)) != 0


def test_root_makes_sockets_in_a_namespace_on_a_thread() -> None:
    with listener([], "-n") as pid:
        assert as_user([str(pid)], None) == {"got": ["inside", False] * 3}
        assert host_port_closed()


def test_an_unprivileged_owner_reaches_its_own_user_namespaces_network_through_the_helper() -> None:
    user, _ = checked_rootless_user("podman-rootless", None, "the test switches user")
    with listener(["runuser", "-u", user.pw_name, "--"], "-Urn") as pid:
        assert as_user([str(pid)], user.pw_name) == {"got": ["inside", False] * 3}
        assert host_port_closed()
    time.sleep(0.2)
    left = subprocess.run(["pgrep", "-f", "shims/nssockets.py"], capture_output=True, text=True)
    assert left.stdout == "", "the helper ends with its channel"


def test_no_listener_outlives_its_test() -> None:
    """What this file starts ends with each test, a listener under runuser included (it
    outlived runuser once: its own parent stays between)."""
    user, _ = checked_rootless_user("podman-rootless", None, "the test switches user")
    for prefix, unshare in (([], "-n"), (["runuser", "-u", user.pw_name, "--"], "-Urn")):
        with listener(prefix, unshare) as pid:
            assert os.path.exists(f"/proc/{pid}")
        time.sleep(0.2)
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), (prefix, pid)


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] == "Z"
    return True


def test_an_unprivileged_owner_cannot_enter_roots_namespace() -> None:
    user, _ = checked_rootless_user("podman-rootless", None, "the test switches user")
    with listener([], "-n") as pid:
        said = as_user([str(pid)], user.pw_name)
    assert "error" in said, said
    assert "ermission" in str(said["error"]) or "not permitted" in str(said["error"]), said
