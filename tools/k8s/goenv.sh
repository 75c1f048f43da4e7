# shellcheck shell=bash
# Sourced by tools/k8s/*.sh: the Go caches live outside the clone, so a second run on the same
# machine reuses them (FUSION_OCI_K8S_CACHE, default /var/cache/fusion-oci/k8s).
K8S_CACHE="${FUSION_OCI_K8S_CACHE:-/var/cache/fusion-oci/k8s}"
export GOMODCACHE="$K8S_CACHE/gomod"
export GOCACHE="$K8S_CACHE/gocache"
export GOTOOLCHAIN=local
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED="${CGO_ENABLED:-0}"
