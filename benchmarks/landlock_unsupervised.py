"""The reaper shim with Landlock and (optionally) the seccomp filter but none of the
supervisor: ``python -S -E landlock_unsupervised.py [--no-seccomp] GRACE PARENT ... SANDBOX=FILE
-- ARGV``, the landlock runtime's own argv with this file in the reaper's place.

For benchmarks/workload_suspects.py only (the raw floor of the landlock runtime): step 5 of
fusion_oci/shims/confine.py (the notify filter that hands every open, chmod and connect to the
reaper) is skipped, so the child sends no listener and the reaper serves none;
``--no-seccomp`` also skips step 4 (the bundle's filter). Never a way to run a task: it
weakens the confinement.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fusion_oci" / "shims"))

import confine  # type: ignore[import-not-found]  # the reaper's sibling, as it imports it
import reaper  # type: ignore[import-not-found]


def _skip(*_args: object, **_kwargs: object) -> None:
    return None


if __name__ == "__main__":
    argv = list(sys.argv)
    if argv[1:2] == ["--no-seccomp"]:
        del argv[1]
        confine.install_seccomp = _skip
    # No listener: the child's end of the socket pair closes at exec, the reaper's recvmsg
    # returns no descriptor and no supervisor thread starts.
    confine.install_chmod_listener = _skip
    sys.exit(reaper.main(argv))
