#!/bin/sh
# Prebuild the task images a project's settings name, through a cache folder CI keeps between
# runs (examples/ci/github-actions.yml). Tags are content hashes of the image definitions, so
# a cached image is used exactly when its definition is unchanged; prebuild builds the rest.
#
#   prebuild.sh PROJECT_DIR CACHE_DIR [ENGINE]        ENGINE: podman (default) or docker
set -eu
project=$1 cache=$2 engine=${3:-podman}
mkdir -p "$cache"
archive="$cache/task-images-$engine.tar"

if [ -s "$archive" ]; then
    echo "prebuild: loading cached images from $archive"
    "$engine" load -i "$archive" >/dev/null
fi

# ${FUSION_OCI_BASE:-} = offline on machines without a registry (fusion-oci images bootstrap-base)
fusion-oci images prebuild --project "$project" --engine "$engine" \
    ${FUSION_OCI_BASE:+--base "$FUSION_OCI_BASE"} --json > "$cache/prebuild.json"

# What the settings name now, as fusion-oci resolved it: save exactly those for the next run.
refs=$(python3 -c 'import json, sys
print(" ".join(sorted({r["reference"] for r in json.load(open(sys.argv[1]))})))' "$cache/prebuild.json")
if [ -z "$refs" ]; then
    echo "prebuild: the settings name no image (sandbox.image)"; exit 0
fi
actions=$(python3 -c 'import json, sys
print(" ".join(sorted({r["action"] for r in json.load(open(sys.argv[1]))})))' "$cache/prebuild.json")
if [ "$actions" = present ] && [ -s "$archive" ]; then
    echo "prebuild: cache hit ($refs)"; exit 0
fi
echo "prebuild: saving $refs to $archive ($actions)"
# shellcheck disable=SC2086  # one word per reference
"$engine" save -o "$archive.tmp" $refs && mv "$archive.tmp" "$archive"
