#!/usr/bin/env bash
# Install everything the fusion-oci test suite needs on Debian 12 (as root, or with sudo).
# Idempotent and quick to re-run:
#   * apt-get runs only when a package is missing (apt-get update only then, too);
#   * .venv is created only when it does not exist, its python is unusable, or it was made from
#     another interpreter than $PYTHON (default Debian's /usr/bin/python3);
#   * `pip install -e '.[dev]'` is skipped when pyproject.toml has not changed since the last
#     successful install (FUSION_OCI_FORCE_PIP=1 forces it);
#   * the rootless test user (for rootless podman and rootless dockerd), /dev/net/tun access and
#     the podman runtime drop-in are checked and fixed only when needed.
# Env knobs: PYTHON (the venv's interpreter, default /usr/bin/python3),
# FUSION_OCI_ROOTLESS_USER (default fusionci), FUSION_OCI_FORCE_PIP=1.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ROOTLESS_USER="${FUSION_OCI_ROOTLESS_USER:-fusionci}"
HOST_CA=/etc/ssl/certs/ca-certificates.crt
DROPIN=/etc/containers/containers.conf.d/50-fusion-oci.conf

log() { printf '[install] %s\n' "$*"; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ "$(id -u)" -eq 0 ]]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    die "must run as root or have sudo"
fi
as_root() { "${SUDO[@]}" "$@"; }

# --------------------------------------------------------------------------- apt packages
APT_PACKAGES=(
    podman bubblewrap crun runc uidmap slirp4netns fuse-overlayfs debootstrap docker.io
    # rootless Docker (scripts/services.sh docker-rootless): docker.io ships dockerd-rootless.sh,
    # which runs dockerd under rootlesskit (with uidmap's newuidmap and slirp4netns above)
    rootlesskit
    # tini-static: the oci runtime's container init (the command is not pid 1)
    tini
    # podman's pause binary: `podman kube play` (tests/integration/test_export.py) execs it
    catatonit
    golang-github-opencontainers-specs-dev git nodejs npm iproute2
    # the registry tests/integration/test_provision_retry.py starts on a loopback port
    docker-registry
    # the host service tests/integration/test_host_services.py starts on loopback (initdb and
    # postgres of postgresql-15) and reaches from inside each runtime (psql, pg_isready)
    postgresql postgresql-client-common
    # libseccomp: pyseccomp (pyproject.toml) loads it to compile the seccomp profile to BPF
    libseccomp2
    # gVisor: the oci backend with ociRuntime runsc (a userspace kernel boundary)
    runsc
    # pytest-docker drives compose.yaml (the egress canary) with `docker-compose` when the
    # docker CLI has no compose plugin
    docker-compose
    # the dashboard's browser tests drive Debian's headless chromium through chromedriver
    chromium chromium-driver
    # not named in the product docs, but a fresh Debian 12 may lack them and the scripts use them
    python3 python3-venv curl ca-certificates util-linux procps
    # a C compiler and a static libc: the wheel's build hook (hatch_build.py) compiles the exec
    # agent (fusion_oci/agent/agent.c) into a static binary
    gcc libc6-dev
    # mkfs.xfs: tests/integration/test_store_reflink.py makes an XFS (reflink) on a loop device
    xfsprogs
    # the test cluster (scripts/cluster.sh): each node's container runtime and its `ctr`, the
    # pods' network (bridge, host-local, portmap), the host's NAT, the cluster's PKI, the
    # ipset tool kube-router's NetworkPolicy firewall runs
    containerd containernetworking-plugins iptables openssl ipset
)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "install ok installed" ]] && continue
    # A Node.js from another source (e.g. nodesource's nodejs, which ships npm itself and
    # conflicts with Debian's npm package) is fine as long as the commands work.
    if [[ "$pkg" == npm ]] && command -v npm >/dev/null 2>&1; then continue; fi
    if [[ "$pkg" == nodejs ]] && command -v node >/dev/null 2>&1; then continue; fi
    missing+=("$pkg")
done
if ((${#missing[@]})); then
    log "apt: installing missing packages: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
else
    log "apt: all ${#APT_PACKAGES[@]} packages already installed, skipping apt-get"
fi

# --------------------------------------------------------------------------- pnpm
# The bubblewrap tests run the host's pnpm inside the sandbox (tests/data/pnpm-project).
# npm reads the host CA from its own config here (cafile in the global npmrc) when behind a proxy.
if command -v pnpm >/dev/null 2>&1; then
    log "pnpm: $(pnpm --version) already installed"
else
    log "pnpm: npm install -g pnpm@9"
    as_root env NODE_EXTRA_CA_CERTS="$HOST_CA" npm install -g pnpm@9
fi

# --------------------------------------------------------------------------- python venv
# Debian's own interpreter (3.11.2 on Debian 12) is the one users have; a newer python3 first
# on PATH (pyenv) is not. PYTHON=... picks another on purpose.
PYTHON="${PYTHON:-/usr/bin/python3}"
py_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; }
if ! py_ok "$PYTHON"; then
    if py_ok /usr/bin/python3; then PYTHON=/usr/bin/python3; else die "need python3 >= 3.11"; fi
fi

# The interpreter a venv was made from (its base executable, symlinks resolved), or nothing.
base_of() {
    "$1" -c 'import os, sys; print(os.path.realpath(getattr(sys, "_base_executable", "")
                                                    or sys.executable))' 2>/dev/null || true
}
want_base="$(base_of "$PYTHON")"
have_base=""
[[ -x .venv/bin/python ]] && py_ok .venv/bin/python && have_base="$(base_of .venv/bin/python)"
if [[ -n "$have_base" && "$have_base" == "$want_base" ]]; then
    log "venv: .venv exists ($(.venv/bin/python --version 2>&1), $have_base), reusing it"
else
    if [[ -e .venv ]]; then
        # A venv of another interpreter (a pyenv python first on PATH when it was made) would
        # run the suite on a python users of Debian 12 do not have.
        if [[ -n "$have_base" ]]; then
            log "venv: .venv was made from $have_base, not $want_base: recreating it"
        else
            log "venv: .venv exists but its python is unusable, recreating it"
        fi
        rm -rf .venv
    fi
    log "venv: creating .venv with $("$PYTHON" --version 2>&1) ($PYTHON)"
    "$PYTHON" -m venv .venv
fi

# The machine may sit behind a TLS-intercepting proxy whose CA is only in the host bundle.
# Pointing pip at the host bundle is harmless where there is no such proxy (the bundle holds
# the public CAs too), so use it whenever it exists and nothing else was configured.
if [[ -z "${PIP_CERT:-}" && -f "$HOST_CA" ]]; then
    export PIP_CERT="$HOST_CA"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1

STAMP=.venv/.fusion-oci-pip-stamp
want_stamp="$(sha256sum pyproject.toml | cut -d' ' -f1)"
have_stamp="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "${FUSION_OCI_FORCE_PIP:-0}" != 1 && "$want_stamp" == "$have_stamp" ]] \
    && .venv/bin/python -c 'import fusion_oci' 2>/dev/null; then
    log "pip: pyproject.toml unchanged since the last install, skipping pip install"
else
    log "pip: pip install -e '.[dev]'"
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    echo "$want_stamp" >"$STAMP"
fi
# The editable install compiled the exec agent; rebuild it when agent.c changed since.
log "agent: .venv/bin/python hatch_build.py"
.venv/bin/python hatch_build.py >/dev/null

# --------------------------------------------------------------------------- rootless user
if ! id -u "$ROOTLESS_USER" >/dev/null 2>&1; then
    log "user: creating unprivileged user $ROOTLESS_USER"
    as_root useradd -m -s /bin/bash "$ROOTLESS_USER"
else
    log "user: $ROOTLESS_USER exists"
fi
for f in /etc/subuid /etc/subgid; do
    if ! grep -q "^${ROOTLESS_USER}:" "$f" 2>/dev/null; then
        log "user: adding ${ROOTLESS_USER}:200000:65536 to $f"
        echo "${ROOTLESS_USER}:200000:65536" | as_root tee -a "$f" >/dev/null
    fi
done

# rootless slirp4netns networking needs to open /dev/net/tun as the unprivileged user
if [[ -e /dev/net/tun ]]; then
    if runuser -u "$ROOTLESS_USER" -- test -r /dev/net/tun -a -w /dev/net/tun 2>/dev/null \
        || { [[ "$(id -u)" -ne 0 ]] && test -r /dev/net/tun -a -w /dev/net/tun; }; then
        log "tun: /dev/net/tun already accessible"
    else
        log "tun: chmod 666 /dev/net/tun (was $(stat -c %a /dev/net/tun))"
        as_root chmod 666 /dev/net/tun
    fi
else
    log "tun: /dev/net/tun does not exist; rootless networking will be unavailable"
fi

# rootless storage: overlay, not podman's vfs fallback, which copies the whole image for every
# container (~18 s per container of the node image here, against ~0.05 s with overlay).
# Native rootless overlay needs Linux 5.13; older kernels get fuse-overlayfs.
user_home="$(getent passwd "$ROOTLESS_USER" | cut -d: -f6)"
storage_conf="$user_home/.config/containers/storage.conf"
want=$'[storage]\ndriver = "overlay"'
IFS=. read -r kmajor kminor _ <<<"$(uname -r)"
if (( kmajor < 5 || (kmajor == 5 && kminor < 13) )) && command -v fuse-overlayfs >/dev/null; then
    want+=$'\n\n[storage.options.overlay]\nmount_program = "'"$(command -v fuse-overlayfs)"'"'
fi
if [[ "$(cat "$storage_conf" 2>/dev/null)" != "$want" ]]; then
    log "rootless storage: overlay for $ROOTLESS_USER ($storage_conf)"
    as_root install -d -o "$ROOTLESS_USER" -g "$ROOTLESS_USER" "$user_home/.config" \
        "$user_home/.config/containers"
    printf '%s\n' "$want" | as_root tee "$storage_conf" >/dev/null
    as_root chown "$ROOTLESS_USER:" "$storage_conf"
    if [[ -d "$user_home/.local/share/containers/storage/vfs" ]]; then
        # Storage made with another driver cannot be opened with overlay: start it afresh
        # (a test account: its images are reloaded by the tests when needed).
        log "rootless storage: resetting $ROOTLESS_USER's old vfs storage"
        uid="$(id -u "$ROOTLESS_USER")"
        as_root runuser -u "$ROOTLESS_USER" -- env XDG_RUNTIME_DIR="/run/user/$uid" \
            podman system reset -f >/dev/null 2>&1 || true
    fi
fi

# --------------------------------------------------------------------------- podman runtime
# crun refuses cgroups v1/hybrid ("cgroups in hybrid mode not supported"); runc works there.
# A containers.conf drop-in is read by rootful and rootless podman alike (and by the API
# services), so nobody has to remember `--runtime runc`.
cgfs="$(stat -fc %T /sys/fs/cgroup 2>/dev/null || echo unknown)"
if [[ "$cgfs" == cgroup2fs ]]; then
    log "podman: unified cgroup v2 host, keeping podman's default runtime"
    if [[ -f "$DROPIN" ]]; then
        log "podman: note: $DROPIN (runtime=runc) exists from an earlier run; leaving it"
    fi
else
    want=$'# Written by fusion-oci scripts/install.sh: crun refuses cgroups v1/hybrid hosts.\n[engine]\nruntime = "runc"'
    if [[ -f "$DROPIN" && "$(cat "$DROPIN")" == "$want" ]]; then
        log "podman: $DROPIN already selects runc (cgroup fs is $cgfs)"
    else
        log "podman: cgroup fs is $cgfs (not cgroup2fs): writing $DROPIN with runtime = \"runc\""
        as_root mkdir -p "$(dirname "$DROPIN")"
        printf '%s\n' "$want" | as_root tee "$DROPIN" >/dev/null
    fi
fi

# --------------------------------------------------------------------------- TypeScript client
# clients/typescript (`node --test` in scripts/test.sh): typescript, @types/node and
# vscode-jsonrpc at the versions package-lock.json pins; `npm ci` only when the lock changed.
TS_DIR="$ROOT/clients/typescript"
ts_stamp="$TS_DIR/node_modules/.fusion-oci-lock.sha256"
ts_want="$(sha256sum "$TS_DIR/package-lock.json" | cut -d' ' -f1)"
if [[ -f "$ts_stamp" && "$(cat "$ts_stamp")" == "$ts_want" ]]; then
    log "npm: clients/typescript dependencies up to date"
else
    log "npm: npm ci in clients/typescript"
    (cd "$TS_DIR" && NODE_EXTRA_CA_CERTS="$HOST_CA" npm ci --no-audit --no-fund)
    printf '%s\n' "$ts_want" >"$ts_stamp"
fi

# --------------------------------------------------------------------------- Kubernetes build
# The test cluster's binaries (tools/k8s/build.sh: k8s.io/kubernetes, etcd, agent-sandbox,
# kube-network-policies from the Go module proxy), cached in /var/cache/fusion-oci/k8s keyed by
# the pinned versions: a cold build takes ~15-25 min on 2 cores, a warm check under a second.
# FUSION_OCI_SKIP_K8S_BUILD=1 skips it (the cluster tests then skip, or fail when required).
if [[ "${FUSION_OCI_SKIP_K8S_BUILD:-0}" == 1 ]]; then
    log "k8s: build skipped (FUSION_OCI_SKIP_K8S_BUILD=1)"
elif bin="$(as_root bash tools/k8s/build.sh --path 2>/dev/null)"; then
    log "k8s: binaries cached in $bin"
else
    log "k8s: building the cluster's binaries (log in /var/cache/fusion-oci/k8s/build-*.log)"
    t_k8s=$SECONDS
    # a second try after a failure (a transient proxy error: what was built stays cached); a
    # build that still fails does not stop the install: the cluster tests fail, not the rest
    if bin="$(as_root bash tools/k8s/build.sh)" || bin="$(as_root bash tools/k8s/build.sh)"; then
        log "k8s: built in $((SECONDS - t_k8s)) s into $bin"
    else
        log "k8s: BUILD FAILED after $((SECONDS - t_k8s)) s: the cluster (scripts/cluster.sh) cannot start"
    fi
fi

log "done"
