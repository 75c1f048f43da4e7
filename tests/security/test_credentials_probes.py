"""Brokered credentials (issue #24) under attack, on every backend: one sandboxed command
pushes to a ref outside ``allowedRefs``, sends the sentinel where it must not go (another
header, the URL, the body, a credentialed host it is not for, an allowed host with no
credential), asks a host that echoes headers for the swapped value, and dumps what it can read
(environment, every process's /proc, git config, the CA bundle, its files). The host judges:
the server's repository and log (tests/security/credentials_world.py, a network namespace the
test makes) and the command's output. The real token must reach nothing but its hosts'
Authorization header.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import NetworkMode, PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox
from tests.backends import backend_settings
from tests.security.conftest import (
    CREDENTIAL_PROBES,
    REMOTE,
    ROOTLESS,
    Prober,
    expected,
    record,
)
from tests.security.credentials_probe import DUMP, PROBE_JS, judge, parse
from tests.security.credentials_world import CredentialsWorld, credentials_world
from tests.security.egress_world import resolving
from tests.security.test_probes import check

TOKEN = "ghp_" + secrets.token_hex(18)
FILTERED = "network filtered (egress only through the task's proxy)"


@pytest.fixture(scope="module")
def world() -> Iterator[CredentialsWorld]:
    # Under a 0755 folder: the rootless backends' user reads the test CA (the credentials'
    # caFile) from there.
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-cred-world-"))
    base.chmod(0o755)
    try:
        with credentials_world(base / "world", TOKEN) as made:
            yield made
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _command(backend: str) -> str:
    # A remote sandbox's repository is the worktree transfer's own: the host repository's
    # remotes are not carried there (docs/worktree-sync.md), so the push names the URL.
    origin = "https://git.test/repo.git" if backend in REMOTE else "origin"
    return (
        f"git -c user.name=t -c user.email=t@t commit -q --allow-empty -m probe; "
        f"git push {origin} HEAD:refs/heads/fusion/probe-{backend} 2>&1; echo PUSH-OK=$?; "
        f"git push {origin} HEAD:refs/heads/main 2>&1; echo PUSH-MAIN=$?; "
        "npm view private-pkg version --fetch-retries=0 2>&1; "
        f"node .credential-probe.js; {DUMP}"
    )


def _run(
    prober: Prober, world: CredentialsWorld, wt: Path, policy: SandboxPolicy, command: str
) -> RunResult:
    creds = SandboxSettings.model_validate({"credentials": world.credentials()}).credentials
    env = {**prober.env, "FUSION_TEST_TOKEN": TOKEN}
    project = prober.tmp / "project"  # outside the worktree, as landlock needs
    project.mkdir(exist_ok=True)
    ctx = PrepareContext(
        task_id="cred-probe",
        run_id="run",
        policy=policy,
        worktree_path=str(wt),
        project_dir=str(project),
    )
    opts = RunOptions(timeout_ms=180_000)
    if prober.rootless is not None:
        user = prober.rootless
        if prober.backend == ROOTLESS:
            settings = SandboxSettings(
                backend="podman", policy=policy, image=user.image, credentials=creds
            )
        else:
            settings = SandboxSettings(
                backend="docker",
                policy=policy,
                image=user.image,
                credentials=creds,
                **user.settings,
            )
        user.hand_over(prober.tmp)
        answer = user.drive(
            "probe",
            {
                "settings": settings.model_dump(mode="json", by_alias=True),
                "ctx": ctx.model_dump(mode="json", by_alias=True),
                "opts": opts.model_dump(mode="json", by_alias=True),
                "env": env,
                "cacheRoot": str(prober.tmp / "cache"),
                "command": command,
                "egressNames": world.names,
            },
            timeout=300,
        )
        if "refused" in answer:
            raise PolicyNotEnforceableError(settings.backend, answer["refused"])
        return RunResult.model_validate(answer["result"])
    settings = backend_settings(prober.backend, policy=policy, credentials=creds)
    with (
        resolving(world.names),
        SyncSandbox(settings, env=env, cache_root=prober.tmp / "cache") as sb,
    ):
        sb.prepare(ctx)
        return sb.run(command, opts)


def test_brokered_credentials_stay_on_the_host(
    prober: Prober, world: CredentialsWorld, linked_worktree: tuple[Path, Path]
) -> None:
    repo, wt = linked_worktree
    subprocess.run(
        ["git", "-C", str(repo), "remote", "add", "origin", "https://git.test/repo.git"],
        check=True,
        capture_output=True,
    )
    (wt / ".npmrc").write_text(
        "registry=https://registry.test/\n//registry.test/:_authToken=${NPM_TOKEN}\n"
    )
    (wt / ".credential-probe.js").write_text(PROBE_JS)
    policy = SandboxPolicy(network=NetworkMode.FILTERED, allowed_domains=world.allowed_domains)
    if expected(CREDENTIAL_PROBES[0], prober.backend) == "unenforced":
        # native: filtered is unenforced there, so is everything the proxy does; a sandbox
        # backend without the proxy (kubernetes) refuses the policy.
        if prober.backend == "native":
            result = _run(prober, world, wt, policy, "true")
            assert FILTERED in result.unenforced, result
        else:
            with pytest.raises(PolicyNotEnforceableError) as refused:
                _run(prober, world, wt, policy, "true")
            assert FILTERED in refused.value.unenforced, refused.value.render()
        for probe in CREDENTIAL_PROBES:
            assert expected(probe, prober.backend) == "unenforced", probe
            record(probe, prober.backend, "unenforced")
        return
    result = _run(prober, world, wt, policy, _command(prober.backend))
    out = result.stdout
    assert "PUSH-OK=0" in out, out[-3000:]
    assert world.ref(f"refs/heads/fusion/probe-{prober.backend}") is not None, out[-3000:]
    assert "4.2.0" in out, out[-3000:]  # npm view through the brokered _authToken
    answer = parse(out)
    assert '"private-pkg"' in answer["bearer"], answer["bearer"]
    verdicts = judge(answer, TOKEN)
    verdicts["credential-push-disallowed-ref"] = (
        world.ref("refs/heads/main") is not None
        or "PUSH-MAIN=0" in out
        or "outside allowedRefs" not in out,
        out[-2000:],
    )
    verdicts["credential-value-in-sandbox"] = (
        TOKEN in out + result.stderr or "fusion-sentinel-github_token-" not in out,
        "the dump: environment, /proc/*/environ and cmdline, git config, CA bundle, .npmrc",
    )
    far_side = [line for line in world.seen().splitlines() if TOKEN in line]
    verdicts["credential-value-elsewhere"] = (
        any(
            '"other.test"' in line or TOKEN in line.split('"line"')[1].split('"headers"')[0]
            for line in far_side
        ),
        "\n".join(far_side[-5:]),
    )
    # The far side too: the value never reached an endpoint outside the credential's scope.
    out_of_scope = [line for line in far_side if "/echo/headers" in line]
    if out_of_scope:
        verdicts["credential-out-of-scope-echo"] = (True, out_of_scope[-1])
    for probe in CREDENTIAL_PROBES:
        leaked, detail = verdicts[probe]
        check(probe, prober.backend, leaked, detail)


def test_the_credential_probe_sees_a_leak_where_there_is_one(
    world: CredentialsWorld, tmp_path: Path
) -> None:
    """Through a proxy with no credentials (every host tunnelled untouched), the same program
    is judged leaking: its sentinels pass to every header, URL and body."""
    import asyncio

    from fusion_oci.egress import EgressRules, start_proxy

    async def main() -> str:
        rules = EgressRules(
            allowed=tuple(world.allowed_domains[:3]),
            denied=(),
            allow_addresses=(world.allowed_domains[3],),
        )
        (tmp_path / "state").mkdir()
        proxy = await start_proxy(
            task_id="no-broker",
            rules=rules,
            state_dir=tmp_path / "state",
            audit=None,
            tcp=True,
            resolve_override=world.names,
        )
        url = f"http://127.0.0.1:{proxy.tcp_port}"
        env = {
            "PATH": "/usr/bin:/bin",
            "HTTPS_PROXY": url,
            "SSL_CERT_FILE": str(world.ca_file),
            "GITHUB_TOKEN": "fusion-sentinel-github_token-x",
            "NPM_TOKEN": TOKEN,
        }
        try:
            done = await asyncio.to_thread(
                subprocess.run,
                ["node", "-e", PROBE_JS],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            await proxy.stop()
        return done.stdout

    verdicts = judge(parse(asyncio.run(main())), TOKEN)
    for probe in (
        "credential-sentinel-other-header",
        "credential-sentinel-in-url",
        "credential-sentinel-in-body",
        "credential-sentinel-uncredentialed-host",
        "credential-echoed-value",
        "credential-sentinel-host-mismatch",
        "credential-sentinel-absolute-form",
        "credential-out-of-scope-echo",
        "credential-echo-encoded",
        "credential-plain-body",
        "credential-plain-pipelined",
    ):
        assert verdicts[probe][0], (probe, verdicts[probe][1])
