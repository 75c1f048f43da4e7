"""Export writers are pure: what a format cannot express is in the file's header comment."""

from __future__ import annotations

import json

import pytest
import yaml

from fusion_oci.export import EXPORT_FORMATS, Mount, export_run, podman_argv, read_spec


def _spec() -> dict:
    return {
        "ociVersion": "1.0.2",
        "process": {
            "args": ["/bin/sh", "-c", "echo $HOME"],
            "cwd": "/w",
            "env": ["PATH=/bin", "TOKEN"],
            "user": {"uid": 1000, "gid": 1000},
            "rlimits": [{"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 1024}],
            "noNewPrivileges": True,
            "capabilities": {"bounding": []},
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "fusion-sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": []},
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["size=64m", "mode=1777"],
            },
            {
                "destination": "/home/sandbox",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["mode=700", "uid=1000", "gid=1000"],
            },
            {"destination": "/w", "type": "bind", "source": "/w", "options": ["rbind", "rw"]},
        ],
        "linux": {
            # a network namespace: the annotation's egress is read only with one (TaskSpec)
            "namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "network"}],
            "resources": {
                "memory": {"limit": 256 * 1024 * 1024},
                "pids": {"limit": 100},
                "cpu": {"quota": 50000, "period": 100000},
            },
            "maskedPaths": ["/proc/kcore"],
            "readonlyPaths": ["/proc/sys"],
            "seccomp": {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []},
        },
        "annotations": {"io.fusion-oci.network": "egress", "io.fusion-oci.task-id": "t"},
    }


def _src():
    return read_spec(
        _spec(),
        name="fusion-oci-t",
        image="localhost/i:1",
        image_digest="sha256:ab",
        system_dests=["/usr"],
        env_names=["TOKEN"],
    )


def test_read_spec() -> None:
    src = _src()
    assert [m.target for m in src.mounts] == ["/tmp", "/home/sandbox", "/w"]
    assert src.env == {"PATH": "/bin", "TOKEN": None}
    assert (src.memory_bytes, src.pids, src.cpus, src.network) == (256 << 20, 100, 0.5, "egress")
    assert src.mounts[0] == Mount("/tmp", "tmpfs", size="64m", mode="1777")


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_unexpressed_items_are_in_the_header(fmt: str) -> None:
    text, missing = export_run(_src(), fmt)
    assert missing
    for item in missing:
        assert item in text
    assert any("loopback" in m for m in missing) or fmt == "script"
    assert any("owner 1000:1000" in m for m in missing)


def test_compose_keeps_dollars_for_the_command() -> None:
    text, _ = export_run(_src(), "compose")
    service = yaml.safe_load(text)["services"]["task"]
    assert service["command"] == ["/bin/sh", "-c", "echo $$HOME"]
    assert "TOKEN" in service["environment"]
    assert service["pids_limit"] == 100 and service["mem_limit"] == 256 << 20


def test_kube_docs() -> None:
    text, _ = export_run(_src(), "kube")
    pod, policy = list(yaml.safe_load_all(text))
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"memory": "256Mi", "cpu": "500m"}
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["spec"]["volumes"][0] == {
        "name": "v0",
        "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"},
    }
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["egress"]


def test_podman_argv_golden() -> None:
    argv = podman_argv(_src(), "/p.json")
    assert argv[:9] == [
        "podman",
        "run",
        "--rm",
        "-i",
        "--user",
        "1000:1000",
        "--workdir",
        "/w",
        "--cap-drop=ALL",
    ]
    assert "--network=slirp4netns:allow_host_loopback=false" in argv
    assert "--tmpfs=/home/sandbox:rw,mode=1777" in argv
    assert "--mount=type=bind,source=/w,destination=/w" in argv
    assert argv[-4:] == ["localhost/i:1", "/bin/sh", "-c", "echo $HOME"]
    assert argv[argv.index("TOKEN") - 1 : argv.index("TOKEN") + 1] == ["--env", "TOKEN"]


def test_devcontainer_is_json_after_comments() -> None:
    text, _ = export_run(_src(), "devcontainer")
    doc = json.loads("\n".join(x for x in text.splitlines() if not x.startswith("//")))
    assert doc["remoteEnv"] == {"TOKEN": "${localEnv:TOKEN}"}


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_a_grant_the_export_cannot_carry_is_named_in_the_header(fmt: str) -> None:
    spec = _spec()
    spec["annotations"]["io.fusion-oci.host-services"] = "127.0.0.1:5432 unix:/run/pg.sock"
    src = read_spec(
        spec, name="t", image="localhost/i:1", image_digest=None, system_dests=[], env_names=[]
    )
    text, missing = export_run(src, fmt)
    note = next(m for m in missing if m.startswith("hostServices"))
    assert "127.0.0.1:5432, unix:/run/pg.sock" in note and note in text
