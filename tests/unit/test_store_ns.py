"""fusion_oci/store/namespace.py's pure parts: the subordinate range read from /etc/subuid's
text, the helpers' argv, why there is no namespace; and the blobs' owner threaded through a pass
(run as root, as the suite does: a pass chowns its blobs to the owner it is given)."""

from __future__ import annotations

from pathlib import Path

from fusion_oci.store.blobs import STORE_UID, link_support
from fusion_oci.store.linking import dedup
from fusion_oci.store.namespace import (
    NS_OWNER,
    StoreNamespace,
    SubRange,
    store_namespace,
    subordinate_range,
)
from fusion_oci.store.tree import task_linker
from tests.unit.test_store import PKG, install

SUBUID = """\
# a comment, then a malformed line and another user's range
garbage
other:200000:65536
fusionci:100000:65536
fusionci:300000:10
"""
HELPERS = ("/usr/bin/newuidmap", "/usr/bin/newgidmap")


def test_the_first_range_of_the_user_is_read_by_name_or_number() -> None:
    assert subordinate_range(SUBUID, "fusionci", 1001) == SubRange(100000, 65536)
    assert subordinate_range("1001:400000:2\n", "fusionci", 1001) == SubRange(400000, 2)
    assert subordinate_range(SUBUID, "nobody-here", 4242) is None
    assert subordinate_range("fusionci:x:1\nfusionci:5:0\n", "fusionci", 1001) is None
    assert SubRange(100000, 65536).last == 165535


def test_the_store_owner_is_the_last_subordinate_id() -> None:
    ns, why = store_namespace(1001, 1002, "fusionci", SUBUID, SUBUID, HELPERS)
    assert why == "" and ns == StoreNamespace(1001, 1002, 165535, 165535, *HELPERS)


def test_the_helpers_map_the_caller_to_0_and_the_owner_to_1() -> None:
    ns = StoreNamespace(1001, 1002, 165535, 165530, *HELPERS)
    assert ns.map_argv(4321) == [
        ["/usr/bin/newuidmap", "4321", "0", "1001", "1", "1", "165535", "1"],
        ["/usr/bin/newgidmap", "4321", "0", "1002", "1", "1", "165530", "1"],
    ]
    assert NS_OWNER == 1


def test_why_there_is_no_store_namespace() -> None:
    _, why = store_namespace(1001, 1001, "fusionci", SUBUID, SUBUID, (None, HELPERS[1]))
    assert "newuidmap/newgidmap are not installed" in why
    _, why = store_namespace(1001, 1001, "fusionci", SUBUID, "", HELPERS)
    assert "no subordinate uid and gid range" in why
    _, why = store_namespace(100005, 1001, "fusionci", SUBUID, SUBUID, HELPERS)
    assert "holds its own uid" in why


def test_an_unprivileged_caller_links_only_with_a_store_namespace(tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    wt.mkdir()
    ns = StoreNamespace(1001, 1001, 165535, 165535, *HELPERS)
    kw = {"blobs": str(tmp_path / "blobs"), "isolating": True, "worktree": wt}
    linker, why = task_linker(host_uid=1001, namespace=lambda uid: (ns, ""), **kw)  # type: ignore[arg-type]
    assert why.ok and linker is not None and linker.namespace == ns and linker.owner == 165535
    linker, why = task_linker(host_uid=1001, namespace=lambda uid: (None, "no range"), **kw)  # type: ignore[arg-type]
    assert linker is None and "unprivileged and no range" in why.reason
    # Root needs none (and is never asked for one).
    linker, why = task_linker(host_uid=0, namespace=lambda uid: (None, "asked"), **kw)  # type: ignore[arg-type]
    assert linker is not None and linker.namespace is None and linker.owner == STORE_UID
    assert link_support(
        host_uid=1001, isolating=True, worktree=wt, blobs=tmp_path / "b2", no_namespace=""
    ).ok


def test_a_pass_gives_its_blobs_the_owner_it_is_told(tmp_path: Path) -> None:
    a, b, blobs = tmp_path / "a", tmp_path / "b", tmp_path / "blobs"
    install(a, {"index.js": b"one"})
    install(b, {"index.js": b"one"})
    assert dedup(a, blobs, owner=NS_OWNER).linked == 1
    assert (a / PKG / "index.js").stat().st_uid == NS_OWNER
    assert dedup(a, blobs, owner=NS_OWNER).linked == 0  # its owner's: a blob already
    assert dedup(b, blobs, owner=NS_OWNER).adopted == 0
    assert (b / PKG / "index.js").samefile(a / PKG / "index.js")


def test_the_namespace_child_imports_nothing_beyond_the_standard_library() -> None:
    """The child's program runs where the package's dependencies may not be (an unprivileged
    caller's interpreter): its imports must not reach pydantic (models/). Moving stdin.py
    under models/ once made host/process.py pull it in, and rootless placement found nothing."""
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[2])
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from fusion_oci.store.namespace import child; "
        "from fusion_oci.store.tree import namespace_job; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'yaml')))"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-E", "-c", probe, root],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
