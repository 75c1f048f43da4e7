"""Every external program the suite, the scripts and the package run is installed by
scripts/install.sh: a fresh Debian 12 with only the README's two commands passes the suite.

The programs are found in the code (argv literals, ``shutil.which``, ``/usr/bin/...`` paths,
the shell scripts' commands) plus the ones other programs run (podman kube play's pause binary
``catatonit``, rootless engines' helpers). Each is either in :data:`PROGRAMS` with the package
that ships it, which install.sh must install (APT_PACKAGES, or its npm / pip step), or comes
with a Debian 12 base system (an Essential or Priority: required package, as dpkg says here).
The table itself is checked against dpkg on this machine, so a wrong package name fails too.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SH = ROOT / "scripts" / "install.sh"
SCANNED = ["fusion_oci", "tests", "benchmarks", "scripts", "hatch_build.py", ".ci/run"]
MACOS_ONLY = {"tests/integration/test_sandbox_exec_macos.py"}
"""Files whose programs run only on macOS (the seatbelt tier), never on the Debian CI."""

PROGRAMS: dict[str, str] = {
    # program: the apt package that ships it; "npm -g" / "pip": install.sh's npm and pip steps
    "podman": "podman",
    "bwrap": "bubblewrap",
    "crun": "crun",
    "runc": "runc",
    "newuidmap": "uidmap",
    "newgidmap": "uidmap",
    "slirp4netns": "slirp4netns",
    "fuse-overlayfs": "fuse-overlayfs",
    "debootstrap": "debootstrap",
    "docker": "docker.io",
    "dockerd": "docker.io",
    "dockerd-rootless.sh": "docker.io",
    "containerd": "docker.io",
    "rootlesskit": "rootlesskit",
    "tini": "tini",
    "tini-static": "tini",
    "catatonit": "catatonit",
    "git": "git",
    "node": "nodejs",
    "npm": "npm",
    "ip": "iproute2",
    "docker-registry": "docker-registry",
    "psql": "postgresql-client-common",
    "pg_isready": "postgresql-client-common",
    "runsc": "runsc",
    "mkfs.xfs": "xfsprogs",
    "docker-compose": "docker-compose",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
    "python3": "python3",
    "python3.11": "python3",
    "curl": "curl",
    "ps": "procps",
    "pgrep": "procps",
    "pkill": "procps",
    "gcc": "gcc",
    "cc": "gcc",
    "pnpm": "npm -g",
    "ctr": "containerd",
    "iptables": "iptables",
    "iptables-save": "iptables",
    "openssl": "openssl",
    "ipset": "ipset",
    "sysctl": "procps",
    "kubernetes-validate": "pip",
    "ruff": "pip",
    "mypy": "pip",
}

INDIRECT = {
    "catatonit": "podman kube play's pause binary (tests/integration/test_export.py)",
    "crun": "podman's default OCI runtime on a cgroup v2 host",
    "newuidmap": "rootless podman and rootless dockerd map their user namespace with it",
    "newgidmap": "rootless podman and rootless dockerd map their user namespace with it",
    "slirp4netns": "rootless podman's and rootlesskit's network",
    "fuse-overlayfs": "rootless storage on kernels before 5.13 (scripts/install.sh)",
    "rootlesskit": "dockerd-rootless.sh runs dockerd under it",
    "containerd": "dockerd starts it",
    "chromedriver": "selenium drives chromium through it",
    "tini": "the docker engine's --init",
    "gcc": "hatch_build.py compiles the exec agent",
    "ipset": "kube-router (the test cluster's NetworkPolicy firewall, scripts/cluster.sh) runs it",
}
"""Programs no line of ours names in an argv, run by the programs we run."""

NOT_RUN = {
    "sandbox-exec": "macOS's own /usr/bin/sandbox-exec (the seatbelt tier), never on Linux",
    "systemd-run": "the systemd-run cgroup mode is chosen only when the host has systemd "
    "(runtimes/linux/cgroups.py); the tests name it in pure argv tests",
}
"""Words that look like programs in the code but are not run on this machine."""

NOT_INSTALLED = {
    "sudo": "used only when the scripts are not run as root: then the user has sudo",
}

SUBSTITUTES = {"npm": {"nodejs"}}
"""install.sh keeps a Node.js from elsewhere (nodesource's nodejs ships npm itself)."""

ALTERNATIVES = {"cc": "gcc"}
"""Programs that are a Debian alternative registered by the package of another program."""

_BASH_WORDS = """
    . : [ [[ ]] { } ! alias bg break builtin case cd command compgen complete continue declare
    do done echo elif else esac eval exec exit export false fc fg fi for function getopts hash
    help history if in jobs kill let local logout mapfile popd printf pushd pwd read readarray
    readonly return select set shift shopt source suspend test then time times trap true type
    typeset ulimit umask unalias unset until wait while
"""
BASH_WORDS = set(_BASH_WORDS.split())


# --------------------------------------------------------------------------- install.sh


def apt_packages(install_sh: str) -> set[str]:
    """The words of install.sh's ``APT_PACKAGES=( ... )`` (comments dropped). Pure."""
    block = re.search(r"^APT_PACKAGES=\((.*?)^\)", install_sh, re.S | re.M)
    assert block, "no APT_PACKAGES=( ... ) in install.sh"
    return {w for line in block.group(1).splitlines() for w in line.split("#")[0].split()}


def npm_globals(install_sh: str) -> set[str]:
    """The packages install.sh installs with ``npm install -g`` (versions dropped). Pure."""
    return {m.split("@")[0] for m in re.findall(r"npm install -g (\S+)", install_sh)}


def unprovided(table: Mapping[str, str], install_sh: str) -> list[str]:
    """The programs of ``table`` whose package ``install_sh`` does not install. Pure."""
    apt, npm = apt_packages(install_sh), npm_globals(install_sh)
    pip = "pip install" in install_sh and "-e '.[dev]'" in install_sh
    missing = []
    for program, package in sorted(table.items()):
        ok = program in npm if package == "npm -g" else pip if package == "pip" else package in apt
        if not ok:
            missing.append(program)
    return missing


# --------------------------------------------------------------------------- the scan


def _program(word: object) -> str | None:
    """``word`` as the name of a program it runs, if it can be one: a bare name on PATH or
    in the table, or a path in a system bin directory."""
    if not isinstance(word, str) or not re.fullmatch(r"[A-Za-z0-9_./+-]+", word):
        return None
    if word.startswith("/"):
        m = re.fullmatch(r"/(?:usr/)?s?bin/([A-Za-z0-9_.+-]+)", word)
        return m.group(1) if m else None
    if "/" in word or word.startswith("-"):
        return None
    return word if word in PROGRAMS or shutil.which(word) else None


ARGV_NAME = re.compile(r"argv|cmd|command|args|prog", re.I)
"""A variable, keyword or function named like this holds (or returns) a command's argv."""
RUNNER_NAME = re.compile(
    r"run|exec|popen|spawn|call|output|argv|cmd|command|start|sudo|ctl|probe", re.I
)
"""A function named like this takes a command's argv (subprocess.run, check_output, _kubectl)."""
RUNNERS = {"which", "create_subprocess_exec", "execvp", "execv", "execvpe", "Popen"}
"""Calls whose first argument is a program's name or path."""


def _argv_lists(tree: ast.AST) -> Iterable[ast.List | ast.Tuple]:
    """The list and tuple displays in argv position (the leftmost operand of ``[...] + rest``
    too): given to a runner-named call, or as an argv-named keyword; bound to an argv-named
    variable or dict key; returned by an argv-named function; or an item of such a list (a
    table of commands). A list that is only data (``["dir", "file"]``, a table's column names)
    is not one, whatever programs the machine has."""

    def leftmost(node: ast.AST | None) -> ast.AST | None:
        while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            node = node.left
        return node

    def starred(node: ast.AST | None) -> Iterable[ast.AST | None]:
        yield node
        if isinstance(node, ast.List | ast.Tuple):  # [["git", "init"], ["git", "add"]]
            yield from (leftmost(e) for e in node.elts)

    positions: list[ast.AST | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if RUNNER_NAME.search(callee):
                positions += [leftmost(a) for a in node.args]
            positions += [leftmost(k.value) for k in node.keywords if ARGV_NAME.search(k.arg or "")]
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id if isinstance(t, ast.Name) else getattr(t, "attr", "") for t in targets]
            if any(ARGV_NAME.search(n) for n in names):
                positions += starred(leftmost(node.value))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ARGV_NAME.search(
            node.name
        ):
            positions += [leftmost(r.value) for r in ast.walk(node) if isinstance(r, ast.Return)]
        elif isinstance(node, ast.Dict):  # {"command": ["printenv", "TOKEN"]}
            positions += [
                leftmost(v)
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and ARGV_NAME.search(str(k.value))
            ]
    for node in positions:
        if isinstance(node, ast.List | ast.Tuple):
            yield node


def _python_programs(source: str) -> set[str]:
    tree = ast.parse(source)
    found: set[str] = set()
    for argv in _argv_lists(tree):
        if argv.elts and isinstance(argv.elts[0], ast.Constant):
            found.add(_program(argv.elts[0].value) or "")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in RUNNERS:
                found.add(_program(node.args[0].value) or "")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"/(?:usr/)?s?bin/[A-Za-z0-9_.+-]+", node.value)
        ):
            found.add(_program(node.value) or "")
    return found - {""}


WRAPPERS = {"sudo", "as_root", "exec", "env", "nohup", "command", '"${SUDO[@]}"'}


def _shell_programs(source: str) -> set[str]:
    """The words in command position of a bash script (roughly: good enough for ours), and
    what ``command -v`` looks for; the script's own functions and bash's words left out."""
    functions = set(re.findall(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(\)", source, re.M))
    found: set[str] = set(re.findall(r"command -v ([A-Za-z0-9_.+-]+)", source))
    for raw in source.splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw)
        for segment in re.split(r"\|\||&&|[|;`(]|\$\(|\bthen\b|\bdo\b|\belse\b", line):
            words = [w for w in segment.split() if not re.fullmatch(r"[A-Za-z_]\w*=\S*", w)]
            while words and words[0] in WRAPPERS:
                words = words[1:]
                while words and (words[0].startswith("-") or "=" in words[0]):
                    words = words[1:]  # env's -u X, NAME=value after env
            if words:
                word = words[0].strip("\"'")
                if word not in BASH_WORDS and word not in functions:
                    found.add(_program(word) or "")
    return found - {""}


def programs_used(root: Path, scanned: Iterable[str] = SCANNED) -> dict[str, set[str]]:
    """Program name → the files (relative to ``root``) that run it."""
    used: dict[str, set[str]] = {}
    for top in scanned:
        base = root / top
        paths = sorted(base.rglob("*")) if base.is_dir() else [base]
        for path in paths:
            rel = str(path.relative_to(root))
            if rel in MACOS_ONLY or "/data/" in f"/{rel}" or not path.is_file():
                continue
            if path.suffix == ".py":
                names = _python_programs(path.read_text(encoding="utf-8"))
            elif path.suffix == ".sh" or path.read_bytes()[:32].startswith(b"#!/usr/bin/env bash"):
                names = _shell_programs(path.read_text(encoding="utf-8"))
            else:
                continue
            for name in names:
                used.setdefault(name, set()).add(rel)
    return used


# --------------------------------------------------------------------------- dpkg


@functools.cache
def _dpkg_files() -> dict[str, frozenset[str]]:
    """File name → the installed packages that ship it in a bin (or contrib) directory, from
    dpkg's own lists (one read, not a dpkg-query per program)."""
    out: dict[str, set[str]] = {}
    for listing in Path("/var/lib/dpkg/info").glob("*.list"):
        package = listing.name.removesuffix(".list").split(":")[0]
        for path in listing.read_text(encoding="utf-8", errors="replace").splitlines():
            parent, _, name = path.rpartition("/")
            if parent.endswith(("/bin", "/sbin", "/contrib")):
                out.setdefault(name, set()).add(package)
    return {name: frozenset(packages) for name, packages in out.items()}


@functools.cache
def _dpkg_status() -> dict[str, tuple[bool, set[str]]]:
    """Installed package → (in every Debian 12: Essential or Priority required, its
    Depends and Pre-Depends)."""
    out = subprocess.run(
        [
            "dpkg-query",
            "-W",
            "-f",
            "${Package}\t${Essential}\t${Priority}\t${Pre-Depends}, ${Depends}\n",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    status = {}
    for line in out.splitlines():
        package, essential, priority, deps = line.split("\t")
        names = {
            d.split()[0].split(":")[0]
            for alt in deps.split(",")
            for d in alt.split("|")
            if d.strip()
        }
        status[package] = (essential == "yes" or priority == "required", names)
    return status


def dpkg_owners(program: str) -> frozenset[str]:
    """The packages installed here that ship ``program`` in a bin directory (or, for
    dockerd-rootless.sh, in docker.io's contrib); for a Debian alternative (awk, cc), the
    package of the program it points to."""
    owners = set(_dpkg_files().get(program, ()))
    found = shutil.which(program, path=f"{os.environ['PATH']}:/usr/sbin:/sbin")
    if found:
        owners |= _dpkg_files().get(os.path.basename(os.path.realpath(found)), frozenset())
    return frozenset(owners)


def is_base(package: str) -> bool:
    """Does every Debian 12 have ``package`` (Essential, or Priority: required)?"""
    return _dpkg_status().get(package, (False, set()))[0]


def depends(package: str, depth: int = 2) -> set[str]:
    """What installing ``package`` installs too (Depends, Pre-Depends; ``depth`` levels)."""
    direct = set(_dpkg_status().get(package, (False, set()))[1])
    if depth > 1:
        for dep in set(direct):
            direct |= depends(dep, depth - 1)
    return direct


def _venv_has(program: str) -> bool:
    return (Path(sys.executable).parent / program).exists()


def classify(used: Mapping[str, set[str]], install_sh: str) -> dict[str, str]:
    """Program → why it is not accounted for; empty when every used program is."""
    problems = {
        p: f"the table says {PROGRAMS[p]!r}, which install.sh does not install"
        for p in unprovided({p: PROGRAMS[p] for p in used if p in PROGRAMS}, install_sh)
    }
    for program, files in sorted(used.items()):
        if program in PROGRAMS or program in NOT_RUN or program in NOT_INSTALLED:
            continue
        owners = dpkg_owners(program)
        if any(is_base(o) for o in owners) or (not owners and _venv_has(program)):
            continue
        problems[program] = (
            f"run by {sorted(files)[:3]}, shipped by {sorted(owners) or 'no'}"
            " package(s) install.sh installs: add its package to "
            "APT_PACKAGES and the program to PROGRAMS"
        )
    return problems


# --------------------------------------------------------------------------- tests


def test_every_program_used_is_installed_by_install_sh() -> None:
    used = programs_used(ROOT)
    for program in INDIRECT:
        used.setdefault(program, set()).add("(indirect)")
    # the scan sees what it must: a program of each kind of source
    for program, where in [
        ("podman", "fusion_oci"),
        ("chromedriver", "tests/"),
        ("dockerd-rootless.sh", "scripts/services.sh"),
        ("debootstrap", "fusion_oci/images/bootstrap.py"),
        ("rootlesskit", "scripts/services.sh"),
    ]:
        assert any(f.startswith(where) for f in used.get(program, ())), (program, where)
    assert classify(used, INSTALL_SH.read_text(encoding="utf-8")) == {}


def test_the_check_fails_when_install_sh_drops_a_package() -> None:
    real = INSTALL_SH.read_text(encoding="utf-8")
    assert unprovided(PROGRAMS, real) == []
    no_catatonit = re.sub(r"^\s*catatonit\n", "", real, flags=re.M)
    assert no_catatonit != real
    assert unprovided(PROGRAMS, no_catatonit) == ["catatonit"]
    assert list(classify({"catatonit": {"(indirect)"}}, no_catatonit)) == ["catatonit"]
    no_pnpm = real.replace("npm install -g pnpm@9", "true")
    assert unprovided(PROGRAMS, no_pnpm) == ["pnpm"]
    fake = "APT_PACKAGES=(\n    git  # a comment: podman\n    nodejs\n)\n"
    assert apt_packages(fake) == {"git", "nodejs"}
    assert unprovided({"git": "git", "podman": "podman"}, fake) == ["podman"]


def test_a_new_program_in_the_code_is_found_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program the table does not know, from no base package, fails the check."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "fusion-oci-fake-tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(
        "import subprocess\nsubprocess.run(['fusion-oci-fake-tool', '-x'])\n"
        "subprocess.run(['ls', '-l'])\n"
    )
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "s.sh").write_text(
        "f() { :; }\nf && FOO=1 sudo env catatonit --version | tar -x  # git\n"
    )
    used = programs_used(tmp_path, ["tests", "scripts"])
    assert set(used) == {"fusion-oci-fake-tool", "ls", "catatonit", "tar"}
    problems = classify(used, INSTALL_SH.read_text(encoding="utf-8"))
    assert list(problems) == ["fusion-oci-fake-tool"]  # ls and tar: coreutils, tar (Essential)


def test_the_table_names_the_package_that_ships_each_program() -> None:
    """On this machine (install.sh has run): dpkg says the table's package ships it."""
    wrong = {}
    for program, package in PROGRAMS.items():
        if package == "npm -g":
            assert shutil.which(program), program
            continue
        if package == "pip":
            assert _venv_has(program), program
            continue
        if program in ALTERNATIVES:
            real = shutil.which(program)
            assert real and os.path.realpath(real) == os.path.realpath(
                shutil.which(ALTERNATIVES[program]) or ""
            ), program
            continue
        owners = dpkg_owners(program)
        accepted = {package} | depends(package) | SUBSTITUTES.get(program, set())
        if not owners & accepted:
            wrong[program] = (package, sorted(owners))
    assert wrong == {}


def test_ci_runs_the_suite_on_debians_own_python() -> None:
    """install.sh makes the venv from /usr/bin/python3 unless PYTHON says otherwise, so CI
    (CI=true, .ci/run) runs on Debian 12's 3.11.2: no API of a later release sneaks in."""
    assert 'PYTHON="${PYTHON:-/usr/bin/python3}"' in INSTALL_SH.read_text(encoding="utf-8")
    if os.environ.get("CI") == "true":
        base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        assert base == "/usr/bin/python3.11", f"the suite runs on {base}, not Debian's python"
        assert sys.version_info[:3] == (3, 11, 2), sys.version


def test_data_that_looks_like_a_program_is_not_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only argv positions count: a machine with a ``project`` (or ``backend``) program on
    PATH does not fail the check because a list of the code's data starts with that word."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("project", "backend", "fusion-oci-fake-tool"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "fusion_oci").mkdir()
    (tmp_path / "fusion_oci" / "m.py").write_text(
        "KEYS = ['project', 'worktree']\n"
        "table(['backend', 'runs', 'p50'], rows)\n"
        "fields = [('project', 'x')]\n"
        "argv = ['fusion-oci-fake-tool', '--flag'] + rest\n"
    )
    used = programs_used(tmp_path, ["fusion_oci"])
    assert set(used) == {"fusion-oci-fake-tool"}
    for code, program in [
        ("subprocess.check_output(['backend', '-x'])", "backend"),
        ("run(command=['project'])", "project"),
        ("spec = {'command': ['project', 'x']}", "project"),
        ("def kubectl_argv():\n    return ['project', 'get']\n", "project"),
        ("cmds = [['project', 'a'], ['backend', 'b']]", "backend"),
    ]:
        assert program in _python_programs(code), code
