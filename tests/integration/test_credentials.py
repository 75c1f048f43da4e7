"""Brokered credentials (issue #24) for real: the settings model, the proxy's swap on real
sockets, and a task on each isolating runtime that pushes to a git server and reads a private
registry with a token it never sees, in a network namespace the test creates
(tests/security/credentials_world.py; never the internet).

What is checked on the far side (the servers' log) and on the host (the audit file): the real
token reaches only its hosts, in the Authorization header; the sandbox's environment, /proc,
files and every output hold a sentinel at most; a sentinel sent anywhere else is refused with
a reason and leaves a ``sandbox:credential`` leak event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fusion_oci.audit import AuditLog, CredentialEvent, read_events
from fusion_oci.egress import EgressRules, start_proxy
from fusion_oci.egress.credentials import (
    Brokered,
    make_broker,
    push_repo,
    read_value,
    ref_allowed,
    repo_allowed,
    swap_authorization,
    write_bundle,
)
from fusion_oci.egress.mitm import Scanner, parse_commands, pkt_line, push_refusal
from fusion_oci.errors import SettingsError
from fusion_oci.models import NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.credentials import CredentialSpec
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings, require_runtime
from tests.integration import container_cases as cases
from tests.security.credentials_probe import DUMP, PROBE_JS, judge, parse, probe_command
from tests.security.credentials_world import CredentialsWorld, credentials_world
from tests.security.egress_world import resolving

TOKEN = "ghp_" + secrets.token_hex(18)
LONG = RunOptions(timeout_ms=180_000)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CredentialsWorld]:
    with credentials_world(tmp_path_factory.mktemp("cred-world"), TOKEN) as made:
        yield made


def _spec(**kw: Any) -> CredentialSpec:
    data = {"name": "GITHUB_TOKEN", "hosts": ["github.com"], "from": {"env": "GH"}, **kw}
    return CredentialSpec.model_validate(data)


# ------------------------------------------------------------------------- the model (pure)


def test_settings_name_credentials_by_reference_with_clear_errors() -> None:
    ok = SandboxSettings.model_validate(
        {
            "credentials": [
                {
                    "name": "GITHUB_TOKEN",
                    "hosts": ["GitHub.com", "api.github.com"],
                    "from": {"command": ["gh", "auth", "token"]},
                    "allowedRefs": ["refs/heads/fusion/*"],
                }
            ]
        }
    )
    assert ok.credentials[0].hosts == ["github.com", "api.github.com"]
    bad = [
        ({"from": {"env": "A", "file": "/x"}}, "exactly one of env, file or command"),
        ({"from": {"file": "rel/path"}}, "not an absolute path"),
        ({"hosts": ["https://github.com/"]}, "not a host name"),
        ({"hosts": ["*.github.com"]}, "not a host name"),
        ({"name": "GIT-TOKEN"}, "not an environment variable name"),
        ({"allowedRefs": ["main"]}, "not a full ref"),
    ]
    for override, words in bad:
        with pytest.raises(ValidationError, match=words):
            _spec(**override)
    with pytest.raises(ValidationError, match="named by both"):
        SandboxSettings.model_validate(
            {
                "credentials": [
                    {"name": "A", "hosts": ["h.test"], "from": {"env": "A"}},
                    {"name": "B", "hosts": ["h.test"], "from": {"env": "B"}},
                ]
            }
        )


def test_values_are_read_on_the_host_and_sentinels_are_per_task(tmp_path: Path) -> None:
    secret_file = tmp_path / "token"
    secret_file.write_text("from-file\n")
    env = {"GH": "from-env", "PATH": "/usr/bin:/bin"}
    assert asyncio.run(read_value(_spec(), env)) == "from-env"
    assert (
        asyncio.run(read_value(_spec(**{"from": {"file": str(secret_file)}}), env)) == "from-file"
    )
    assert (
        asyncio.run(read_value(_spec(**{"from": {"command": ["echo", "from-cmd"]}}), env))
        == "from-cmd"
    )
    for source, words in (
        ({"env": "UNSET"}, "UNSET is not set"),
        ({"file": str(tmp_path / "none")}, "No such file"),
        ({"command": ["false"]}, "exit status 1"),
        ({"command": ["/nonexistent/gh"]}, "cannot run it"),
    ):
        with pytest.raises(SettingsError, match=words) as info:
            asyncio.run(read_value(_spec(**{"from": source}), env))
        assert "sandbox.credentials GITHUB_TOKEN" in str(info.value)
    one = asyncio.run(make_broker([_spec()], env))
    two = asyncio.run(make_broker([_spec()], env))
    assert one.sentinels["GITHUB_TOKEN"] != two.sentinels["GITHUB_TOKEN"]
    assert "from-env" not in repr(one) and "from-env" not in one.sentinels["GITHUB_TOKEN"]
    assert one.ca_cert_pem != two.ca_cert_pem and b"PRIVATE" not in one.ca_cert_pem
    bundle = write_bundle(one, "/etc/ssl/certs/ca-certificates.crt", tmp_path)
    assert bundle.read_bytes().endswith(one.ca_cert_pem) and b"PRIVATE" not in bundle.read_bytes()


def test_the_swap_and_the_push_parser() -> None:
    cred = Brokered(_spec(), "REAL", "SENT")
    assert swap_authorization("Bearer SENT", cred) == "Bearer REAL"
    assert swap_authorization("token SENT", cred) == "token REAL"
    basic = "Basic " + base64.b64encode(b"x-access-token:SENT").decode()
    assert (
        swap_authorization(basic, cred)
        == "Basic " + base64.b64encode(b"x-access-token:REAL").decode()
    )
    assert swap_authorization("Bearer other", cred) is None
    scanner = Scanner([b"SENT"])
    safe, found = scanner.feed(b"abcSE")
    assert (safe, found) == (b"ab", None)
    assert scanner.feed(b"NTxyz")[1] == b"SENT"
    body = (
        pkt_line(b"0" * 40 + b" " + b"1" * 40 + b" refs/heads/main\0report-status side-band-64k\n")
        + pkt_line(b"0" * 40 + b" " + b"2" * 40 + b" refs/heads/fusion/x\n")
        + b"0000PACK"
    )
    refs, caps, complete = parse_commands(body)
    assert refs == ["refs/heads/main", "refs/heads/fusion/x"] and complete
    assert "side-band-64k" in caps
    assert ref_allowed("refs/heads/fusion/x", ["refs/heads/fusion/*"])
    assert not ref_allowed("refs/heads/main", ["refs/heads/fusion/*"])
    assert ref_allowed("refs/heads/main", None) and not ref_allowed("refs/heads/x", [])
    with pytest.raises(SettingsError, match="control character"):
        asyncio.run(make_broker([_spec(**{"from": {"env": "T"}})], {"T": "a\r\nX-Evil: 1"}))
    assert push_repo("/acme/widget.git/git-receive-pack") == "acme/widget"
    assert repo_allowed("acme/widget", ["acme/*"]) and repo_allowed("x", None)
    assert repo_allowed("acme/widget", ["/acme/widget.git"])
    assert not repo_allowed("evil/widget", ["acme/*"])
    assert b"ng refs/heads/main why" in push_refusal(refs, ["refs/heads/main"], set(), "why")


# ---------------------------------------------------------------- the proxy on real sockets


def _git(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=90,
        env=env or {"PATH": "/usr/bin:/bin", "HOME": str(cwd)},
    )


def test_the_proxy_swaps_only_in_authorization_of_the_credentials_hosts(
    world: CredentialsWorld, tmp_path: Path
) -> None:
    """On the host, no sandbox: curl and git through the proxy with the per-task bundle."""
    audit_path = tmp_path / "audit.jsonl"

    async def main() -> dict[str, subprocess.CompletedProcess[str]]:
        specs = [CredentialSpec.model_validate(c) for c in world.credentials()]
        broker = await make_broker(specs, {"FUSION_TEST_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"})
        rules = EgressRules(
            allowed=tuple(world.allowed_domains[:3]),
            denied=(),
            allow_addresses=(world.allowed_domains[3],),
        )
        state = tmp_path / "state"
        state.mkdir()
        proxy = await start_proxy(
            task_id="t-proxy",
            rules=rules,
            state_dir=state,
            audit=AuditLog(audit_path, key=b""),
            tcp=True,
            resolve_override=world.names,
            broker=broker,
        )
        bundle = write_bundle(broker, "/etc/ssl/certs/ca-certificates.crt", tmp_path)
        url = f"http://127.0.0.1:{proxy.tcp_port}"
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "HTTPS_PROXY": url,
            "http_proxy": url,
            "NO_PROXY": "",
            "GIT_SSL_CAINFO": str(bundle),
            **broker.sentinels,
        }
        wt = tmp_path / "wt"
        _git(tmp_path, "init", "-q", "-b", "main", str(wt))
        _git(
            wt,
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "one",
        )
        helper = (
            '!f() { test "$1" = get && echo username=x-access-token && '
            'echo "password=$GITHUB_TOKEN"; }; f'
        )
        push = [
            "-c",
            f"credential.https://git.test.helper={helper}",
            "push",
            "https://git.test/repo.git",
        ]
        curl = ["curl", "-sS", "--cacert", str(bundle)]
        out = {}
        upload = tmp_path / "upload.bin"
        upload.write_bytes(b"x" * (2 << 20))  # curl sends Expect: 100-continue over 1 MiB
        try:
            for key, argv in (
                (
                    "post_big",
                    [
                        *curl,
                        "-H",
                        f"Authorization: Bearer {broker.sentinels['NPM_TOKEN']}",
                        "--data-binary",
                        f"@{upload}",
                        "-w",
                        "took=%{time_total}\n",
                        # a POST in the credential's (default) scope: npm's audit
                        "https://registry.test/-/npm/v1/security/advisories/bulk",
                    ],
                ),
                (
                    "bearer",
                    [
                        *curl,
                        "-H",
                        f"Authorization: Bearer {broker.sentinels['NPM_TOKEN']}",
                        "https://registry.test/private-pkg",
                    ],
                ),
                # a host that encodes whatever was asked: decoded for the scan, sent decoded;
                # an encoding the scan cannot read: refused
                (
                    "gzip",
                    [
                        *curl,
                        "--compressed",
                        "-H",
                        f"Authorization: Bearer {broker.sentinels['NPM_TOKEN']}",
                        "https://registry.test/gz-pkg",
                        "https://registry.test/br-pkg",
                    ],
                ),
                # keep-alive: two requests on one intercepted connection
                (
                    "twice",
                    [
                        *curl,
                        "-w",
                        "connects=%{num_connects}\n",
                        "-H",
                        f"Authorization: Bearer {broker.sentinels['NPM_TOKEN']}",
                        "https://registry.test/a",
                        "https://registry.test/b",
                    ],
                ),
                (
                    "header",
                    [
                        *curl,
                        "-H",
                        f"X-Key: {broker.sentinels['NPM_TOKEN']}",
                        "https://registry.test/private-pkg",
                    ],
                ),
                # plain HTTP on a task with credentials: read request by request, bodies
                # scanned as they stream (Expect answered by the proxy, chunked kept)
                (
                    "plain_post",
                    [
                        "curl",
                        "-sS",
                        "--data-binary",
                        f"@{upload}",
                        "-w",
                        "took=%{time_total}\n",
                        "http://other.test:8080/",
                    ],
                ),
                (
                    "plain_chunked",
                    [
                        "curl",
                        "-sS",
                        "-H",
                        "Transfer-Encoding: chunked",
                        "--data-binary",
                        f"@{upload}",
                        "http://other.test:8080/",
                    ],
                ),
                (
                    "uncredentialed",
                    [
                        "curl",
                        "-sS",
                        "-H",
                        f"Authorization: Bearer {broker.sentinels['GITHUB_TOKEN']}",
                        "http://other.test:8080/",
                    ],
                ),
            ):
                out[key] = await asyncio.to_thread(
                    subprocess.run, argv, capture_output=True, text=True, timeout=60, env=env
                )
            out["push_ok"] = await asyncio.to_thread(
                _git, wt, *push, "HEAD:refs/heads/fusion/proxy", env=env
            )
            out["push_main"] = await asyncio.to_thread(
                _git, wt, *push, "HEAD:refs/heads/main", env=env
            )
            out["push_repo"] = await asyncio.to_thread(
                _git,
                wt,
                *push[:-1],
                "https://git.test/other.git",
                "HEAD:refs/heads/fusion/x",
                env=env,
            )
            # A pack over git's 1 MiB post buffer: a chunked request body, streamed and
            # scanned; then fetched back (a large response through the interception).
            (wt / "big.bin").write_bytes(secrets.token_bytes(3 << 20))
            _git(wt, "add", "big.bin")
            _git(wt, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "big")
            out["push_big"] = await asyncio.to_thread(
                _git, wt, *push, "HEAD:refs/heads/fusion/big", env=env
            )
            out["clone"] = await asyncio.to_thread(
                _git,
                tmp_path,
                "-c",
                f"credential.https://git.test.helper={helper}",
                "clone",
                "-q",
                "-b",
                "fusion/big",
                "https://git.test/repo.git",
                str(tmp_path / "back"),
                env=env,
            )
        finally:
            await proxy.stop()
        return out

    out = asyncio.run(main())
    assert '"private-pkg"' in out["bearer"].stdout, out["bearer"]
    assert '"dist-tags"' in out["post_big"].stdout, out["post_big"]
    # the proxy answers the 100-continue itself: no 1 s wait of curl's for it
    assert float(out["post_big"].stdout.rpartition("took=")[2]) < 0.9, out["post_big"].stdout
    assert out["twice"].stdout.count('"dist-tags"') == 2, out["twice"]
    assert '"dist-tags"' in out["gzip"].stdout, out["gzip"]
    assert "Content-Encoding br, which the response scan cannot read" in out["gzip"].stdout
    asked = [json.loads(line) for line in world.seen().splitlines() if "gz-pkg" in line]
    assert asked and asked[-1]["headers"]["Accept-Encoding"] == "identity", asked
    assert "connects=1" in out["twice"].stdout and "connects=0" in out["twice"].stdout
    assert "the sentinel of NPM_TOKEN in the X-Key header" in out["header"].stdout
    assert "other-ok" in out["plain_post"].stdout, out["plain_post"]
    assert float(out["plain_post"].stdout.rpartition("took=")[2]) < 0.9, out["plain_post"].stdout
    assert "other-ok" in out["plain_chunked"].stdout, out["plain_chunked"]
    posted = [json.loads(line) for line in world.seen().splitlines() if '"POST / ' in line]
    assert len(posted) >= 2 and all(len(p["body"]) == 4096 for p in posted), posted[-1:]
    assert "sentinel of GITHUB_TOKEN" in out["uncredentialed"].stdout
    assert out["push_ok"].returncode == 0, out["push_ok"].stderr
    assert world.ref("refs/heads/fusion/proxy") is not None
    assert out["push_main"].returncode != 0 and world.ref("refs/heads/main") is None
    assert (
        "[remote rejected] HEAD -> main (fusion-oci: refs/heads/main is outside "
        "allowedRefs of GITHUB_TOKEN" in out["push_main"].stderr
    )
    assert (
        out["push_repo"].returncode != 0
        and subprocess.run(
            [
                "git",
                "-C",
                str(world.repo / "other.git"),
                "rev-parse",
                "-q",
                "--verify",
                "refs/heads/fusion/x",
            ],
            capture_output=True,
        ).returncode
        != 0
    )
    assert (
        "git.test/other is outside allowedRepos of GITHUB_TOKEN (repo)" in out["push_repo"].stderr
    ), out["push_repo"].stderr
    assert out["push_big"].returncode == 0, out["push_big"].stderr
    assert out["clone"].returncode == 0, out["clone"].stderr
    assert (tmp_path / "back" / "big.bin").read_bytes() == (
        tmp_path / "wt" / "big.bin"
    ).read_bytes()
    events = [e for e in read_events(audit_path) if e.type == "sandbox:credential"]
    assert any(
        e.allowed and e.details and e.details["swapped"] and e.host == "registry.test"
        for e in events
    )
    leaks = [e for e in events if e.details and e.details.get("leak")]
    assert {e.host for e in leaks} >= {"registry.test", "other.test"}
    assert TOKEN not in audit_path.read_text()
    assert TOKEN not in json.dumps({k: [v.stdout, v.stderr] for k, v in out.items()})


# ----------------------------------------------------------------- a task on each runtime

RUNTIMES = {
    "bubblewrap": [pytest.mark.bubblewrap],
    "landlock": [pytest.mark.landlock],
    "oci": [pytest.mark.oci],
    "oci-runsc": [pytest.mark.oci, pytest.mark.runsc],
    "podman": [pytest.mark.podman],
    "docker": [pytest.mark.docker],
    "kubernetes": [pytest.mark.kubernetes],
}
ENGINES = ("podman", "docker")


def _settings(runtime: str, world: CredentialsWorld) -> tuple[SandboxSettings, str | None]:
    """The runtime's settings with the world's credentials, and its image (None: the host's
    system directories)."""
    creds = SandboxSettings.model_validate({"credentials": world.credentials()}).credentials
    if runtime not in ENGINES:
        require_runtime(runtime)
        return backend_settings(runtime, credentials=creds), None
    from tests.integration.images_fixture import ensure_node_image

    base = cases.require_engine(runtime)
    return base.model_copy(update={"credentials": creds}), ensure_node_image(runtime).ref


def _linked_worktree(base: Path) -> Path:
    repo, wt = base / "repo", base / "wt-task"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(base)}
    for args in (
        ["init", "-q", "-b", "main", str(repo)],
        [
            "-C",
            str(repo),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "init",
        ],
        ["-C", str(repo), "worktree", "add", "-q", "-b", "task", str(wt)],
        # an ssh remote: git's insteadOf (from the sandbox's env) takes it to https
        ["-C", str(repo), "remote", "add", "origin", "git@git.test:repo.git"],
    ):
        subprocess.run(["git", *args], check=True, capture_output=True, env=env, timeout=60)
    (wt / ".credential-probe.js").write_text(PROBE_JS)
    (wt / ".npmrc").write_text(
        "registry=https://registry.test/\n//registry.test/:_authToken=${NPM_TOKEN}\n"
    )
    return wt


@pytest.mark.parametrize("runtime", [pytest.param(r, marks=m) for r, m in RUNTIMES.items()])
def test_a_task_pushes_and_installs_with_a_token_it_never_sees(
    runtime: str, world: CredentialsWorld, tmp_path: Path
) -> None:
    settings, image = _settings(runtime, world)
    wt = _linked_worktree(tmp_path)
    project = tmp_path / "project"  # outside the worktree, as landlock needs
    project.mkdir()
    audit_path = tmp_path / "audit.jsonl"
    policy = SandboxPolicy(network=NetworkMode.FILTERED, allowed_domains=world.allowed_domains)
    ctx = PrepareContext(
        task_id=f"cred-{runtime}",
        run_id="r1",
        worktree_path=str(wt),
        policy=policy,
        image=image,
        project_dir=str(project),
    )
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "FUSION_TEST_TOKEN": TOKEN,
    }
    commit = "git -c user.name=t -c user.email=t@t commit -q --allow-empty -m task"
    # `origin` everywhere: a pod's repository gets the host repository's network remotes
    # (docs/worktree-sync.md)
    origin = "origin"
    commands = {
        "push_ok": f"{commit} && git push {origin} HEAD:refs/heads/fusion/{runtime}",
        "push_main": f"git push {origin} HEAD:refs/heads/main",
        "npm": "npm view private-pkg version --fetch-retries=0",
        "probe": probe_command(),
        "dump": DUMP,
        # core_pattern is "core" here: the dump lands in the worktree, which is scanned below
        # (a command of a hardened owner has a hard core limit of 0, fusion_oci/host/hardening.py:
        # no dump at all; an engine's daemon starts its commands with its own limits)
        "core": "echo hard=$(ulimit -H -c); ulimit -c unlimited; "
        "PROBE_ABORT=1 node .credential-probe.js; ls core*",
    }
    if runtime == "kubernetes":
        # A dump in a pod is written on its node and would come back as a worktree file of
        # hundreds of MB, which the transfer refuses (maxTransferMb); the value never enters
        # the pod (the dump and probe steps check that), so there is nothing to scan for.
        del commands["core"]

    async def main() -> dict[str, Any]:
        results = {}
        with resolving(world.names):
            async with Sandbox(
                settings,
                env=env,
                cache_root=tmp_path / "cache",
                audit=AuditLog(audit_path, key=b""),
            ) as sb:
                await sb.prepare(ctx)
                for key, command in commands.items():
                    results[key] = await sb.run(command, LONG)
        return results

    results = asyncio.run(main())
    push_ok, push_main, npm = results["push_ok"], results["push_main"], results["npm"]
    assert push_ok.exit_code == 0, push_ok.stderr[-2000:]
    assert world.ref(f"refs/heads/fusion/{runtime}") is not None
    assert push_main.exit_code != 0 and world.ref("refs/heads/main") is None
    assert "outside allowedRefs of GITHUB_TOKEN" in push_main.stderr, push_main.stderr
    assert npm.exit_code == 0 and npm.stdout.strip() == "4.2.0", npm.stderr[-2000:]
    answer = parse(results["probe"].stdout)
    assert '"private-pkg"' in answer["bearer"], answer["bearer"]
    for probe, (leaked, detail) in judge(answer, TOKEN).items():
        assert not leaked, (probe, detail)
    # Where the kernel wrote one (not under gVisor, which writes none): a real dump of a
    # process that used the sentinels, scanned for the token with every other file below.
    cores = list(wt.glob("core*"))
    no_core_allowed = "core" not in results or "hard=0\n" in results["core"].stdout
    assert cores or runtime == "oci-runsc" or no_core_allowed, results.get("core")
    assert all(b"fusion-sentinel-" in c.read_bytes() for c in cores)
    dump = results["dump"].stdout
    assert "fusion-sentinel-github_token-" in dump  # the variable is there, with a sentinel
    for key, result in results.items():
        assert TOKEN not in result.stdout + result.stderr, key
    assert not [
        p
        for p in tmp_path.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and TOKEN.encode() in p.read_bytes()
        and p.parent != world.repo
    ], "the token was written to a file"
    audit_text = audit_path.read_text()
    assert TOKEN not in audit_text
    events = [e for e in read_events(audit_path) if e.type == "sandbox:credential"]
    assert any(e.allowed and e.host == "git.test" for e in events)
    assert any(e.allowed and e.host == "registry.test" for e in events)
    leaks = {e.reason for e in events if e.details and e.details.get("leak")}
    assert any("X-Api-Key" in (r or "") for r in leaks), leaks
    assert any("request body" in (r or "") for r in leaks), leaks
    assert any("echoed the credential" in (e.reason or "") for e in events)
    # issue #31: another origin is a leak attempt; outside the scope, a refusal
    assert any("request for another origin" in (r or "") for r in leaks), leaks
    assert any("in a plain HTTP request" in (r or "") for r in leaks), leaks
    assert any("pipelined" in (r or "") for r in leaks), leaks
    assert any(
        "outside the scope of NPM_TOKEN" in (e.reason or "") and not e.allowed for e in events
    )
    assert any(
        "other.test" in (e.host or "") for e in events if e.details and e.details.get("leak")
    )
    # On the far side: the real token only in an Authorization header of its hosts.
    for line in world.seen().splitlines():
        request = json.loads(line)
        if TOKEN in line:
            assert request["host"] in ("git.test", "registry.test"), line
            assert TOKEN not in request["line"] + request["body"], line


def test_the_summary_lists_swaps_and_refusals_by_name() -> None:
    from fusion_oci.audit import AuditEvent
    from fusion_oci.dashboard.summary import SummaryBuilder

    def event(host: str, allowed: bool, **details: Any) -> AuditEvent:
        return CredentialEvent(
            task_id="t1",
            run_id="r",
            backend="bwrap",
            host=host,
            port=443,
            allowed=allowed,
            rule="sandbox.credentials GITHUB_TOKEN",
            reason=None
            if allowed
            else "leak attempt: the sentinel of GITHUB_TOKEN in the X-Key header",
            details={"credential": "GITHUB_TOKEN", **details},
        )

    builder = SummaryBuilder()
    for i, e in enumerate(
        [
            event("git.test", True, swapped=True),
            event("git.test", True, swapped=True),
            event("git.test", True, swapped=False),
            event("git.test", False, leak=True),
        ],
        start=1,
    ):
        builder.add(i, e)
    out = builder.result()["credentials"]
    assert (out["total"], out["swaps"], out["leakAttempts"]) == (4, 2, 1)
    assert out["byTask"] == [
        {"taskId": "t1", "host": "git.test", "credential": "GITHUB_TOKEN", "swaps": 2}
    ]
    assert out["recentRefused"][0]["reason"].startswith("leak attempt")
    assert SummaryBuilder().result()["credentials"]["byTask"] == []
    import io

    from rich.console import Console

    from fusion_oci.cli.audit import render_credentials

    text = io.StringIO()
    render_credentials(builder.result(), Console(file=text, width=200))
    assert "2 swapped, 1 leak" in text.getvalue()
    assert "GITHUB_TOKEN in the X-Key header" in text.getvalue()


def test_the_real_host_is_verified_against_the_machines_trust_store(
    world: CredentialsWorld, tmp_path: Path
) -> None:
    """Without the credential's caFile, the test CA is not trusted: the proxy refuses to send
    the value to a host it cannot verify, and says why."""
    spec = CredentialSpec.model_validate(
        {"name": "OTHER_TOKEN", "hosts": ["other.test"], "from": {"env": "T"}}
    )

    async def main() -> subprocess.CompletedProcess[str]:
        broker = await make_broker([spec], {"T": TOKEN})
        rules = EgressRules(
            allowed=("other.test",), denied=(), allow_addresses=(world.allowed_domains[3],)
        )
        (tmp_path / "state").mkdir()
        proxy = await start_proxy(
            task_id="t-verify",
            rules=rules,
            state_dir=tmp_path / "state",
            audit=None,
            tcp=True,
            resolve_override=world.names,
            broker=broker,
        )
        bundle = write_bundle(broker, None, tmp_path)
        try:
            return await asyncio.to_thread(
                subprocess.run,
                [
                    "curl",
                    "-sS",
                    "--cacert",
                    str(bundle),
                    "-H",
                    f"Authorization: Bearer {broker.sentinels['OTHER_TOKEN']}",
                    "https://other.test/",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                env={"PATH": "/usr/bin:/bin", "HTTPS_PROXY": f"http://127.0.0.1:{proxy.tcp_port}"},
            )
        finally:
            await proxy.stop()

    done = asyncio.run(main())
    assert "other-ok" not in done.stdout
    assert (
        "TLS to other.test failed" in done.stdout and "CERTIFICATE_VERIFY_FAILED" in done.stdout
    ), done


def test_the_sandbox_env_holds_sentinels_and_gits_helper() -> None:
    """Pure: the spec's environment with brokered credentials (oci/spec.py credential_env)."""
    from fusion_oci.oci.environment import sandbox_env
    from fusion_oci.policy.layout import CA_IN_SANDBOX, TaskLayout

    layout = TaskLayout(
        "/srv/wt",
        None,
        (),
        "/tmp/egress/ca-bundle.pem",
        sentinels=(("GITHUB_TOKEN", "fusion-sentinel-x"),),
        git_credentials=(("github.com", "x-access-token", "GITHUB_TOKEN"),),
    )
    policy = SandboxPolicy(network=NetworkMode.FILTERED, env_allowlist=["GITHUB_TOKEN"])
    env = sandbox_env(policy, layout, {"GITHUB_TOKEN": "the-real-one"})
    assert env["GITHUB_TOKEN"] == "fusion-sentinel-x"  # the allowlist cannot pass the value
    assert "the-real-one" not in json.dumps(env)
    assert env["SSL_CERT_FILE"] == CA_IN_SANDBOX and env["GIT_CONFIG_COUNT"] == "3"
    config = {env[f"GIT_CONFIG_VALUE_{i}"]: env[f"GIT_CONFIG_KEY_{i}"] for i in range(3)}
    assert config["git@github.com:"] == "url.https://github.com/.insteadOf"
    assert config["ssh://git@github.com/"] == "url.https://github.com/.insteadOf"
    helper = env["GIT_CONFIG_VALUE_0"]
    assert env["GIT_CONFIG_KEY_0"] == "credential.https://github.com.helper"
    assert helper.startswith("!f()") and '"password=$GITHUB_TOKEN"' in helper
    plain = sandbox_env(policy, TaskLayout("/srv/wt", None, (), None), {})
    assert not any(k.startswith("GIT_CONFIG") for k in plain)
