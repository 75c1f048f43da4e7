"""A world where the egress proxy resolves with the host's own resolver (getaddrinfo, glibc),
for the probes that are about resolving itself: spellings a resolver folds into a denied name
(issue #31 item 5), port 4040 on the host's non-loopback addresses (item 6), one task's
connection flood beside another task's proxy (item 7).

:func:`run_world` runs :func:`main` as a child under ``unshare --mount --net`` (root): a fresh
network namespace (loopback, and a veth end with 192.0.2.10 and 2001:db8::10: "the host's
own" non-loopback addresses, made here, never the machine's), and in its own mount namespace
``/etc/resolv.conf``, ``/etc/hosts`` and ``/etc/nsswitch.conf`` bound over with files naming a
DNS server of this program on 127.0.0.1:53. That server answers A queries from :data:`NAMES`
and logs the name each query carried (what glibc made of the spelling); HTTP servers on
127.0.0.2 ("allowed") and 127.0.0.3 ("denied") log every connection. The proxies are the real
ones (no ``resolve_override``), on one proxy loop. The child prints one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ALLOWED, DENIED, SELF4, SELF6 = "127.0.0.2", "127.0.0.3", "192.0.2.10", "2001:db8::10"
NAMES = {
    "allowed.world.test": ALLOWED,
    "denied.world.test": DENIED,
    "foo.world.test": DENIED,
    "bar.world.test": DENIED,
    "self.world.test": SELF4,
}
"""What the world's DNS server answers (A records)."""
DENIED_NAMES = ("denied.world.test", "foo.world.test", "bar.world.test")
PORT = 8080

SPELLINGS = {
    "soft-hyphen": "de\xadnied.world.test",
    "ordinal-o": "fo\xba.world.test",
    "ordinal-a": "b\xaar.world.test",
    "decimal-escape": "\\100enied.world.test",
    "char-escape": "de\\nied.world.test",
}
"""Spellings of a denied name a resolver folds into it (latin-1 on the wire: one byte each)."""

FOUR_OH_FOUR_OH = {
    "v4": f"{SELF4}:4040",
    "v6": f"[{SELF6}]:4040",
    "v4-mapped": f"[::ffff:{SELF4}]:4040",
    "name": "self.world.test:4040",
}


def _dns_answer(query: bytes, log: list[str]) -> bytes:
    pos, labels = 12, []
    while query[pos]:
        labels.append(query[pos + 1 : pos + 1 + query[pos]])
        pos += 1 + query[pos]
    qtype = int.from_bytes(query[pos + 1 : pos + 3], "big")
    question = query[12 : pos + 5]
    name = b".".join(labels).decode("latin-1").lower()
    log.append(name)
    address = NAMES.get(name)
    if address is None or qtype != 1:
        rcode = 3 if address is None else 0  # NXDOMAIN, or no AAAA record
        return query[:2] + bytes([0x81, 0x80 | rcode]) + b"\0\1\0\0\0\0\0\0" + question
    answer = b"\xc0\x0c\0\1\0\1\0\0\0\x05\0\4" + socket.inet_aton(address)
    return query[:2] + b"\x81\x80\0\1\0\1\0\0\0\0" + question + answer


def _serve_dns(log: list[str]) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 53))
    while True:
        query, peer = sock.recvfrom(4096)
        try:
            sock.sendto(_dns_answer(query, log), peer)
        except (IndexError, ValueError):
            continue


def _serve_http(address: str, log: list[str]) -> None:
    srv = socket.socket()
    srv.bind((address, PORT))
    srv.listen(64)
    while True:
        conn, _ = srv.accept()
        log.append(address)
        with conn:
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                conn.recv(4096)
            body = f"world-ok {address}\n".encode()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                % (len(body), body)
            )


def _setup(folder: Path) -> None:
    def run(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, timeout=30)

    run("ip", "link", "set", "lo", "up")
    # A veth pair whose both ends stay here (no dummy module in every kernel): one end
    # carries the namespace's own non-loopback addresses.
    run("ip", "link", "add", "fo-self", "type", "veth", "peer", "name", "fo-peer")
    run("ip", "addr", "add", f"{SELF4}/32", "dev", "fo-self")
    run("ip", "addr", "add", f"{SELF6}/128", "dev", "fo-self", "nodad")
    run("ip", "link", "set", "fo-peer", "up")
    run("ip", "link", "set", "fo-self", "up")
    files = {
        "resolv.conf": "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n",
        "hosts": "127.0.0.1 localhost\n",
        "nsswitch.conf": "hosts: files dns\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
        run("mount", "--bind", str(folder / name), f"/etc/{name}")


async def _exchange(path: str, data: bytes, read: int | None = None) -> bytes:
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(data)
        if read is not None:
            return await asyncio.wait_for(reader.readexactly(read), 10)
        return await asyncio.wait_for(reader.read(4096), 10)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        return f"error {exc!r}".encode()
    finally:
        writer.close()


async def _via_connect(
    path: str,
    target: str,
    opened: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None,
) -> str:
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode("latin-1")
    try:
        reader, writer = opened or await asyncio.open_unix_connection(path)
    except OSError as exc:
        return f"error {exc!r}"
    try:
        writer.write(head)
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        if answer.startswith(b"HTTP/1.1 200"):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer += await asyncio.wait_for(reader.read(4096), 10)
        return answer.decode("latin-1")
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
        return f"error {exc!r}"
    finally:
        writer.close()


async def _via_plain(path: str, target: str) -> str:
    head = f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n\r\n".encode("latin-1")
    return (await _exchange(path, head)).decode("latin-1")


async def _via_socks(path: str, host: str, port: int) -> str:
    name = host.encode("latin-1")
    request = b"\x05\x01\x00" + b"\x05\x01\x00\x03" + bytes([len(name)]) + name
    answer = await _exchange(path, request + port.to_bytes(2, "big"), read=12)
    return answer.hex() if not answer.startswith(b"error") else answer.decode()


async def _socks_v4(path: str, address: str, port: int) -> str:
    request = b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton(address)
    answer = await _exchange(path, request + port.to_bytes(2, "big"), read=12)
    return answer.hex() if not answer.startswith(b"error") else answer.decode()


async def _spellings(path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for what, host in {**SPELLINGS, "control-denied": "denied.world.test"}.items():
        out[what] = {
            "connect": await _via_connect(path, f"{host}:{PORT}"),
            "plain": await _via_plain(path, f"{host}:{PORT}"),
            "socks": await _via_socks(path, host, PORT),
        }
    out["control-allowed"] = {"connect": await _via_connect(path, f"allowed.world.test:{PORT}")}
    return out


async def _dashboard(path: str) -> dict[str, str]:
    out = {what: await _via_connect(path, target) for what, target in FOUR_OH_FOUR_OH.items()}
    out["plain"] = await _via_plain(path, f"{SELF4}:4040")
    out["socks"] = await _socks_v4(path, SELF4, 4040)
    return out


async def _flood(path_a: str, path_b: str, holder: subprocess.Popen[str]) -> dict[str, Any]:
    """Idle connections to task A's proxy (from ``holder``, another process: its descriptors
    are not ours), then task B's request through B's proxy on the same loop."""
    assert holder.stdin is not None and holder.stdout is not None
    # B's client connects first: its own descriptor is the sandbox's in real life, not the
    # server's, so it must not be what the flood takes away here.
    opened = await asyncio.open_unix_connection(path_b)
    holder.stdin.write(path_a + "\n")
    holder.stdin.flush()
    held = await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 60)
    answer = await _via_connect(path_b, f"allowed.world.test:{PORT}", opened)
    return {"held": held.strip(), "b": answer}


_HOLDER = """
import socket, sys, time
path = sys.stdin.readline().strip()
held, last = [], time.monotonic()
while len(held) < int(sys.argv[1]) and time.monotonic() - last < 5:
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    try:
        s.connect(path)
    except BlockingIOError:  # the backlog is full: wait for the proxy to accept more
        s.close()
        time.sleep(0.01)
        continue
    held.append(s)
    last = time.monotonic()
print(len(held), flush=True)
time.sleep(120)
"""


async def _main(folder: Path, case: str, holder: subprocess.Popen[str] | None) -> dict[str, Any]:
    from fusion_oci.egress import EgressRules, Limits, start_proxy

    dns_log: list[str] = []
    http_log: list[str] = []
    threading.Thread(target=_serve_dns, args=(dns_log,), daemon=True).start()
    for address in (ALLOWED, DENIED):
        threading.Thread(target=_serve_http, args=(address, http_log), daemon=True).start()
    rules = EgressRules(
        allowed=("*.world.test", "127.0.0.0/8", "192.0.2.0/24", "2001:db8::/32"),
        denied=DENIED_NAMES,
        allow_addresses=("127.0.0.0/8",),
    )
    proxies = []
    for task in ("a", "b"):
        state = folder / task
        state.mkdir()
        proxies.append(
            await start_proxy(
                task_id=f"task-{task}",
                rules=rules,
                state_dir=state,
                audit=None,
                limits=Limits(handshake_timeout_s=60),
            )
        )
    a, b = (str(p.unix_socket) for p in proxies)
    try:
        if case == "spellings":
            out = await _spellings(a)
        elif case == "dashboard":
            out = await _dashboard(a)
        else:
            assert holder is not None
            out = await _flood(a, b, holder)
    finally:
        for proxy in proxies:
            await proxy.stop()
    return {"out": out, "dns": dns_log, "http": http_log}


def main() -> None:
    case = sys.argv[1]
    holder = None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _setup(folder)
        if case.startswith("flood-"):
            # Started before the limit below: its descriptors are the flood, not ours.
            holder = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, case.removeprefix("flood-")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            # Few descriptors, as a resident server near its limit: a hard limit too, so
            # nothing raises it back.
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        try:
            result = asyncio.run(_main(folder, case, holder))
        finally:
            if holder is not None:
                holder.kill()
                holder.wait()
    print("RESOLVER-WORLD " + json.dumps(result), flush=True)


def run_world(case: str, timeout_s: float = 120) -> dict[str, Any]:
    """Run :func:`main` for ``case`` in its namespaces (root); its JSON answer."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        ["unshare", "--mount", "--net", "--", sys.executable, "-m", __name__, case],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESOLVER-WORLD "):
            answer: dict[str, Any] = json.loads(line.removeprefix("RESOLVER-WORLD "))
            return answer
    raise AssertionError(f"the resolver world printed no answer: {done.stderr[-3000:]}")


if __name__ == "__main__":
    main()
