"""What of the host repository's config a pod's repository gets (sync/remotes.py)."""

from __future__ import annotations

import pytest

from fusion_oci.runtimes.kubernetes.sync.remotes import carried_config, network_url


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("https://github.com/acme/w.git", "https://github.com/acme/w.git"),
        ("https://x-access-token:ghp_abc@github.com/acme/w.git", "https://github.com/acme/w.git"),
        ("http://user@git.test:8080/r.git", "http://git.test:8080/r.git"),
        ("git@github.com:acme/w.git", "git@github.com:acme/w.git"),
        ("github.com:acme/w.git", "github.com:acme/w.git"),
        ("ssh://git@github.com/acme/w.git", "ssh://git@github.com/acme/w.git"),
        ("ssh://git:pw@github.com/acme/w.git", None),
        ("git://git.test/r.git", "git://git.test/r.git"),
        ("/srv/git/r.git", None),
        ("../r.git", None),
        ("file:///srv/git/r.git", None),
        ("ext::sh -c evil", None),
        ("https://git.test/r.git\nx", None),
        ("", None),
    ],
)
def test_network_urls(url: str, want: str | None) -> None:
    assert network_url(url) == want


def test_carried_config_keeps_remotes_and_the_task_branch_tracking() -> None:
    pairs = [
        ("core.hookspath", "/tmp/hooks"),
        ("remote.origin.url", "https://bot:tok@git.test/r.git"),
        ("remote.origin.fetch", "+refs/heads/*:refs/remotes/origin/*"),
        ("remote.origin.pushurl", "/srv/push.git"),
        ("remote.local.url", "/srv/r.git"),
        ("remote.local.fetch", "+refs/heads/*:refs/remotes/local/*"),
        ("remote.bad name.url", "https://git.test/r.git"),
        ("branch.task.remote", "origin"),
        ("branch.task.merge", "refs/heads/task"),
        ("branch.other.remote", "origin"),
        ("branch.task.remote", "local"),
        ("http.extraheader", "Authorization: Bearer tok"),
    ]
    assert carried_config(pairs, "task") == [
        ("remote.origin.url", "https://git.test/r.git"),
        ("remote.origin.fetch", "+refs/heads/*:refs/remotes/origin/*"),
        ("branch.task.remote", "origin"),
        ("branch.task.merge", "refs/heads/task"),
    ]
