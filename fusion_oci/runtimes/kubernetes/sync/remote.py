"""The remote side of the worktree transfer: a stdlib-only script that runs in the task image.

    python3 -S -E remote.py REPO        (or: python3 -S -E -c "$SOURCE" REPO)

It serves frames on stdin/stdout for as long as the stream stays open (one stream per task,
like the exec agent's), so a command costs one request and one reply per direction and no
interpreter start. The host trusts nothing this side sends (see the host module); this side
trusts the host, which chose what runs here.

Frames, both ways: ``FOSYNC1 <meta bytes> <payload bytes>\\n``, then a JSON object, then the
payload (a git pack, or nothing).

- ``push`` {branch, head, index, worktree, bringBack}: the host's state. The pack holds what
  this side lacks; the worktree becomes ``worktree`` (``read-tree --reset -u`` through a
  private index, so ignored files are left alone and only changed files are written), the
  index becomes ``index`` (stat data kept where the content matches), the branch ``head``.
- ``pull`` {branch, base: {head, index, worktree}, bringBack}: after a command. Snapshots the
  worktree (tracked and untracked, not ignored, plus ``bringBack``), the index and the branch,
  and answers with them and a thin pack of what the host lacks (the base is what it has).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

MAGIC = b"FOSYNC1"
MAX_HEAD = 64
"""Longest frame header line, newline included."""
MAX_META = 1 << 20
SYNC_INDEX = "fusion-sync.index"
"""The private index (in the git dir) that mirrors the worktree as last synced."""
GIT_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")


def frame(meta: dict[str, Any], payload: bytes = b"") -> bytes:
    """One frame: header line, JSON meta, payload."""
    body = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    return b"%s %d %d\n" % (MAGIC, len(body), len(payload)) + body + payload


def parse_head(line: bytes) -> tuple[int, int]:
    """The (meta, payload) lengths of a frame header line; ValueError when it is not one."""
    parts = line.rstrip(b"\n").split(b" ")
    if len(parts) != 3 or parts[0] != MAGIC or not line.endswith(b"\n"):
        raise ValueError(f"not a frame header: {line[:MAX_HEAD]!r}")
    sizes = []
    for part in parts[1:]:
        if not part.isdigit() or len(part) > 12:
            raise ValueError(f"bad frame size: {part[:16]!r}")
        sizes.append(int(part))
    return sizes[0], sizes[1]


class Failure(Exception):
    """A request this side could not carry out (sent back as ``{"ok": false}``)."""


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in GIT_ENV_KEEP}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(extra or {})
    return env


def git(
    repo: str, *args: str, stdin: bytes | None = None, index: str | None = None, check: bool = True
) -> bytes:
    argv = ["git", "-c", "core.hooksPath=/dev/null", "-c", "gc.auto=0", "-C", repo, *args]
    env = _env({"GIT_INDEX_FILE": index} if index else None)
    done = subprocess.run(argv, input=stdin, capture_output=True, env=env, check=False)
    if check and done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip()[-400:]
        raise Failure(f"git {args[0]} exited {done.returncode}: {tail}")
    return done.stdout if done.returncode == 0 else b""


def _start(repo: str, *args: str, index: str | None = None) -> subprocess.Popen[bytes]:
    argv = ["git", "-c", "core.hooksPath=/dev/null", "-C", repo, *args]
    env = _env({"GIT_INDEX_FILE": index} if index else None)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _finish(proc: subprocess.Popen[bytes], what: str, check: bool = True) -> str | None:
    out, err = proc.communicate()
    if proc.returncode != 0:
        if check:
            tail = err.decode(errors="replace").strip()[-400:]
            raise Failure(f"git {what} exited {proc.returncode}: {tail}")
        return None
    return out.decode().strip() or None


class Repo:
    """The task's repository on this side, made by the first push."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.git_dir = ""
        self.worktree: tuple[str, list[int] | None] = ("", None)
        """The worktree tree last written or read, and the private index's stamp then."""
        self.last: dict[str, Any] = {}
        """The state both sides had after the last exchange: what needs no rewrite."""

    def ensure(self, branch: str, object_format: str = "sha1") -> None:
        if not self.git_dir:
            if not (Path(self.path) / ".git").is_dir():
                Path(self.path).mkdir(parents=True, exist_ok=True)
                git(
                    self.path, "init", "-q", f"--initial-branch={branch}",
                    f"--object-format={object_format}",
                )  # fmt: skip
            self.git_dir = git(self.path, "rev-parse", "--absolute-git-dir").decode().strip()
        want = f"ref: refs/heads/{branch}\n"
        try:
            with (Path(self.git_dir) / "HEAD").open(encoding="utf-8") as fh:
                head = fh.read()
        except OSError:
            head = ""
        if head != want:
            git(self.path, "symbolic-ref", "HEAD", f"refs/heads/{branch}")

    @property
    def sync_index(self) -> str:
        return str(Path(self.git_dir) / SYNC_INDEX)

    def index_stamp(self) -> list[int] | None:
        return self.stamp(str(Path(self.git_dir) / "index"))

    @staticmethod
    def stamp(path: str) -> list[int] | None:
        try:
            st = Path(path).stat()
        except OSError:
            return None
        return [st.st_ino, st.st_size, st.st_mtime_ns]

    def loose_ref(self, branch: str) -> str | None:
        """The branch's commit from its loose ref file; None when it is packed or odd (then
        git answers). Only the host checks what this side says, so a shortcut is fine."""
        try:
            text = (Path(self.git_dir) / "refs" / "heads" / branch).read_text("ascii").strip()
        except (OSError, ValueError):
            return None
        return (
            text if len(text) in (40, 64) and all(c in "0123456789abcdef" for c in text) else None
        )

    def head_ref(self) -> str | None:
        try:
            with (Path(self.git_dir) / "HEAD").open(encoding="utf-8") as fh:
                text = fh.read(4096).strip()
        except OSError:
            return None
        return text.removeprefix("ref: ") if text.startswith("ref: ") else None


def set_config(repo: Repo, entries: list[tuple[str, str]]) -> None:
    """The host repository's remotes (the host chose them: sync/remotes.py), replacing what
    an earlier push set: a key may repeat (``fetch``), so each is unset, then added."""
    for key in dict.fromkeys(k for k, _ in entries):
        git(repo.path, "config", "--unset-all", key, check=False)
    for key, value in entries:
        git(repo.path, "config", "--add", key, value)


def push(repo: Repo, meta: dict[str, Any], pack: bytes) -> tuple[dict[str, Any], bytes]:
    branch = str(meta["branch"])
    repo.ensure(branch, str(meta.get("objectFormat") or "sha1"))
    if meta.get("config") is not None:
        set_config(repo, [(str(k), str(v)) for k, v in meta["config"]])
    if pack:
        git(repo.path, "index-pack", "--stdin", "--fix-thin", stdin=pack)
    # --reset -u through the private index: a one-way merge that stats every file it knows,
    # rewrites only those whose content changed, removes those gone, and never sees ignored
    # files (they are not in this index), so node_modules and build output stay.
    git(repo.path, "read-tree", "--reset", "-u", str(meta["worktree"]), index=repo.sync_index)
    repo.worktree = (str(meta["worktree"]), repo.stamp(repo.sync_index))
    for folder in meta.get("dirs") or []:
        # folders git does not carry (empty ones), named by the host, which checked them
        (Path(repo.path) / folder).mkdir(parents=True, exist_ok=True)
    index = meta.get("index")
    if index and index != repo.last.get("index"):
        # --reset without -u: stat data kept where the content is the same
        git(repo.path, "read-tree", "--reset", str(index))
    if meta.get("head") and meta["head"] != repo.last.get("head"):
        git(repo.path, "update-ref", f"refs/heads/{branch}", str(meta["head"]))
    repo.last = {"index": index, "head": meta.get("head"), "stamp": repo.index_stamp()}
    return {"ok": True}, b""


def _existing(root: str, paths: list[str]) -> list[str]:
    return [p for p in paths if (Path(root) / p).is_symlink() or (Path(root) / p).exists()]


def pull(repo: Repo, meta: dict[str, Any], _payload: bytes) -> tuple[dict[str, Any], bytes]:
    branch = str(meta["branch"])
    if not repo.git_dir:
        raise Failure("pull before the first push")
    # The three snapshots are independent: run them side by side, and skip the index's and
    # the branch's when their files say they did not change.
    stamp = repo.index_stamp()
    index_tree = None if stamp == repo.last.get("stamp") else _start(repo.path, "write-tree")
    loose = repo.loose_ref(branch)
    head = (
        None if loose else _start(repo.path, "rev-parse", "-q", "--verify", f"refs/heads/{branch}")
    )
    git(repo.path, "-c", "core.untrackedCache=true", "add", "-A", index=repo.sync_index)
    back = _existing(repo.path, [str(p) for p in meta.get("bringBack") or []])
    if back:
        git(repo.path, "add", "-A", "-f", "--", *back, index=repo.sync_index)
    # git rewrites an index only when something in it changed: the same file, the same tree.
    if repo.worktree[1] is not None and repo.stamp(repo.sync_index) == repo.worktree[1]:
        worktree = repo.worktree[0]
    else:
        worktree = git(repo.path, "write-tree", index=repo.sync_index).decode().strip()
        repo.worktree = (worktree, repo.stamp(repo.sync_index))
    state = {
        "worktree": worktree,
        "index": repo.last.get("index")
        if index_tree is None
        else _finish(index_tree, "write-tree", False),
        "head": loose or (_finish(head, "rev-parse", check=False) if head else None),
    }
    base = meta.get("base") or {}
    wanted = [v for k, v in state.items() if v and v != base.get(k)]
    have = [v for v in base.values() if v]
    payload = b""
    if wanted:
        revs = "".join(f"{v}\n" for v in wanted) + "".join(f"^{v}\n" for v in have)
        payload = git(
            repo.path, "pack-objects", "--revs", "--thin", "--stdout", "-q", stdin=revs.encode()
        )
    repo.last = {**state, "stamp": stamp}
    return {"ok": True, "headRef": repo.head_ref(), **state}, payload


HANDLERS = {"push": push, "pull": pull}


def _read_exact(src: IO[bytes], size: int) -> bytes:
    chunks = []
    while size:
        chunk = src.read(size)
        if not chunk:
            raise EOFError("stream ended inside a frame")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def serve(path: str, src: IO[bytes], dst: IO[bytes]) -> int:
    repo = Repo(path)
    while True:
        line = src.readline(MAX_HEAD)
        if not line:
            return 0
        meta_size, payload_size = parse_head(line)
        if meta_size > MAX_META:
            raise ValueError("meta too large")
        meta = json.loads(_read_exact(src, meta_size))
        payload = _read_exact(src, payload_size)
        handler = HANDLERS.get(str(meta.get("op")))
        try:
            if handler is None:
                raise Failure(f"unknown op {meta.get('op')!r}")
            reply, data = handler(repo, meta, payload)
        except Failure as exc:
            reply, data = {"ok": False, "error": str(exc)}, b""
        dst.write(frame(reply, data))
        dst.flush()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.stdin.buffer, sys.stdout.buffer))
