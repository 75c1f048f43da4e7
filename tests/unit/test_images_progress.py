"""Progress of builds and pulls: plain lines off a terminal, a rich display on one."""

from __future__ import annotations

import io

from rich.console import Console

from fusion_oci.images.progress import NullReporter, PlainReporter, RichReporter, default_reporter

BUILD = [
    {"stream": "STEP 1/3: FROM localhost/fusion-oci/base:bookworm\n"},
    {"stream": "Get:1 http://deb.debian.org/debian bookworm InRelease\n"},
    {"stream": "STEP 2/3: RUN apt-get update\n"},
    {"stream": "--> 2909eec86bd\n"},
]
PULL = [
    {"status": "Pulling fs layer", "id": "abc"},
    {"status": "Downloading", "id": "abc", "progressDetail": {"current": 10, "total": 100}},
    {"status": "Downloading", "id": "abc", "progressDetail": {"current": 90, "total": 100}},
    {"status": "Pull complete", "id": "abc"},
]


def test_plain_lines_show_steps_and_status_changes_only() -> None:
    out = io.StringIO()
    rep = PlainReporter(out)
    rep.start("build node")
    for e in BUILD + PULL:
        rep.event(e)
    rep.finish("built")
    text = out.getvalue()
    assert "STEP 1/3: FROM" in text and "STEP 2/3: RUN apt-get update" in text
    assert "Get:1" not in text  # step output only with verbose
    assert text.count("abc: Downloading") == 1  # one line per status change, not per chunk
    assert all(line.startswith("[build node ") for line in text.splitlines())
    assert "Get:1 http://deb.debian.org" in rep.tail()  # kept for error messages


def test_rich_display_on_a_terminal() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100, record=True)
    rep = RichReporter(console)
    rep.start("pull x")
    for e in BUILD + PULL:
        rep.event(e)
    rep.finish("pulled x")
    text = console.export_text()
    assert "STEP 2/3" in text and "pulled x" in text


def test_default_reporter_picks_by_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(default_reporter(io.StringIO()), PlainReporter)
    assert isinstance(default_reporter(Tty()), RichReporter)
    null = NullReporter()
    null.event({"stream": "x\n"})
    assert null.tail() == "x"
