#!/usr/bin/env bash
# Runs every benchmark in benchmarks/ (per-command overhead of each runtime, as ratios; the
# dashboard API on 100,000 audit events).
# Needs what scripts/test.sh needs: the engines running (this starts them if they are not, and
# stops only what it started) and the node task image (built by the test suite, or with
# `.venv/bin/fusion-oci images build node`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STARTED_FILE="$(mktemp)"
cleanup() {
    if [[ -s "$STARTED_FILE" ]]; then
        # shellcheck disable=SC2046
        bash scripts/services.sh stop $(sort -u "$STARTED_FILE") || true
    fi
    rm -f "$STARTED_FILE"
}
trap cleanup EXIT
FUSION_OCI_STARTED_FILE="$STARTED_FILE" bash scripts/services.sh start >/dev/null
eval "$(bash scripts/services.sh env)"
# bench_serve drives the TypeScript client from Node: build it first (install.sh ran npm ci).
(cd clients/typescript && npm run --silent build)
for bench in native bubblewrap oci tiers containers serve startup dashboard; do
    .venv/bin/python "benchmarks/bench_${bench}.py" "$@"
done
