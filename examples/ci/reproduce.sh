#!/bin/sh
# Reproduce a failed task run from its recording (the project's .fusion/ kept as a CI
# artifact: the audit log and the replay records), and turn it into a script anyone can run.
#
#   reproduce.sh PROJECT_DIR RUN_ID [BACKEND] [OUT_DIR]
#   FUSION_OCI_IMAGE=REF: the image the exported script names (default: the recorded one, or
#   the default task image for a run recorded on the host's directories, e.g. bubblewrap)
#
# Exits with the replayed command's status; OUT_DIR gets repro.json (recorded vs replayed
# outcome) and repro.sh (`fusion-oci export --format script`: the same environment, podman run).
set -u
project=$1 run_id=$2 backend=${3:-} out=${4:-repro-out}
mkdir -p "$out"

fusion-oci export "$run_id" --project-dir "$project" --format script -o "$out/repro.sh" \
    ${FUSION_OCI_IMAGE:+--image "$FUSION_OCI_IMAGE"} \
    2> "$out/export-notes.txt" || { cat "$out/export-notes.txt" >&2; exit 2; }

cd "$project" || exit 2
fusion-oci repro "$run_id" --project-dir "$project" ${backend:+--backend "$backend"} --json \
    > "$out/repro.json"
status=$?
python3 - "$out/repro.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if "error" in r:
    print("repro failed:", r["error"]["what"], "-", r["error"]["hint"]); sys.exit(0)
print(f"run {r['runId']} (task {r['taskId']}): worktree "
      + ("CHANGED: " + r["worktreeChange"] if r["worktreeChanged"] else "unchanged"))
for d in r["differences"]:
    print("  differs:", d)
for c in r["commands"]:
    rec, new = c["recorded"], c["replay"]
    print(f"  {c['command']!r}: recorded exit {rec['exitCode']} on {rec['backend']}, "
          f"replayed exit {new['exitCode']} on {new['backend']}; "
          f"stdout {'same' if c['sameStdout'] else 'differs'}")
PY
exit "$status"
