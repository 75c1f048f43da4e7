"""The store work of an unprivileged fusion-oci, run in a user namespace of its own.

Why: a blob must belong to a uid no task runs as (fusion_oci/store/linking.py), and an unprivileged
process cannot ``chown`` on the host: every file it makes is its own uid's, which is exactly
the task's on the rootless tiers, and the owner of an inode may ``chmod`` and rewrite it. A
caller with a subordinate range (``/etc/subuid``, ``/etc/subgid``) can do what ``podman
unshare`` does: a child unshares a user namespace (:data:`CLONE_NEWUSER`) and the setuid
helpers ``newuidmap``/``newgidmap``, run by the parent, map it ns 0 -> the caller and ns
:data:`NS_OWNER` -> one subordinate id (:attr:`StoreNamespace.subuid`). In there the child is
root over both: it can ``chown`` a blob to :data:`NS_OWNER` (the subordinate uid on the host)
and, holding ``CAP_FOWNER`` over it, hard-link it into the worktree, which
``fs.protected_hardlinks`` forbids the caller outside. The task runs as the caller without
capabilities and with ``no_new_privs``: it is neither the blob's owner nor capable over it, and
it cannot become so (a capability counts over an inode only in a namespace that maps the
inode's uid, a namespace it makes maps only its own uid, and ``no_new_privs`` makes the setuid
``newuidmap`` run without privilege).

The subordinate id is the *last* of the caller's range, not the first: the rootless engines map
the first one to a container's uid 1 (podman's default, a rootless dockerd) or to its root
(podman's ``keep-id``), which images run things as; the last is container uid 65536 there, which
none does.

A job (:func:`run_in_namespace`) is the pass or the placement of fusion_oci/store/tree.py, named
by ``op`` and given as JSON; the child (:func:`child`, a fresh interpreter: ``unshare`` needs a
single-threaded process) answers JSON on stdout. It runs in its own process group and is killed
with it past a timeout; the helpers are argv lists run through
:func:`fusion_oci.host.process.probe`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion_oci.host.process import probe, start_piped

CLONE_NEWUSER = 0x10000000
NS_OWNER = 1
"""The blobs' uid and gid inside the namespace (the subordinate id outside)."""
SUBUID = Path("/etc/subuid")
SUBGID = Path("/etc/subgid")
MAP_TIMEOUT_S = 10.0
"""Each of: the child's unshare, ``newuidmap``, ``newgidmap``."""
JOB_TIMEOUT_S = 600.0
"""A whole job (a pass is bounded in entries and bytes: store.py's ``MAX_PASS_*``)."""
MAX_ANSWER = 64 << 20
"""Most bytes of a child's answer read (a placement's ``known``: ~150 bytes a file)."""
UNSHARED = b"unshared\n"
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from fusion_oci.store.namespace import child; "
    "from fusion_oci.store.tree import namespace_job; "
    "child(namespace_job)"
)
"""The child's program: store_tree's jobs (named here as text: this module is below it)."""


class StoreNamespaceError(OSError):
    """The store namespace could not be made, or its job failed (an OSError: a pass that fails
    leaves the task's own copies, as any other pass failure does)."""


@dataclass(frozen=True)
class SubRange:
    """One line of ``/etc/subuid`` (or ``/etc/subgid``): ``count`` ids from ``start``."""

    start: int
    count: int

    @property
    def last(self) -> int:
        return self.start + self.count - 1


def subordinate_range(text: str, name: str, ident: int) -> SubRange | None:
    """The caller's first range in a subuid/subgid file (a line ``NAME:START:COUNT``, NAME the
    user's name or number), or None."""
    for line in text.splitlines():
        fields = line.strip().split(":")
        if len(fields) != 3 or fields[0] not in (name, str(ident)):
            continue
        try:
            start, count = int(fields[1]), int(fields[2])
        except ValueError:
            continue
        if start > 0 and count > 0:
            return SubRange(start, count)
    return None


@dataclass(frozen=True)
class StoreNamespace:
    """How to map a store namespace: the caller's ids (ns 0) and the subordinate ones that own
    the blobs (ns :data:`NS_OWNER`), and the setuid helpers that write the maps."""

    uid: int
    gid: int
    subuid: int
    subgid: int
    newuidmap: str = "newuidmap"
    newgidmap: str = "newgidmap"

    def map_argv(self, pid: int) -> list[list[str]]:
        """The helpers' argv for the child ``pid``: ``ns host count`` triples."""
        own, sub = str(NS_OWNER), "1"
        return [
            [self.newuidmap, str(pid), "0", str(self.uid), "1", own, str(self.subuid), sub],
            [self.newgidmap, str(pid), "0", str(self.gid), "1", own, str(self.subgid), sub],
        ]


def store_namespace(
    uid: int,
    gid: int,
    name: str,
    subuid: str,
    subgid: str,
    helpers: tuple[str | None, str | None],
) -> tuple[StoreNamespace | None, str]:
    """The caller's store namespace from its subuid/subgid files' text and the helpers' paths
    (None: not found), or None and why not."""
    newuidmap, newgidmap = helpers
    if newuidmap is None or newgidmap is None:
        return None, "newuidmap/newgidmap are not installed (the uidmap package)"
    uids = subordinate_range(subuid, name, uid)
    gids = subordinate_range(subgid, name, gid)
    if uids is None or gids is None:
        return None, f"{name} has no subordinate uid and gid range ({SUBUID}, {SUBGID})"
    if uids.start <= uid <= uids.last or gids.start <= gid <= gids.last:
        return None, f"{name}'s subordinate range holds its own uid or gid"
    return StoreNamespace(uid, gid, uids.last, gids.last, newuidmap, newgidmap), ""


def caller_namespace(uid: int) -> tuple[StoreNamespace | None, str]:
    """:func:`store_namespace` of this process's caller (``uid``), read from the system."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return None, f"uid {uid} has no name (no subordinate range can name it)"
    texts = []
    for path in (SUBUID, SUBGID):
        try:
            texts.append(path.read_text(errors="replace"))
        except OSError:
            texts.append("")
    helpers = (shutil.which("newuidmap"), shutil.which("newgidmap"))
    return store_namespace(uid, os.getgid(), entry.pw_name, texts[0], texts[1], helpers)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read(
    proc: subprocess.Popen[bytes], deadline: float, until: bytes | None
) -> tuple[bytes, bytes]:
    """The child's stdout up to ``until`` (None: its end), stderr drained alongside (its tail
    kept for the error); raises past ``deadline``."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreNamespaceError(
                    f"store namespace: no answer in time ({bytes(err[-500:])!r})"
                )
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    if key.fileobj is proc.stdout and until is not None:
                        raise StoreNamespaceError(
                            f"store namespace: the child did not unshare ({bytes(err[-500:])!r})"
                        )
                elif key.fileobj is proc.stderr:
                    err = (err + chunk)[-4096:]
                else:
                    out += chunk
                    if len(out) > MAX_ANSWER:
                        raise StoreNamespaceError("store namespace: answer too large")
                    if until is not None and out.endswith(until):
                        return bytes(out), bytes(err)
    return bytes(out), bytes(err)


def run_in_namespace(
    ns: StoreNamespace, job: dict[str, Any], *, timeout_s: float = JOB_TIMEOUT_S
) -> dict[str, Any]:
    """Run ``job`` (store_tree.py's ``namespace_job``) in a fresh store namespace; its JSON
    answer."""
    package = str(Path(__file__).resolve().parents[2])  # the folder that holds fusion_oci/
    proc = start_piped([sys.executable, "-I", "-c", _BOOT, package])
    assert proc.stdin is not None
    try:
        _read(proc, time.monotonic() + MAP_TIMEOUT_S, UNSHARED)
        for argv in ns.map_argv(proc.pid):
            mapped = probe(argv, timeout_s=MAP_TIMEOUT_S)
            if not mapped.ok:
                why = mapped.error or mapped.stderr.decode(errors="replace").strip()[-300:]
                raise StoreNamespaceError(f"{' '.join(argv)} failed: {why}")
        proc.stdin.write(json.dumps(job).encode() + b"\n")
        proc.stdin.close()
        out, err = _read(proc, time.monotonic() + timeout_s, None)
        code = proc.wait(MAP_TIMEOUT_S)
    except BaseException:
        _kill(proc)
        raise
    if code != 0:
        tail = err.decode(errors="replace").strip()[-500:]
        raise StoreNamespaceError(f"store namespace job {job.get('op')} exited {code}: {tail}")
    try:
        answer: dict[str, Any] = json.loads(out)
    except ValueError as exc:
        raise StoreNamespaceError(f"store namespace job {job.get('op')}: no answer") from exc
    return answer


def child(run: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The namespace's process: unshare, say so, wait for the maps (the job comes after
    them), check it is root over them, run the job, print its answer."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER) != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"unshare(CLONE_NEWUSER): {os.strerror(err)}\n")
        sys.exit(3)
    sys.stdout.buffer.write(UNSHARED)
    sys.stdout.buffer.flush()
    line = sys.stdin.buffer.readline()
    if not line:
        sys.exit(4)  # the parent gave up (a map failed)
    if os.getuid() != 0 or os.getgid() != 0:
        sys.stderr.write("not mapped: uid/gid are not 0 in the store namespace\n")
        sys.exit(5)
    sys.stdout.buffer.write(json.dumps(run(json.loads(line))).encode())
    sys.stdout.buffer.flush()
