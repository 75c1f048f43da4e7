#!/usr/bin/env bash
# Runs every benchmark in benchmarks/ and writes docs/performance.md from their sections.
#
#   bash scripts/bench.sh [--runs N]       (extra arguments go to every benchmark)
#
# Each benchmarks/bench_NAME.py writes its section with --markdown into a temporary folder;
# benchmarks/report.py puts a header describing the machine on top and the sections below, in
# a fixed order. A benchmark that fails is named in its section's place (the others still run).
# Needs what scripts/test.sh needs: the engines running (this starts them if they are not, and
# stops only what it started) and the node task image (built by the test suite, or with
# `.venv/bin/fusion-oci images build node`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
STARTED_FILE="$(mktemp)"
FRAGMENTS="$(mktemp -d)"
cleanup() {
    if [[ -s "$STARTED_FILE" ]]; then
        # shellcheck disable=SC2046
        bash scripts/services.sh stop $(sort -u "$STARTED_FILE") || true
    fi
    rm -rf "$STARTED_FILE" "$FRAGMENTS"
}
trap cleanup EXIT
FUSION_OCI_STARTED_FILE="$STARTED_FILE" bash scripts/services.sh start >/dev/null
eval "$(bash scripts/services.sh env)"
# bench_serve drives the TypeScript client from Node: build it first (install.sh ran npm ci).
(cd clients/typescript && npm run --silent build)
failed=()
for path in benchmarks/bench_*.py; do
    name="$(basename "$path" .py)"
    name="${name#bench_}"
    echo "== bench_${name}" >&2
    if ! "$PYTHON" "$path" --markdown "$FRAGMENTS/$name.md" "$@"; then
        echo "bench_${name} failed" >&2
        rm -f "$FRAGMENTS/$name.md"
        failed+=("$name")
    fi
done
"$PYTHON" benchmarks/report.py "$FRAGMENTS" --out docs/performance.md --failed "${failed[@]}"
if ((${#failed[@]})); then
    echo "failed: ${failed[*]} (docs/performance.md says so in their sections)" >&2
    exit 1
fi
