"""The fast front end's static help texts are the typer app's (regenerate them with
`python -m fusion_oci.cli.helptext > fusion_oci/cli/_help.py`)."""

from __future__ import annotations

from pathlib import Path

from fusion_oci.cli import fast, helptext


def test_generated_help_matches_the_typer_app() -> None:
    checked_in = Path(helptext.__file__).with_name("_help.py").read_text()
    assert checked_in == helptext.module_source(), (
        "fusion_oci/cli/_help.py is stale: run "
        "`python -m fusion_oci.cli.helptext > fusion_oci/cli/_help.py`"
    )


def test_help_is_answered_only_when_that_is_all_that_is_asked() -> None:
    assert fast._help(["--help"]) is not None
    assert fast._help(["run", "-h"]) is not None
    assert fast._help(["bundle", "create", "--help"]) is not None
    assert fast._help(["run", "--", "ls", "--help"]) is None
    assert fast._help(["nosuch", "--help"]) is None
    assert fast._help([]) is None


def test_run_flags_the_fast_client_leaves_to_the_full_cli() -> None:
    env: dict[str, str] = {}
    assert fast._fast_run_ok(["--", "ls"], env)
    assert fast._fast_run_ok(["-i", "-t", "--json", "--", "ls", "-h"], env)
    assert not fast._fast_run_ok(["-h"], env)
    assert not fast._fast_run_ok(["--task-prompt", "-", "--", "ls"], env)
    assert not fast._fast_run_ok(["--task-prompt=-", "ls"], env)
    assert not fast._fast_run_ok(["--", "ls"], {"FUSION_OCI_NO_SERVER": "1"})


def test_json_of_the_client_round_trips() -> None:
    import json

    value = {"a": ['é\n"\\', 1, True, None, False], "b": {"c": "\u0000"}}
    assert json.loads(fast.dumps(value)) == value
    assert fast.loads(json.dumps(value)) == value
