"""``policy.publishPorts``: the settings' parsing (fusion_oci.models.publishport), the task spec's
annotation (a golden: the translation is pure) and what each runtime's check says."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fusion_oci.models import SandboxPolicy
from fusion_oci.models.publishport import PublishedPort, parse_publish
from fusion_oci.oci.spec import default_task, with_annotations, with_published_ports
from fusion_oci.runtimes.requirements import Requirement, spec_requirements
from tests.golden import assert_golden

ACCEPTED = {
    "3000": PublishedPort(3000, 0, "127.0.0.1"),
    "8080:80": PublishedPort(80, 8080, "127.0.0.1"),
    "127.0.0.1:8080:80": PublishedPort(80, 8080, "127.0.0.1"),
    "127.0.0.2::80": PublishedPort(80, 0, "127.0.0.2"),
    "[::1]:8443:443": PublishedPort(443, 8443, "::1"),
    "[::1]::443": PublishedPort(443, 0, "::1"),
}


@pytest.mark.parametrize(("text", "want"), ACCEPTED.items())
def test_the_docker_run_p_spellings_parse(text: str, want: PublishedPort) -> None:
    assert parse_publish(text) == want
    assert parse_publish(str(want)) == want  # the canonical form reads back the same


REFUSED = {
    "4040:80": "4040 is fusion-oci's dashboard",
    "127.0.0.1:4040:80": "4040 is fusion-oci's dashboard",
    "0.0.0.0:8080:80": "mapping form",
    "192.168.1.5:8080:80": "mapping form",
    "localhost:8080:80": "not an address",
    "[::ffff:127.0.0.1]:8080:80": "IPv4 address in IPv6 form",
    "80/tcp": "protocol suffix",
    "8000-8010": "port range",
    "0": "not a sandbox port",
    "70000": "not a sandbox port",
    "8080:": "not a sandbox port",
    "x:80": "not a host port",
    " 80": "space-padded",
    "": "empty",
    "1:2:3:4": "write PORT",
}


@pytest.mark.parametrize(("text", "why"), REFUSED.items())
def test_refused_entries_say_why_and_what_to_write(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_publish(text)


def test_the_settings_name_the_field_and_refuse_4040_and_duplicates() -> None:
    with pytest.raises(ValidationError, match=r"publishPorts\[1\] '4040:3000'.*dashboard"):
        SandboxPolicy.model_validate({"publishPorts": ["3000", "4040:3000"]})
    with pytest.raises(ValidationError, match=r"host port 127.0.0.1:9000 is taken"):
        SandboxPolicy.model_validate({"publishPorts": ["9000:80", "9000:81"]})
    with pytest.raises(ValidationError, match="4040 is fusion-oci's dashboard"):
        SandboxPolicy.model_validate({"publishPorts": [{"port": 80, "hostPort": 4040}]})
    with pytest.raises(ValidationError, match="network host"):
        SandboxPolicy.model_validate({"publishPorts": ["80"], "network": "host"})


def test_the_mapping_form_is_the_only_way_off_the_loopback() -> None:
    policy = SandboxPolicy.model_validate(
        {"publishPorts": ["3000", {"port": 80, "hostPort": 8080, "address": "0.0.0.0"}]}
    )
    assert policy.published() == [
        PublishedPort(3000, 0, "127.0.0.1"),
        PublishedPort(80, 8080, "0.0.0.0"),
    ]
    assert "publish=127.0.0.1::3000,0.0.0.0:8080:80" in policy.summary()


def test_a_policy_without_published_ports_keeps_its_hash() -> None:
    assert SandboxPolicy().digest() == SandboxPolicy(publish_ports=[]).digest()
    assert SandboxPolicy().digest() != SandboxPolicy(publish_ports=["3000"]).digest()


def test_the_spec_annotation_is_golden_and_reads_back() -> None:
    policy = SandboxPolicy.model_validate(
        {"publishPorts": ["3000", "8080:80", "[::1]::81", {"port": 90, "address": "0.0.0.0"}]}
    )
    task = with_published_ports(default_task(), policy.published())
    assert_golden("publish_ports_annotations.json", task.annotations)
    assert task.published_ports == tuple(policy.published())
    assert Requirement.PUBLISHED_PORTS in spec_requirements(task)


def test_an_annotation_that_does_not_parse_publishes_nothing() -> None:
    said = {"io.fusion-oci.publish-ports": "127.0.0.1:4040:80 nonsense ::"}
    assert with_annotations(default_task(), said).published_ports == ()


def test_settings_show_plan_and_doctor_say_what_each_published_port_gives() -> None:
    from fusion_oci.services.show import publish_lines, publish_rows, publish_summary

    policy = SandboxPolicy.model_validate(
        {"publishPorts": ["3000", {"port": 80, "hostPort": 8080, "address": "0.0.0.0"}]}
    )
    summary = publish_summary(policy)
    assert [(e["port"], e["hostPort"], e["address"], e["loopback"]) for e in summary] == [
        (3000, None, "127.0.0.1", True),
        (80, 8080, "0.0.0.0", False),
    ]
    assert "a free port, reported at prepare" in str(summary[0]["gives"])
    assert "EVERY HOST" in str(summary[1]["gives"])
    rows = publish_rows(policy)
    assert [(r["key"], r["value"]) for r in rows] == [
        ("ports.published[0]", "127.0.0.1:* -> 3000"),
        ("ports.published[1]", "0.0.0.0:8080 -> 80"),
    ]
    assert str(rows[1]["source"]).startswith("sandbox.policy.publishPorts[1]: gives")
    assert publish_lines(summary)[0].startswith("publishPorts 3000: gives this host's")


def test_the_agents_wiring_is_golden() -> None:
    """Each published port: its relay's socket bound read-only at
    /run/fusion-oci/publish/N.sock and ``--publish PORT=PATH`` for the agent (placeholders in
    a plan), after the host services' own; the same for every runtime's translation."""
    from fusion_oci.models.hostservice import parse_grant
    from fusion_oci.services.inside import service_wiring

    ports = SandboxPolicy(publish_ports=["3000", "8080:80"]).published()
    grants = [parse_grant("127.0.0.1:5432")]
    planned = service_wiring(grants, None, None, ports)
    prepared = service_wiring(
        grants,
        {
            "127.0.0.1:5432": "/tmp/s/0.sock",
            "publish:0": "/tmp/p/0.sock",
            "publish:1": "/tmp/p/1.sock",
        },
        None,
        ports,
    )
    assert_golden(
        "publish_ports_wiring.json",
        {
            "plan": {"binds": planned.binds, "agent": planned.agent_args},
            "prepared": {"binds": prepared.binds, "agent": prepared.agent_args},
        },
    )
