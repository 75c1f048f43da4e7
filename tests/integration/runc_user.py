"""Running a written rootless bundle with runc as the unprivileged CI user (the rootless
runc tests of the oci and filtered-egress modules)."""

from __future__ import annotations

import pwd
import subprocess
from pathlib import Path


def run_bundle_as(
    account: pwd.struct_passwd, base: Path, bundle: Path, cid: str
) -> subprocess.CompletedProcess[str]:
    """Give ``base`` (which holds ``bundle``) to ``account``, run the bundle as container
    ``cid`` with that user's runc state under ``base/state``, and delete the container
    whatever the run did."""
    subprocess.run(["chown", "-R", f"{account.pw_uid}:{account.pw_gid}", str(base)], check=True)
    as_user = ["runuser", "-u", account.pw_name, "--", "runc", "--root", str(base / "state")]
    done = subprocess.run(
        [*as_user, "run", "--bundle", str(bundle), cid],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=base,
        stdin=subprocess.DEVNULL,
    )
    subprocess.run([*as_user, "delete", "--force", cid], capture_output=True, check=False, cwd=base)
    return done
