"""Seatbelt profiles on any platform: golden profiles, well-formed S-expressions, hostile paths,
and the sandbox-exec runtime's plan and availability away from a Mac."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusion_oci.errors import BundleError
from fusion_oci.models import CpuLimit, PrepareContext, SandboxPolicy
from fusion_oci.oci.host import HostInfo
from fusion_oci.policy.layout import CacheMount, GitLayout, TaskLayout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.requirements import Requirement, task_requirements
from fusion_oci.runtimes.sandbox_exec import SandboxExecRuntime, mac_env
from fusion_oci.runtimes.sandbox_exec.seatbelt import (
    SANDBOX_EXEC,
    SeatbeltProfile,
    canonical_path,
    seatbelt_profile,
)
from tests.golden import DATA, assert_golden, host_neutral
from tests.tasks import Case, plan_for, resolved

MAC_HOST = HostInfo(
    uid=501,
    gid=20,
    rlimits={"RLIMIT_NOFILE": (256, -1), "RLIMIT_CPU": (-1, -1)},
    system_mounts=(("/usr", "/usr"), ("/bin", "/bin"), ("/sbin", "/sbin")),
    etc_entries=("passwd", "ssl", "hosts"),
    ca_bundle="/etc/ssl/cert.pem",
)
CACHE = CacheMount(
    "pnpm-store",
    "/Users/me/Library/Caches/fusion-oci/p/pnpm-store",
    "/var/cache/fusion-oci/pnpm-store",
    (("npm_config_store_dir", "/var/cache/fusion-oci/pnpm-store"),),
)


def layout(
    worktree: str = "/Users/me/src/wt-task",
    *,
    linked: bool = True,
    caches: tuple[CacheMount, ...] = (CACHE,),
) -> TaskLayout:
    git = (
        GitLayout("linked", "/Users/me/src/repo/.git/worktrees/wt-task", "/Users/me/src/repo/.git")
        if linked
        else GitLayout("main", f"{worktree}/.git", f"{worktree}/.git")
    )
    return TaskLayout(worktree, git, caches, "/etc/ssl/cert.pem")


def spec_for(policy: SandboxPolicy, lay: TaskLayout | None = None) -> Case:
    lay = lay or layout()
    ctx = PrepareContext(
        task_id="task-1", run_id="run-1", worktree_path=lay.worktree, policy=policy
    )
    return Case(
        resolved(ctx, lay, MAC_HOST, {"HOME": "/Users/me", "PATH": "/usr/bin"}),
        "pnpm install && pnpm test",
    )


def profile_for(case: Case, home: str | None = "/Users/me") -> SeatbeltProfile:
    return seatbelt_profile(
        case.spec,
        caller_home=home,
        scratch_home="/private/var/folders/x/home",
        scratch_tmp="/private/var/folders/x/tmp",
    )


CASES = {
    "none-linked": (SandboxPolicy(allow_network=False), layout()),
    "egress-linked": (
        SandboxPolicy(
            allowed_paths=["/opt/sdk", "/tmp/shared-ro"], writable_paths=["/var/tmp/out"]
        ),
        layout(),
    ),
    "host-main": (SandboxPolicy(network="host"), layout(linked=False, caches=())),
}


# --- a small SBPL reader: enough to prove every profile is well-formed -------------------------


@dataclass(frozen=True)
class Sym:
    name: str


@dataclass(frozen=True)
class Str:
    value: str
    regex: bool = False


Node = Sym | Str | list["Node"]

TOKEN = re.compile(
    r"""
    (?P<ws>\s+) | (?P<comment>;[^\n]*) | (?P<open>\() | (?P<close>\)) |
    (?P<string>\#?"(?:[^"\\]|\\.)*") | (?P<atom>[^\s()";]+)
""",
    re.VERBOSE,
)


def parse_sbpl(text: str) -> list[Node]:
    """S-expressions with SBPL's lexemes (strings, #"regex" strings, ; comments). Raises
    ValueError on anything unbalanced, unterminated or unknown."""
    stack: list[list[Node]] = [[]]
    pos = 0
    while pos < len(text):
        match = TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"cannot read at {pos}: {text[pos : pos + 20]!r}")
        pos = match.end()
        kind = match.lastgroup
        if kind in ("ws", "comment"):
            continue
        if kind == "open":
            stack.append([])
        elif kind == "close":
            if len(stack) == 1:
                raise ValueError(f"unbalanced ')' at {pos}")
            done = stack.pop()
            stack[-1].append(done)
        elif kind == "string":
            raw = match.group()
            regex = raw.startswith("#")
            body = raw[2:-1] if regex else raw[1:-1]
            stack[-1].append(Str(re.sub(r"\\(.)", r"\1", body), regex))
        else:
            stack[-1].append(Sym(match.group()))
    if len(stack) != 1:
        raise ValueError(f"{len(stack) - 1} unclosed '('")
    return stack[0]


def params_used(nodes: list[Node]) -> list[str]:
    found: list[str] = []
    for node in nodes:
        if isinstance(node, list):
            if len(node) == 2 and node[0] == Sym("param") and isinstance(node[1], Str):
                found.append(node[1].value)
            else:
                found += params_used(node)
    return found


def assert_well_formed(profile: SeatbeltProfile) -> list[Node]:
    forms = parse_sbpl(profile.text)
    assert forms[0] == [Sym("version"), Sym("1")]
    assert forms[1] == [Sym("deny"), Sym("default")]
    for form in forms:
        assert isinstance(form, list) and form, form
        assert form[0] in (Sym("version"), Sym("allow"), Sym("deny")), form
    names = [name for name, _ in profile.params]
    assert len(names) == len(set(names))
    assert sorted(set(params_used(forms))) == sorted(names)
    for name in names:
        assert re.fullmatch(r"[A-Z][A-Z_0-9]*", name)
    return forms


# --- golden profiles --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_profiles(name: str) -> None:
    policy, lay = CASES[name]
    profile = profile_for(spec_for(policy, lay))
    assert_well_formed(profile)
    assert_golden(f"seatbelt/{name}.sb", profile.text)
    assert_golden(f"seatbelt/{name}.params.json", [list(p) for p in profile.params])


def test_every_golden_profile_on_disk_is_well_formed() -> None:
    files = sorted((DATA / "seatbelt").glob("*.sb"))
    assert len(files) >= len(CASES)
    for path in files:
        parse_sbpl(path.read_text())


@pytest.mark.parametrize("network", ["none", "egress", "host"])
@pytest.mark.parametrize("linked", [True, False])
@pytest.mark.parametrize("home", ["/Users/me", None])
def test_every_combination_is_well_formed(network: str, linked: bool, home: str | None) -> None:
    policy = SandboxPolicy(
        network=network,
        allow_network=network != "none",  # type: ignore[arg-type]
        allowed_paths=["/opt/a"],
        writable_paths=["/opt/b"],
        memory_limit_mb=64,
        cpu_limit=CpuLimit(max_ms=1000),
    )
    assert_well_formed(profile_for(spec_for(policy, layout(linked=linked)), home))


# --- what the rules say -----------------------------------------------------------------------


def rules(forms: list[Node]) -> list[tuple[str, list[str], list[Node]]]:
    """(allow|deny, operations, filters) of each rule."""
    out = []
    for form in forms[1:]:
        assert isinstance(form, list)
        head = form[0]
        assert isinstance(head, Sym)
        ops = [n.name for n in form[1:] if isinstance(n, Sym)]
        filters = [n for n in form[1:] if not isinstance(n, Sym)]
        out.append((head.name, ops, filters))
    return out


def param_rule_index(
    forms: list[Node], value: str, profile: SeatbeltProfile, action: str, op: str
) -> int:
    """Index of the last rule with ``action`` on ``op`` whose subpath is the param ``value``."""
    names = {n for n, v in profile.params if v == value}
    found = -1
    for i, (act, ops, filters) in enumerate(rules(forms)):
        if act != action or op not in ops:
            continue
        for f in filters:
            if (
                isinstance(f, list)
                and f[0] == Sym("subpath")
                and isinstance(f[1], list)
                and isinstance(f[1][1], Str)
                and f[1][1].value in names
            ):
                found = i
    return found


def test_git_hooks_and_config_are_read_only_after_the_writable_git_dirs() -> None:
    spec = spec_for(SandboxPolicy(allow_network=False))
    profile = profile_for(spec)
    forms = assert_well_formed(profile)
    common = "/Users/me/src/repo/.git"
    for ro in (f"{common}/hooks", f"{common}/config"):
        deny = param_rule_index(forms, ro, profile, "deny", "file-write*")
        for rw in (
            f"{common}/objects",
            f"{common}/refs",
            "/Users/me/src/wt-task",
            "/Users/me/src/repo/.git/worktrees/wt-task",
        ):
            allow = param_rule_index(forms, rw, profile, "allow", "file-write*")
            assert 0 <= allow < deny, (ro, rw)  # the last matching rule wins


def test_main_worktree_git_dir_inside_the_worktree_stays_protected() -> None:
    lay = layout(linked=False, caches=())
    profile = profile_for(spec_for(SandboxPolicy(), lay))
    forms = assert_well_formed(profile)
    worktree = param_rule_index(forms, lay.worktree, profile, "allow", "file-write*")
    hooks = param_rule_index(forms, f"{lay.worktree}/.git/hooks", profile, "deny", "file-write*")
    config = param_rule_index(forms, f"{lay.worktree}/.git/config", profile, "deny", "file-write*")
    assert 0 <= worktree < hooks and worktree < config


def test_home_is_unreadable_except_the_named_caches_and_worktree() -> None:
    profile = profile_for(spec_for(SandboxPolicy(allow_network=False)))
    forms = assert_well_formed(profile)
    home_deny = param_rule_index(forms, "/Users/me", profile, "deny", "file-read-data")
    cache = param_rule_index(forms, CACHE.host_path, profile, "allow", "file-read*")
    worktree = param_rule_index(forms, "/Users/me/src/wt-task", profile, "allow", "file-read*")
    assert 0 <= home_deny < cache and home_deny < worktree
    # Nothing else under the home is opened: every allowed parameter is a mount of the spec.
    opened = {v for n, v in profile.params if n != "CALLER_HOME" and v.startswith("/Users/me")}
    assert opened == {
        CACHE.host_path,
        "/Users/me/src/wt-task",
        "/Users/me/src/wt-task/.git",
        "/Users/me/src/repo/.git",
        "/Users/me/src/repo/.git/objects",
        "/Users/me/src/repo/.git/refs",
        "/Users/me/src/repo/.git/logs",
        "/Users/me/src/repo/.git/worktrees/wt-task",
        "/Users/me/src/repo/.git/hooks",
        "/Users/me/src/repo/.git/config",
    }


def network_rules(profile: SeatbeltProfile) -> list[tuple[str, list[str], list[Node]]]:
    return [
        r for r in rules(parse_sbpl(profile.text)) if any(op.startswith("network") for op in r[1])
    ]


def test_network_none_denies_everything() -> None:
    net = network_rules(profile_for(spec_for(SandboxPolicy(allow_network=False))))
    assert net == [("deny", ["network*"], [])]


def test_network_egress_is_outbound_only_and_never_localhost() -> None:
    net = network_rules(profile_for(spec_for(SandboxPolicy())))
    allow_ip = ("allow", ["network-outbound"], [[Sym("remote"), Sym("ip"), Str("*:*")]])
    deny_local = ("deny", ["network-outbound"], [[Sym("remote"), Sym("ip"), Str("localhost:*")]])
    assert net.index(allow_ip) < net.index(deny_local)
    assert ("deny", ["network-bind", "network-inbound"], []) in net
    assert not any(
        r[0] == "allow"
        and ("network-inbound" in r[1] or "network-bind" in r[1] or "network*" in r[1])
        for r in net
    )
    unix = [r for r in net if r[0] == "allow" and r[2] and r[2][0][0] == Sym("literal")]
    assert unix == [
        ("allow", ["network-outbound"], [[Sym("literal"), Str("/private/var/run/mDNSResponder")]])
    ]


def test_network_host_allows_the_network() -> None:
    net = network_rules(profile_for(spec_for(SandboxPolicy(network="host"))))
    assert ("allow", ["network*"], []) in net


# --- hostile paths ----------------------------------------------------------------------------


HOSTILE = [
    '/Users/me/a"b',
    '/Users/me/x) (allow file-write* (subpath "/")) (',
    "/Users/me/line\nbreak",
    "/Users/me/semi;colon",
    "/Users/me/back\\slash\\",
    '/Users/me/#"regex"',
    "/Users/me/spaces and\ttabs",
    "/Users/me/unicodé ✓",
    '/Users/me/"))(allow default)(deny default "',
]


@pytest.mark.parametrize("path", HOSTILE)
def test_hostile_paths_cannot_change_the_profile(path: str) -> None:
    benign = spec_for(
        SandboxPolicy(allowed_paths=["/Users/me/ro"], writable_paths=["/Users/me/rw"]),
        layout("/Users/me/wt"),
    )
    hostile = spec_for(
        SandboxPolicy(allowed_paths=[path + "-ro"], writable_paths=[path + "-rw"]),
        layout(path + "-wt"),
    )
    good, bad = profile_for(benign), profile_for(hostile, home=path)
    assert bad.text == good.text  # the text depends on no path at all
    assert_well_formed(bad)
    values = dict(bad.params)
    assert path in values.values()
    assert path + "-wt" in values.values() and path + "-ro" in values.values()
    for value in (path, path + "-wt", path + "-ro", path + "-rw"):
        assert value not in bad.text
    # Every value is exactly one argv word after -D NAME=.
    args = bad.parameter_args()
    assert args[0::2] == ["-D"] * len(bad.params)
    assert [a.split("=", 1) for a in args[1::2]] == [[n, v] for n, v in bad.params]


def test_the_profile_text_has_no_path_of_the_task() -> None:
    profile = profile_for(spec_for(SandboxPolicy(allowed_paths=["/opt/sdk"])))
    task_paths = [v for _, v in profile.params if v.startswith(("/Users/", "/opt/sdk"))]
    assert len(task_paths) > 5
    for value in task_paths:
        assert value not in profile.text


# --- canonical paths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "canon"),
    [
        ("/var/folders/x", "/private/var/folders/x"),
        ("/tmp", "/private/tmp"),
        ("/tmp/a/../b/./c/", "/private/tmp/b/c"),
        ("/etc/ssl/cert.pem", "/private/etc/ssl/cert.pem"),
        ("//tmp//x", "/private/tmp/x"),
        ("/variable/x", "/variable/x"),
        ("/private/var/x", "/private/var/x"),
        ("/Users/me", "/Users/me"),
        ("<private-home>", "<private-home>"),
    ],
)
def test_canonical_path(raw: str, canon: str) -> None:
    assert canonical_path(raw) == canon


@pytest.mark.parametrize("bad", ["relative/path", "", "/a\0b"])
def test_canonical_path_refuses(bad: str) -> None:
    with pytest.raises(BundleError):
        canonical_path(bad)


# --- the runtime, away from a Mac -------------------------------------------------------------


def runtime(platform: str = "linux") -> SandboxExecRuntime:
    rt = SandboxExecRuntime(
        SandboxSettings(backend="sandbox-exec"),
        {"HOME": "/Users/me", "PATH": "/usr/bin"},
        cache_root=Path("/nonexistent-cache"),
        host=MAC_HOST,
    )
    rt.platform = platform
    return rt


@pytest.mark.parametrize(("platform", "where"), [("linux", "linux"), ("win32", "Windows")])
def test_unavailable_off_macos_with_the_reason(platform: str, where: str) -> None:
    avail = runtime(platform).availability()
    assert not avail.available
    assert "only on macOS" in avail.reason and where in avail.reason
    assert "plan --backend sandbox-exec" in avail.hint


def test_plan_works_off_macos_without_touching_the_system() -> None:
    rt = runtime()
    case = spec_for(SandboxPolicy(allow_network=False))
    plan = plan_for(rt, case.task, case.command)
    profile = rt.profile(case.spec)
    assert plan.argv is not None
    # What really runs: the subreaper shim with the spec's rlimits, then sandbox-exec.
    shim, sandboxed = plan.argv[: plan.argv.index("--")], plan.argv[plan.argv.index("--") + 1 :]
    assert host_neutral(shim)[:7] == ["<python>", "-S", "-E", "-s", "<reaper.py>", "2.0", "<pid>"]
    assert sandboxed[:3] == [SANDBOX_EXEC, "-p", profile.text]
    assert sandboxed[3:-3] == profile.parameter_args()
    assert sandboxed[-3:] == ["/bin/sh", "-c", "pnpm install && pnpm test"]
    assert ("RW_6", "<private-tmp>") in profile.params  # no scratch directory was made
    assert plan.cwd == "/Users/me/src/wt-task"
    assert plan.env is not None and plan.env["HOME"] == "<private-home>"
    assert plan.env["npm_config_store_dir"] == CACHE.host_path
    assert "profile:" in plan.notes
    assert_golden(
        "seatbelt/plan-none-linked.json", {**plan.to_json(), "argv": host_neutral(plan.argv)}
    )


def test_plan_mentions_an_image_it_cannot_use() -> None:
    ctx = PrepareContext(task_id="t", run_id="r", worktree_path="/Users/me/wt", image="node:20")
    task = resolved(ctx, layout("/Users/me/wt"), MAC_HOST)
    assert any(
        n.startswith("REFUSED: image node:20") for n in plan_for(runtime(), task, "true").notes
    )


def test_homebrew_joins_the_path() -> None:
    case = spec_for(SandboxPolicy())
    env = mac_env(case.spec, case.process, "/h", "/t")
    assert env["PATH"].split(":")[-2:] == ["/opt/homebrew/bin", "/opt/homebrew/sbin"]


def test_memory_and_pids_are_not_claimed() -> None:
    rt = runtime("darwin")
    policy = SandboxPolicy(memory_limit_mb=512, pids_limit=64, cpu_limit=CpuLimit(max_cores=1))
    ctx = PrepareContext(task_id="t", run_id="r", worktree_path="/Users/me/wt", policy=policy)
    missing = task_requirements(resolved(ctx, layout("/Users/me/wt"), MAC_HOST)) - rt.enforces()
    assert missing == {Requirement.MEMORY, Requirement.PIDS, Requirement.CPU_QUOTA}
    assert rt.capabilities().supports_mac and not rt.capabilities().supports_linux


async def test_prepare_off_macos_is_a_clear_unavailable_error(tmp_path: Path) -> None:
    from fusion_oci.errors import RuntimeUnavailableError
    from fusion_oci.resolve import resolve

    task = resolve(
        SandboxSettings(),
        PrepareContext(task_id="t", run_id="r", worktree_path=str(tmp_path)),
        MAC_HOST,
        env={},
        cache_root=tmp_path / "cache",
        create=False,
    )
    with pytest.raises(RuntimeUnavailableError, match="only on macOS"):
        await runtime().prepare(task)


def test_golden_params_are_json(tmp_path: Path) -> None:
    for path in (DATA / "seatbelt").glob("*.params.json"):
        assert all(len(pair) == 2 for pair in json.loads(path.read_text()))
