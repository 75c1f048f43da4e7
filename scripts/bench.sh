#!/usr/bin/env bash
# Runs every benchmark in benchmarks/ and writes docs/performance.md from their sections.
#
#   bash scripts/bench.sh [--runs N]       (extra arguments go to every benchmark)
#   BENCHES="containers scale" bash scripts/bench.sh   (only these; the others' kept
#                                                       sections, if any, still go in)
#
# Each benchmarks/bench_NAME.py writes its section with --markdown into a temporary folder;
# benchmarks/report.py puts a header describing the machine on top and the sections below, in
# a fixed order. A benchmark that fails is named in its section's place (the others still run).
# Needs what scripts/test.sh needs: the engines running (this starts them if they are not, and
# stops only what it started) and the node task image (built by the test suite, or with
# `.venv/bin/fusion-oci images build node`).
# bench_workload takes a real project through every runtime (several minutes) and needs the
# npm registry (through the host's CA, as the contract suite's workload case does); it runs 3
# interleaved rounds whatever --runs says (BENCHES="..." without workload skips it). It also
# builds, once, the node task image for the host's Node.js version (the project copy pins it,
# so host and engines run the same Node.js; ~30 s on rootful podman, loaded into the others)
# and runs the raw engines and `runsc do` beside ours: the engines and runsc must be usable.
# bench_egress (the filtered network's proxy vs direct: set-up, 100 MB download, idle RSS) uses loopback only.
# bench_egress_isolation (one task's floods beside another task's tunnels on one proxy loop)
# uses loopback only.
# bench_worktree_sync (the kubernetes runtime's worktree transfer, one command's push + pull,
# between two local repositories over a pipe) needs git and python3 only.
# bench_services (host services through a grant vs direct loopback: per connection, per round trip, download) uses loopback only and runs bubblewrap, landlock, oci, podman and docker.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
STARTED_FILE="$(mktemp)"
# FUSION_OCI_BENCH_FRAGMENTS=DIR keeps the sections there (to re-run one benchmark and
# assemble again: benchmarks/report.py DIR).
FRAGMENTS="${FUSION_OCI_BENCH_FRAGMENTS:-$(mktemp -d)}"
mkdir -p "$FRAGMENTS"
cleanup() {
    if [[ -s "$STARTED_FILE" ]]; then
        # shellcheck disable=SC2046
        bash scripts/services.sh stop $(sort -u "$STARTED_FILE") || true
    fi
    rm -f "$STARTED_FILE"
    [[ -n "${FUSION_OCI_BENCH_FRAGMENTS:-}" ]] || rm -rf "$FRAGMENTS"
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
    if [[ -n "${BENCHES:-}" && " $BENCHES " != *" $name "* ]]; then
        continue
    fi
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
