"""A child subreaper that ends a whole process tree, including setsid'd and double-forked
descendants: ``python -S -E reaper.py GRACE PARENT [RLIMIT=SOFT:HARD ...] [SANDBOX=FILE]
[AGENT=FD] -- ARGV...``.

``SANDBOX=FILE`` (the landlock runtime): after the rlimits and before exec, the child confines
itself as FILE says (capabilities, no_new_privs, Landlock, seccomp; see confine.py);
anything failing there fails the command with 125 rather than run it unconfined.

``AGENT=FD`` (the landlock runtime): the command is the task's exec agent on connection FD.
The shim closes its own copy of FD after the fork (the host sees the connection end when the
agent does) and gives the agent ``--parent <the shim's pid>``, so the agent ends its runs'
trees and exits if the shim, whose thread is the seccomp supervisor of that whole tree, dies.

Why a separate process: making the caller's own process a subreaper would change the host
application's process state (orphans would re-parent to it). The shim owns that instead.
It runs with ``-S -E`` and imports only C-level standard modules (no json, no enum-based
``signal``): its start-up is paid by every command of sandbox-exec (and of native off Linux).
Native on Linux and landlock no longer pay it per command: native's exec agent
(fusion_oci/agent/agent.c) keeps the same semantics in a keeper per run; landlock starts one
shim per task, at prepare, whose confined child is that agent.

Behaviour: the command runs in the shim's process group. When the command exits, the shim
kills whatever it left running and exits with the command's status (or dies by its signal).
On SIGTERM/SIGINT/SIGHUP (timeout, abort, or the caller dying: PR_SET_PDEATHSIG), every
descendant gets SIGTERM, then SIGKILL after the grace period.

Off Linux (macOS) there is no subreaper and no PDEATHSIG: descendants are found with ``ps``
and the command's process group is signalled as well, so a child that both setsid()s and
double-forks can escape there; the native runtime's capabilities already promise no isolation.
"""

import _signal as signal  # type: ignore[import-not-found]  # C module: no enum import cost
import ctypes
import os
import resource
import sys
import time

if __package__:  # fusion_oci.shims.reaper (see fusion_oci/shims/__init__.py)
    from . import proctree
else:  # run by path: the siblings are on sys.path[0]
    import proctree  # type: ignore[import-not-found,no-redef]

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
LINUX = proctree.LINUX


def _signal_all(sig: int) -> int:
    pids = proctree.descendants(os.getpid())
    for pid in pids:
        try:  # noqa: SIM105 - contextlib costs start-up time here
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return len(pids)


_statuses: dict[int, int] = {}
_STOP = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
_WAIT = _STOP | {signal.SIGCHLD}


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _statuses[pid] = status


def _end_tree(grace: float) -> None:
    if _signal_all(signal.SIGTERM):
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            _reap()
            if not proctree.descendants(os.getpid()):
                return
            time.sleep(0.02)
    # SIGKILL until nothing is left; a fork bomb cannot outrun this for long.
    deadline = time.monotonic() + 10
    while _signal_all(signal.SIGKILL) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.01)
    _reap()


def _wait_signal() -> int:
    if hasattr(signal, "sigwaitinfo"):
        return int(signal.sigwaitinfo(_WAIT).si_signo)
    return int(signal.sigwait(_WAIT))  # macOS has only sigwait


def _confine(sandbox: tuple[dict, int]) -> None:  # type: ignore[type-arg]
    try:
        if __package__:
            from . import confine
        else:  # run by path (imported before the fork: nothing is read from disk here)
            import confine  # type: ignore[import-not-found,no-redef]

        confine.apply(*sandbox)
    except BaseException as exc:  # fail closed, whatever went wrong
        os.write(2, f"fusion-oci: cannot confine the command: {exc}\n".encode())
        os._exit(125)


def _exec_child(
    command: list[str],
    rlimits: list[tuple[int, int, int]],
    sandbox: tuple[dict, int] | None = None,  # type: ignore[type-arg]
) -> None:
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        inf = resource.RLIM_INFINITY
        for res, soft, hard in rlimits:
            want = (inf if soft < 0 else soft, inf if hard < 0 else hard)
            try:
                resource.setrlimit(res, want)
            except ValueError:
                # macOS caps NOFILE below its reported hard limit (kern.maxfilesperproc):
                # keep what the process has rather than fail the command.
                if res != resource.RLIMIT_NOFILE:
                    raise
        if sandbox is not None:
            _confine(sandbox)
        os.execvp(command[0], command)
    except FileNotFoundError:
        os.write(2, f"fusion-oci: {command[0]}: command not found\n".encode())
        os._exit(127)
    except OSError as exc:
        os.write(2, f"fusion-oci: {command[0]}: {exc.strerror}\n".encode())
        os._exit(126)


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    grace, parent = float(argv[1]), int(argv[2])
    rlimits = []
    sandbox = ""
    agent_fd = -1
    for item in argv[3:sep]:
        name, _, values = item.partition("=")
        if name == "SANDBOX":
            sandbox = values
            continue
        if name == "AGENT":
            agent_fd = int(values)
            continue
        soft, _, hard = values.partition(":")
        rlimits.append((getattr(resource, name), int(soft), int(hard)))
    command = argv[sep + 1 :]
    if agent_fd >= 0:
        command += ["--parent", str(os.getpid())]
    # Signals are blocked and taken synchronously with sigwaitinfo: no handler can interrupt
    # the bookkeeping of who exited how.
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAIT)
    if LINUX:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if parent and os.getppid() != parent:
        return 125  # the caller died before PDEATHSIG was armed
    confining = channel = None
    if sandbox:
        # The confinement's chmod supervisor lives here, outside the sandbox: the child hands
        # its seccomp listener back over this socket pair (confine.py, step 5).
        if __package__:
            from . import confine, seccomp_notify, supervisor
        else:  # run by path: only the landlock runtime pays for importing them
            import confine  # type: ignore[no-redef]
            import seccomp_notify  # type: ignore[import-not-found,no-redef]
            import supervisor  # type: ignore[import-not-found,no-redef]

        try:
            cfg = confine.load(sandbox)
        except (OSError, ValueError) as exc:
            os.write(2, f"fusion-oci: cannot confine the command: {exc}\n".encode())
            return 125
        channel, child_end = seccomp_notify.socketpair()
        confining = (cfg, child_end)
    pid = os.fork()
    if pid == 0:
        if channel is not None:
            channel.close()
        _exec_child(command, rlimits, confining)
    if agent_fd >= 0:
        os.close(agent_fd)  # the agent's alone: its end of the host's connection
    if channel is not None and confining is not None:
        os.close(confining[1])
        supervisor.supervise(confining[0], channel)
    while True:
        _reap()
        if pid in _statuses:
            _end_tree(0.2)  # the command is done: whatever it left running goes too
            break
        if _wait_signal() in _STOP:
            _end_tree(grace)
            break
    status = _statuses.get(pid, 0x9)  # never reaped: report SIGKILL
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        # Die by the same signal, so the caller sees what ended the command.
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
