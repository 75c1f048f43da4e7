#!/usr/bin/env bash
# Build the cluster's binaries from the Go modules in tools/k8s into the cache folder:
#   kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl (k8s.io/kubernetes),
#   etcd (go.etcd.io/etcd/server/v3), kube-router (NetworkPolicy), agent-sandbox-controller.
# The output folder is keyed by the pinned versions, the generated modules and the Go version,
# so a second run on the same machine finds it complete and builds nothing:
#   $FUSION_OCI_K8S_CACHE/bin/<key>/   (default cache /var/cache/fusion-oci/k8s)
# The Go build and module caches live beside it (goenv.sh). Prints the bin folder on stdout;
# the build's own output goes to <cache>/build-<key>.log. The build runs under nice/ionice: the
# CI machine has two cores that other jobs share.
#   tools/k8s/build.sh            build when needed, print the bin folder
#   tools/k8s/build.sh --path     print the bin folder if it is complete, fail otherwise
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tools/k8s/versions.env
. "$HERE/versions.env"
# shellcheck source=tools/k8s/goenv.sh
. "$HERE/goenv.sh"

BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl etcd
    kube-router agent-sandbox-controller)

key="$( { cat "$HERE/versions.env" "$HERE/go.mod" "$HERE/go.sum" "$HERE/cmd/etcd/main.go" \
    "$HERE/agent-sandbox/go.mod" "$HERE/agent-sandbox/go.sum" "$HERE/kube-router/go.mod" \
    "$HERE/kube-router/go.sum"; go version; } \
    | sha256sum | cut -c1-16)"
out="$K8S_CACHE/bin/$key"
log="$K8S_CACHE/build-$key.log"

if [[ -f "$out/.complete" ]]; then echo "$out"; exit 0; fi
if ! go version >/dev/null 2>&1 || [[ "$(go env GOVERSION)" < go1.24 ]]; then
    echo "build.sh: Kubernetes $KUBERNETES_VERSION needs Go 1.24 or newer (found: $(go version 2>&1))." \
        "hint: Debian 12's golang-go (1.19) is too old; install Go from go.dev into /usr/local/go" >&2
    exit 1
fi
if [[ "${1:-}" == --path ]]; then
    echo "build.sh: no complete build at $out: run tools/k8s/build.sh (or scripts/install.sh)" >&2
    exit 1
fi

mkdir -p "$out" "$K8S_CACHE"
exec 9>"$K8S_CACHE/build.lock"
flock 9   # one build at a time; a second caller waits and then finds it complete
if [[ -f "$out/.complete" ]]; then echo "$out"; exit 0; fi

slow=(nice -n 19)
command -v ionice >/dev/null && slow+=(ionice -c3)

# `kubectl version` and the API server's /version report these (else they say v0.0.0). The
# build date is the release's own (the module's publication time), so the build is repeatable.
minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
date="$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" \
    | sed -n 's/^[[:space:]]*"Time": "\(.*\)",*$/\1/p' | head -1)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=${date:-1970-01-01T00:00:00Z}"
done

t0=$SECONDS
{
    echo "== build $key at $(date -u +%FT%TZ): kubernetes $KUBERNETES_VERSION etcd $ETCD_VERSION" \
        "agent-sandbox $AGENT_SANDBOX_VERSION kube-router $KUBE_ROUTER_VERSION"
    cd "$HERE"
    "${slow[@]}" go build -trimpath -ldflags "$ldflags" -o "$out/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet \
        k8s.io/kubernetes/cmd/kubectl
    echo "kubernetes done after $((SECONDS - t0)) s"
    "${slow[@]}" go build -trimpath -ldflags "-s -w" -o "$out/etcd" ./cmd/etcd
    cd "$HERE/kube-router"
    kr=github.com/cloudnativelabs/kube-router/v2
    "${slow[@]}" go build -trimpath -o "$out/kube-router" \
        -ldflags "-s -w -X $kr/pkg/version.Version=$KUBE_ROUTER_VERSION -X $kr/pkg/version.BuildDate=release" \
        $kr/cmd/kube-router
    cd "$HERE/agent-sandbox"
    "${slow[@]}" go build -trimpath -ldflags "-s -w" -o "$out/agent-sandbox-controller" \
        sigs.k8s.io/agent-sandbox/cmd/agent-sandbox-controller
    # the CRDs ship in the agent-sandbox module
    src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/agent-sandbox)"
    mkdir -p "$out/agent-sandbox"
    cp "$src"/k8s/crds/*.yaml "$src/k8s/rbac.generated.yaml" "$out/agent-sandbox/"
    chmod -R u+w "$out/agent-sandbox"
    # the pause container's source (scripts/cluster.sh compiles it static with gcc)
    cd "$HERE"
    cp "$(go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c" "$out/pause.c"
    chmod u+w "$out/pause.c"
    echo "== done in $((SECONDS - t0)) s"
} >>"$log" 2>&1 || { echo "build.sh: build failed, see $log" >&2; tail -n 20 "$log" >&2; exit 1; }
for b in "${BINARIES[@]}"; do [[ -x "$out/$b" ]] || { echo "build.sh: $b missing in $out" >&2; exit 1; }; done
echo "$((SECONDS - t0))" >"$out/.build-seconds"
touch "$out/.complete"
echo "$out"
