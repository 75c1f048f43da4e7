"""Nothing a command writes decides a later run's policy (issue #31, item 2), on every backend.

The built-in git/npm profile allows the registries the worktree's ``.npmrc``, ``.yarnrc.yml``
and ``yarn.lock`` name, and those are files a command writes. Here one command names a host
of the egress world that the policy does not list; the next command of the same task, and the
first command of the next task on that worktree, try to reach it through the proxy. The files
the host reads at prepare are also planted as a FIFO and a symlink: the next prepare must
neither hang nor follow them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.conftest import Prober, expected
from tests.security.egress_world import PORT, EgressWorld, egress_world, tagged_answer
from tests.security.test_egress import FILTERED
from tests.security.test_probes import assert_unenforced, check

PLAIN_JS = r"""
const net = require('net');
const [host, port] = process.argv.slice(1);
const proxy = (process.env.HTTP_PROXY || '').replace('http://', '').replace(/\/$/, '');
const i = proxy.lastIndexOf(':');
const say = v => { console.log('PIN-PROBE ' + JSON.stringify({answer: v})); process.exit(0); };
const s = net.connect({host: proxy.slice(0, i), port: +proxy.slice(i + 1)});
let buf = '';
s.on('connect', () => s.write(`GET http://${host}:${port}/ HTTP/1.1\r\n` +
  `Host: ${host}:${port}\r\nConnection: close\r\n\r\n`));
s.on('data', d => { buf += d; });
s.on('end', () => say(buf));
s.on('error', e => say(buf || 'error ' + e.code));
s.setTimeout(8000, () => say(buf || 'error timeout'));
"""

OK = "fusion-egress-ok"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EgressWorld]:
    with egress_world(tmp_path_factory.mktemp("pin-world")) as made:
        yield made


def _reach(prober: Prober, world: EgressWorld, task_id: str) -> str:
    result = prober.run(
        ["node", "-e", PLAIN_JS, "other.test", str(PORT)],
        world.policy(),
        task_id=task_id,
        timeout_ms=30_000,
    )
    return tagged_answer(result.stdout, "PIN-PROBE", "profile pin")["answer"]


def test_a_run_cannot_widen_the_allowlist_of_later_runs(prober: Prober, world: EgressWorld) -> None:
    policy = world.policy()
    if expected("profile-widening", prober.backend) == "unenforced":
        assert_unenforced("profile-widening", prober, policy, FILTERED)
        return
    prober.egress_names = world.names
    url = f"http://other.test:{PORT}/"
    write = (
        f"printf 'registry={url}\\n@evil:registry={url}\\n' > .npmrc; "
        f"printf 'npmRegistryServer: \"{url}\"\\n' > .yarnrc.yml; echo wrote"
    )
    first = prober.run(write, policy, task_id="pin-task-a")
    assert "wrote" in first.stdout, first
    try:
        same_task = _reach(prober, world, "pin-task-a")
        next_task = _reach(prober, world, "pin-task-b")
    finally:
        for name in (".npmrc", ".yarnrc.yml"):
            (prober.worktree / name).unlink(missing_ok=True)
    leaked = OK in same_task or OK in next_task
    check(
        "profile-widening",
        prober.backend,
        leaked,
        f"same task: {same_task[:200]!r}; next task: {next_task[:200]!r}",
    )
    if not leaked:
        assert same_task.startswith("HTTP/1.1 403") and "other.test" in same_task, same_task


@contextlib.contextmanager
def _unblocker(fifo: Path, after_s: float) -> Iterator[None]:
    """Opens the FIFO's write end after ``after_s`` (then closes it), so that a prepare
    blocked in reading it goes on: the old code hung there for good."""
    stop = threading.Event()

    def run() -> None:
        if stop.wait(after_s):
            return
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_files_read_at_prepare_cannot_stall_or_redirect_it(
    prober: Prober, world: EgressWorld
) -> None:
    policy = world.policy()
    if expected("prepare-input-planted", prober.backend) == "unenforced":
        assert_unenforced("prepare-input-planted", prober, policy, FILTERED)
        return
    prober.egress_names = world.names
    secret = prober.home / ".yarnrc-elsewhere.yml"
    secret.write_text(f'npmRegistryServer: "http://other.test:{PORT}"\n')
    plant = f"mkfifo .npmrc && ln -s {secret} .yarnrc.yml; ls -l .npmrc .yarnrc.yml"
    prober.run(plant, policy, task_id="plant-a")
    fifo = prober.worktree / ".npmrc"
    try:
        started = time.monotonic()
        with _unblocker(fifo, 12.0):
            answer = _reach(prober, world, "plant-b")
        took = time.monotonic() - started
    finally:
        for name in (".npmrc", ".yarnrc.yml"):
            (prober.worktree / name).unlink(missing_ok=True)
    stalled = took > 10.0
    check(
        "prepare-input-planted",
        prober.backend,
        stalled or OK in answer,
        f"prepare+run took {took:.1f} s; answer {answer[:200]!r}",
    )


def test_a_planted_symlink_brings_no_host_file_into_an_answer(prober: Prober) -> None:
    """The worktree's .nvmrc / .node-version / package.json choose an engine's image: planted
    as symlinks to a host file, the old code read it and quoted its first line in the
    prepare's error, which the agent reads."""
    from fusion_oci.errors import FusionOCIError

    canary = "CANARY-" + os.urandom(6).hex()
    secret = prober.home / ".ssh" / "id_ed25519"
    secret.write_text(canary + "\n")
    prober.run(
        f"ln -s {secret} .nvmrc; ln -s {secret} .node-version; echo planted",
        task_id="plant-c",
    )
    try:
        try:
            result = prober.run("true", task_id="plant-d")
            seen = result.stdout + result.stderr + " ".join(result.unenforced)
        except FusionOCIError as exc:
            seen = exc.render()
    finally:
        for name in (".nvmrc", ".node-version"):
            (prober.worktree / name).unlink(missing_ok=True)
    check("prepare-input-symlink", prober.backend, canary in seen, seen[-300:])
