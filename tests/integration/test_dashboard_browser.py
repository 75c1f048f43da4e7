"""The dashboard page in a real headless browser (Debian's chromium through chromedriver,
driven by selenium): numbers match a generated log, appended events and malformed lines show
up without a reload, the task view lists a task's events in order. Saves the README's
screenshot (docs/dashboard.png)."""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from fusion_oci.audit import AuditEvent, DisposeEvent, RunEvent
from fusion_oci.dashboard.chain import chain_status
from fusion_oci.models import EndReason
from tests.auditgen import append_raw, task_events, ts, write_log
from tests.integration.dashboard_fixture import dashboard

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
XSS = "<img src=x onerror=window.__xss=1>"


@pytest.fixture(autouse=True)
def _audit_key_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit key the writers make (and the dashboard checks MACs with) lives in the
    test's own state folder, not the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    for tool in (CHROMIUM, CHROMEDRIVER):
        # installed by scripts/install.sh (chromium, chromium-driver): missing is a failure
        assert shutil.which(tool), f"{tool} missing: run scripts/install.sh"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,2800",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-extensions",
        # Traffic stays on loopback: no DNS at all, and anything not for loopback
        # goes to a proxy address where nothing listens.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE 127.0.0.2, "
        "EXCLUDE localhost",
        "--proxy-server=http://127.0.0.1:9",
        "--force-device-scale-factor=1",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def nearest_rank(values: list[int], p: float) -> int:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def text(driver: WebDriver, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text)


def wait_text(driver: WebDriver, element_id: str, want: str, timeout: float = 20) -> None:
    WebDriverWait(driver, timeout).until(
        lambda d: text(d, element_id) == want, f"#{element_id} never became {want!r}"
    )


def generated(path: Path) -> list[AuditEvent]:
    events = task_events(30)
    events.append(
        RunEvent(
            ts=ts(7300),
            task_id="task-00029",
            run_id="run-00029",
            backend="bubblewrap",
            command=XSS,
            duration_ms=640,
            exit_code=127,
            end_reason="exit",
        )
    )
    write_log(path, events, malformed_at={17})
    return events


@pytest.fixture
def demo_log() -> Iterator[Path]:
    """A fixed path (it shows in the page, and so in the committed screenshot)."""
    root = Path(tempfile.gettempdir()) / "fusion-oci-dashboard-demo"
    shutil.rmtree(root, ignore_errors=True)
    path = root / ".fusion" / "sandbox-audit.jsonl"
    path.parent.mkdir(parents=True)
    yield path
    shutil.rmtree(root, ignore_errors=True)


def test_page_numbers_live_updates_and_task_view(browser: WebDriver, demo_log: Path) -> None:
    path = demo_log
    events = generated(path)
    runs = [e for e in events if e.type == "sandbox:run"]
    failing = [e for e in runs if e.end_reason != "exit" or e.exit_code != 0]
    with dashboard(path) as d:
        browser.get(d.url)
        wait_text(browser, "n-runs", str(len(runs)))
        assert text(browser, "n-events") == str(len(events))
        assert text(browser, "n-failing") == str(len(failing))
        assert text(browser, "n-fallbacks") == str(
            sum(1 for e in events if e.type == "sandbox:fallback")
        )
        assert text(browser, "n-failures") == str(
            sum(1 for e in events if e.type == "sandbox:failure")
        )
        assert text(browser, "n-tasks") == str(len({e.task_id for e in events}))
        assert text(browser, "n-malformed") == "1"
        assert text(browser, "chain-status") == chain_status(path)["status"]

        rows = {
            r.find_elements(By.TAG_NAME, "td")[0].text: r
            for r in browser.find_elements(By.CSS_SELECTOR, "#durations-backend tbody tr")
        }
        for backend in {e.backend for e in runs}:
            ms = [e.duration_ms for e in runs if e.backend == backend and e.duration_ms]
            cells = [c.text for c in rows[backend].find_elements(By.TAG_NAME, "td")]
            assert cells[1:4] == [
                str(len(ms)),
                str(nearest_rank(ms, 50)),
                str(nearest_rank(ms, 95)),
            ], backend
        prepares = [e for e in events if e.type == "sandbox:prepare"]
        rows = {
            r.find_elements(By.TAG_NAME, "td")[0].text: r
            for r in browser.find_elements(By.CSS_SELECTOR, "#prepare-backend tbody tr")
        }
        for backend in {e.backend for e in prepares}:
            ms = [e.duration_ms for e in prepares if e.backend == backend and e.duration_ms]
            cells = [c.text for c in rows[backend].find_elements(By.TAG_NAME, "td")]
            assert cells[1:4] == [
                str(len(ms)),
                str(nearest_rank(ms, 50)),
                str(nearest_rank(ms, 95)),
            ], backend
        reasons = {
            r.find_elements(By.TAG_NAME, "td")[0].text: r.find_elements(By.TAG_NAME, "td")[1].text
            for r in browser.find_elements(By.CSS_SELECTOR, "#end-reasons tbody tr")
        }
        assert reasons == {
            reason: str(sum(1 for e in runs if e.end_reason == reason))
            for reason in get_args(EndReason)
        }
        limited = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#limits tbody tr")]
        assert len(limited) == len(
            {(e.task_id, e.end_reason) for e in runs if e.end_reason not in ("exit", "signal")}
        )
        # text from the log is text: the command shows, its markup never runs
        assert XSS in browser.find_element(By.ID, "failing-recent").text
        assert browser.execute_script("return window.__xss") is None
        assert browser.find_elements(By.CSS_SELECTOR, "#timeline canvas")
        WebDriverWait(browser, 20).until(lambda b: text(b, "live") == "live")
        screenshot = ROOT / "docs" / "dashboard.png"
        screenshot.parent.mkdir(exist_ok=True)
        assert browser.save_screenshot(str(screenshot))

        # appended lines arrive without a reload
        browser.execute_script("window.__sameDocument = 42")
        write_log(
            path,
            [
                RunEvent(
                    task_id="task-late",
                    run_id="r-late",
                    backend="podman",
                    command="pnpm test",
                    duration_ms=9000,
                    exit_code=None,
                    end_reason="oom",
                )
            ],
        )
        append_raw(path, b"\x00 not an event\n")
        wait_text(browser, "n-runs", str(len(runs) + 1))
        wait_text(browser, "n-malformed", "2")
        assert text(browser, "n-failing") == str(len(failing) + 1)
        assert browser.execute_script("return window.__sameDocument") == 42

        # the task view: every event of one task, in log order, with its policy
        task = "task-00004"
        mine = [e for e in events if e.task_id == task]
        browser.get(d.url + "task/" + task)
        body = "#task-events tbody tr"
        lines = [
            int(r.get_attribute("data-line") or 0)
            for r in browser.find_elements(By.CSS_SELECTOR, body)
        ]
        assert lines == sorted(lines) and len(lines) == len(mine)
        kinds = [
            r.find_elements(By.TAG_NAME, "td")[2].text
            for r in browser.find_elements(By.CSS_SELECTOR, body)
        ]
        assert kinds == [e.type.removeprefix("sandbox:") for e in mine]
        assert text(browser, "policy-hash") == mine[-1].policy_hash
        assert text(browser, "policy-summary") == mine[-1].policy_summary
        WebDriverWait(browser, 20).until(lambda b: text(b, "live") == "live")
        write_log(
            path,
            [
                DisposeEvent(
                    task_id=task,
                    run_id="run-again",
                    backend="oci",
                    duration_ms=3,
                )
            ],
        )
        WebDriverWait(browser, 20).until(
            lambda b: len(b.find_elements(By.CSS_SELECTOR, body)) == len(mine) + 1
        )
        last = browser.find_elements(By.CSS_SELECTOR, body)[-1]
        assert "run-again" in last.text
        assert int(last.get_attribute("data-line") or 0) > lines[-1]

        # the server-rendered task view escapes the log's text too
        browser.get(d.url + "task/task-00029")
        assert XSS in browser.find_element(By.ID, "task-events").text
        assert browser.execute_script("return window.__xss") is None


def test_an_empty_log_renders(browser: WebDriver, tmp_path: Path) -> None:
    with dashboard(tmp_path / "audit.jsonl") as d:
        browser.get(d.url)
        wait_text(browser, "n-events", "0")
        assert text(browser, "n-malformed") == "0"
        assert "no runs yet" in text(browser, "timeline")
        assert browser.get_log("browser") == [] or all(
            entry["level"] != "SEVERE" for entry in browser.get_log("browser")
        )


def test_the_token_link_opens_a_live_page(browser: WebDriver, tmp_path: Path) -> None:
    """On a bind that needs the token, the printed link works once and the page's own
    requests (fetch, EventSource) carry it from then on."""
    path = tmp_path / "audit.jsonl"
    write_log(path, task_events(3))
    with dashboard(path, "--host", "127.0.0.2", expect_token=True) as d:
        browser.get(d.url)
        assert "a valid token is required" in browser.find_element(By.TAG_NAME, "body").text
        browser.get(f"{d.url}?token={d.token}")
        wait_text(browser, "n-events", str(len(task_events(3))))
        WebDriverWait(browser, 20).until(lambda b: text(b, "live") == "live")
        write_log(
            path,
            [DisposeEvent(task_id="t", run_id="r", backend="oci", duration_ms=1)],
        )
        wait_text(browser, "n-events", str(len(task_events(3)) + 1))
        browser.delete_all_cookies()


def x_range(driver: WebDriver) -> tuple[float, float]:
    """The "Runs over time" chart's x scale (uPlot's, in seconds), once the chart is drawn."""
    WebDriverWait(driver, 20).until(
        lambda d: d.execute_script("return !!document.getElementById('timeline').uplot"),
        "the timeline chart was never drawn",
    )
    got = driver.execute_script(
        "const x = document.getElementById('timeline').uplot.scales.x;"
        "return [x.min, x.max, x.time];"
    )
    assert got[2] is True, "the x axis is not a time axis"
    return float(got[0]), float(got[1])


@pytest.mark.parametrize("spread_s", [0.4, 5400.0])
def test_the_time_axis_spans_the_events(
    browser: WebDriver, tmp_path: Path, spread_s: float
) -> None:
    """The axis shows when the runs happened: events within one second (one bucket) are not
    drawn on an axis of years, nor events over 90 minutes on one of seconds."""
    from datetime import datetime

    path = tmp_path / "audit.jsonl"
    stamps = [ts(100 + spread_s * i / 3) for i in range(4)]
    write_log(
        path,
        [
            RunEvent(
                ts=s,
                task_id="t1",
                run_id=f"r{i}",
                backend="bubblewrap",
                exit_code=0,
                duration_ms=5,
            )
            for i, s in enumerate(stamps)
        ],
    )
    first, last = (datetime.fromisoformat(s).timestamp() for s in (stamps[0], stamps[-1]))
    with dashboard(path) as d:
        browser.get(d.url)
        wait_text(browser, "n-events", "4")
        lo, hi = x_range(browser)
        bucket = float(d.json("/api/summary")["timeline"]["bucketSeconds"])
        # the axis covers the events and is no wider than their buckets
        assert lo <= first and hi >= last, (lo, hi, first, last)
        assert hi - lo <= (last - first) + 2 * bucket, (lo, hi, first, last, bucket)
