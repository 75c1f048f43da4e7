"""A hostile remote side of the worktree transfer, for the ``sync-*`` probes.

    python3 sync_hostile_remote.py REPO CTL

It is the real remote script (a push is taken honestly, so the remote has the host's objects
to build on), except at a pull: when ``CTL/raw`` exists its bytes are written instead of a
frame; when ``CTL/reply.json`` exists that meta and ``CTL/reply.pack`` are the answer. Each
control file is used once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fusion_oci/runtimes/kubernetes/sync"))

import remote  # the real script, by path: as the task image has it


def main() -> int:
    repo, ctl = sys.argv[1], Path(sys.argv[2])
    honest = remote.HANDLERS["pull"]

    def pull(r: remote.Repo, meta: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        raw = ctl / "raw"
        if raw.exists():
            data = raw.read_bytes()
            raw.unlink()
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
            sys.exit(0)  # a stream that sent garbage says nothing more
        crafted = ctl / "reply.json"
        if crafted.exists():
            import json

            reply = json.loads(crafted.read_text())
            pack = (ctl / "reply.pack").read_bytes()
            crafted.unlink()
            return reply, pack
        return honest(r, meta, payload)

    remote.HANDLERS["pull"] = pull
    return remote.serve(repo, sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    sys.exit(main())
