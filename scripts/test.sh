#!/usr/bin/env bash
# The one command that runs the whole fusion-oci test suite on a fresh Debian 12 machine
# (as root or with sudo):
#   1. scripts/install.sh           packages, .venv (from /usr/bin/python3 unless PYTHON=...),
#                                    rootless test user, podman runtime drop-in
#   2. scripts/services.sh start    dockerd, rootful and rootless podman API services, a rootless
#                                    dockerd (the rootless ones as the unprivileged test user)
#   2b. scripts/cluster.sh start   the two-node Kubernetes cluster tests/cluster/ runs against
#                                    (its binaries were built by install.sh; a cluster that
#                                    already runs is used and left running; skipped, with
#                                    tests/cluster/ left out, with FUSION_OCI_SKIP_CLUSTER=1)
#   3. ruff check, ruff format --check, mypy   (skipped with FUSION_OCI_SKIP_LINT=1)
#   4. pytest "$@"                   with FUSION_OCI_REQUIRE_BACKENDS=all: a missing backend fails
#   5. clients/typescript: tsc --strict, then `node --test` against the real server
#      (skipped with FUSION_OCI_SKIP_TS=1, e.g. when running a few pytest files by hand)
# On exit it stops only the services that step 2 started in this invocation; services that were
# already running before are left running. Exits non-zero when pytest or the TypeScript tests
# fail; "no tests collected" (pytest's 5) is reported as a failure too.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

say() { printf '[test] %s\n' "$*"; }
t0=$SECONDS

if [[ "$(id -u)" -eq 0 ]]; then SUDO=(); else SUDO=(sudo); fi

say "== install ($(date -u +%H:%M:%S))"
bash scripts/install.sh

STARTED_FILE="$(mktemp "${TMPDIR:-/tmp}/fusion-oci-started.XXXXXX")"
CLUSTER_STARTED=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -s "$STARTED_FILE" ]]; then
        # shellcheck disable=SC2046
        say "== stopping the services this run started: $(sort -u "$STARTED_FILE" | tr '\n' ' ')"
        "${SUDO[@]}" bash "$ROOT/scripts/services.sh" stop $(sort -u "$STARTED_FILE") || true
    fi
    rm -f "$STARTED_FILE"
    if [[ "$CLUSTER_STARTED" == 1 ]]; then
        say "== stopping the cluster this run started (logs stay in /var/lib/fusion-oci-cluster/logs)"
        "${SUDO[@]}" bash "$ROOT/scripts/cluster.sh" stop || true
    fi
    say "total time $((SECONDS - t0)) s, exit status $rc"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say "== services"
t1=$SECONDS
"${SUDO[@]}" env FUSION_OCI_STARTED_FILE="$STARTED_FILE" bash scripts/services.sh start
say "services ready in $((SECONDS - t1)) s"
eval "$(bash scripts/services.sh env)"

PYTEST_EXTRA=()
if [[ "${FUSION_OCI_SKIP_CLUSTER:-0}" == 1 ]]; then
    say "== cluster skipped (FUSION_OCI_SKIP_CLUSTER=1): tests/cluster left out"
    PYTEST_EXTRA+=(--ignore=tests/cluster)
elif "${SUDO[@]}" bash scripts/cluster.sh status >/dev/null 2>&1; then
    say "== cluster: already running, using it (and leaving it running)"
else
    say "== cluster"
    t1=$SECONDS
    CLUSTER_STARTED=1
    # a cluster that does not come up fails its tests (required below), not the whole run
    # (install.sh built the binaries: a build that failed there is not tried a third time)
    # one more try after a failed start (it stopped what it started): a start that failed
    # once in CI took every kubernetes test with it, and its words were the only trace
    if "${SUDO[@]}" env FUSION_OCI_CLUSTER_BUILD=0 bash scripts/cluster.sh start \
        || { say "cluster start failed; trying once more"; sleep 5
             "${SUDO[@]}" env FUSION_OCI_CLUSTER_BUILD=0 bash scripts/cluster.sh start; }; then
        say "cluster ready in $((SECONDS - t1)) s"
    else
        say "FAILED: scripts/cluster.sh start (logs in /var/lib/fusion-oci-cluster/logs)"
    fi
fi
eval "$(bash scripts/cluster.sh env)"
export FUSION_OCI_REQUIRE_BACKENDS=all
export PATH="$ROOT/.venv/bin:$PATH"
bash scripts/services.sh env | sed 's/^/[test]   /'
say "  export FUSION_OCI_REQUIRE_BACKENDS=all"

if [[ "${FUSION_OCI_SKIP_LINT:-0}" != 1 ]]; then
    say "== ruff check fusion_oci tests"
    .venv/bin/ruff check fusion_oci tests
    say "== ruff format --check"
    .venv/bin/ruff format --check fusion_oci tests benchmarks scripts hatch_build.py
    say "== mypy"
    .venv/bin/mypy
else
    say "== lint skipped (FUSION_OCI_SKIP_LINT=1)"
fi

say "== pytest $*"
rc=0
.venv/bin/python -m pytest ${PYTEST_EXTRA[@]+"${PYTEST_EXTRA[@]}"} "$@" || rc=$?
if ((rc == 5)); then
    say "FAILED: pytest collected no tests (exit 5)"
elif ((rc != 0)); then
    say "FAILED: pytest exit status $rc"
fi

if [[ "${FUSION_OCI_SKIP_TS:-0}" != 1 ]]; then
    say "== clients/typescript: tsc + node --test"
    ts_rc=0
    ts_out=$(mktemp /tmp/fusion-oci-ts.XXXXXX)
    set +o pipefail
    (cd clients/typescript && FUSION_OCI_PYTHON="$ROOT/.venv/bin/python" npm test) 2>&1 \
        | tee "$ts_out"
    ts_rc=${PIPESTATUS[0]}
    set -o pipefail
    if ((ts_rc != 0)); then
        # The failures again, at the end where a log's tail shows them: each `not ok` with
        # its YAML block (the error and where it was thrown).
        say "TypeScript failures:"
        awk '/^ *not ok /{on=1} on{print} on && /^ *\.\.\.$/{on=0}' "$ts_out" | head -200
        say "FAILED: TypeScript tests exit status $ts_rc"
        ((rc != 0)) || rc=$ts_rc
    fi
    rm -f "$ts_out"
else
    say "== TypeScript tests skipped (FUSION_OCI_SKIP_TS=1)"
fi
exit "$rc"
