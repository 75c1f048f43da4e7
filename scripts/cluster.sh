#!/usr/bin/env bash
# A real two-node Kubernetes cluster on this machine, for the tests and for trying the
# kubernetes runtime by hand:
#
#   scripts/cluster.sh start            build (cached) and start everything, wait until both nodes
#                                       are Ready and the add-ons answer
#   scripts/cluster.sh stop             end every process, mount, netns, cgroup and firewall rule
#                                       of the cluster; keeps $STATE (logs, PKI, imported images)
#   scripts/cluster.sh status           say what runs (exit 1 when the cluster is not up)
#   scripts/cluster.sh env              the `export` lines (KUBECONFIG, the kubectl folder, ...)
#   scripts/cluster.sh load-image REF   import podman's image REF into both nodes (the tests
#                                       import the node task image the suite builds)
#   scripts/cluster.sh kill-node NODE   SIGKILL one worker (kubelet, containerd, its shims and pods)
#                                       as a crashed machine would lose them (tests/cluster)
#   scripts/cluster.sh clean            stop, then remove $STATE entirely
#
# Layout (addresses are private ranges this machine does not use, and none of the ranges the
# engines' bridges or the tests take: 10.213/16, 10.214/16, 172.17/16):
#
#   host ── foci-k8s0 10.231.255.1/30 ══ veth ══ up0 10.231.255.2 ─┐ netns foci-k8s-hub
#                                                            br0 10.231.0.1/24 (the nodes' LAN)
#        netns foci-k8s-cp  eth0 10.231.0.10  etcd (loopback only), kube-apiserver :6443,
#                                             controller-manager, scheduler, agent-sandbox
#        netns foci-k8s-n1  eth0 10.231.0.11  containerd, kubelet, kube-router (NetworkPolicy);
#                                             pods 10.232.1.0/24 on its bridge cni0
#        netns foci-k8s-n2  eth0 10.231.0.12  the same; pods 10.232.2.0/24
#
# Pod-to-pod traffic across nodes is routed (each node and the hub have a route per pod CIDR).
# Pods reach the package registries through the machine's own outbound path: the host NATs
# the cluster's ranges out of its default-route interface, for DNS and HTTP(S) only, the way
# the engines' bridges do; the host's own addresses and any other interface are dropped.
# The service CIDR 10.233.0.0/24 exists for the API server; there is no kube-proxy (the tests
# and the agent-sandbox controller talk to pods directly).
#
# Every process runs in a cgroup under /sys/fs/cgroup/*/fusion-oci-cluster (the pods under the
# kubelets' cgroup roots there), is recorded in a pidfile, and is stopped by pid: first the
# pidfiles' pids (SIGTERM), then whatever the cluster's cgroups still hold. Nothing is found or
# stopped by name. Logs of every component stay in $STATE/logs after `stop`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${FUSION_OCI_CLUSTER_STATE:-/var/lib/fusion-oci-cluster}"
RUN="$STATE/run"          # pidfiles, sockets, per-start state: emptied by stop
LOGS="$STATE/logs"
PKI="$STATE/pki"
IMAGES="$STATE/images"
CG=fusion-oci-cluster     # the cgroup (every v1 hierarchy) holding every process of the cluster
NODES=(n1 n2)
HUB_NS=foci-k8s-hub
CP_NS=foci-k8s-cp
HOST_IF=foci-k8s0
HOST_IP=10.231.255.1
HUB_UP_IP=10.231.255.2
HUB_IP=10.231.0.1
CP_IP=10.231.0.10
NODE_NET=10.231.0.0/16
POD_NET=10.232.0.0/16
SERVICE_CIDR=10.233.0.0/24
API="https://$CP_IP:6443"
CHAIN_FWD=FOCI-K8S-FWD
CHAIN_IN=FOCI-K8S-IN
CHAIN_NAT=FOCI-K8S-NAT
PAUSE_IMAGE=localhost/fusion-oci/pause:3.10
START_TIMEOUT="${FUSION_OCI_CLUSTER_TIMEOUT:-240}"

node_ns() { echo "foci-k8s-$1"; }
node_ip() { case "$1" in n1) echo 10.231.0.11 ;; n2) echo 10.231.0.12 ;; esac; }
node_pod_cidr() { case "$1" in n1) echo 10.232.1.0/24 ;; n2) echo 10.232.2.0/24 ;; esac; }
node_name() { echo "fusion-oci-$1"; }

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ "$(id -u)" -ne 0 && "${1:-}" != env ]]; then
    command -v sudo >/dev/null 2>&1 || die "must run as root"
    exec sudo --preserve-env=FUSION_OCI_CLUSTER_STATE,FUSION_OCI_K8S_CACHE,FUSION_OCI_CLUSTER_BUILD bash "${BASH_SOURCE[0]}" "$@"
fi

# the binaries: built when missing (FUSION_OCI_CLUSTER_BUILD=0: only a complete cached build)
bin_dir() {
    if [[ "${FUSION_OCI_CLUSTER_BUILD:-1}" == 0 ]]; then
        bash "$ROOT/tools/k8s/build.sh" --path
    else
        bash "$ROOT/tools/k8s/build.sh"
    fi
}
# The cluster's network namespaces are bind-mounted in $RUN/netns, not /run/netns: other
# programs on a shared machine remount /run/netns (seen here: the netns mounts of a running
# cluster vanished under it), and `ip netns exec` does not work here anyway.
NETNS_DIR="$RUN/netns"
ns_path() { echo "$NETNS_DIR/$1"; }
in_ns() { local ns="$1"; shift; nsenter --net="$(ns_path "$ns")" -- "$@"; }
ns_add() {  # a new network namespace, held by a bind mount of ours
    mkdir -p "$NETNS_DIR"
    touch "$(ns_path "$1")"
    unshare --net="$(ns_path "$1")" true
}
ns_del() {
    local p
    p="$(ns_path "$1")"
    if [[ -e "$p" ]]; then
        umount "$p" 2>/dev/null || umount -l "$p" 2>/dev/null || true
        rm -f "$p"
    fi
}
kubectl_() { "$BIN/kubectl" --kubeconfig "$STATE/admin.kubeconfig" "$@"; }

# ------------------------------------------------------------------ cgroups
cg_hierarchies() {  # every mounted cgroup v1 hierarchy (and the unified one of a hybrid host)
    local d
    for d in /sys/fs/cgroup/*/; do
        d="${d%/}"
        [[ -f "$d/cgroup.procs" ]] && echo "$d"
    done
    if [[ -f /sys/fs/cgroup/cgroup.procs ]]; then echo /sys/fs/cgroup; fi
}
cg_make() {  # cg_make REL: REL in every hierarchy (cpuset gets its parent's cpus and mems)
    local h rel="$1" path part
    for h in $(cg_hierarchies); do
        path="$h"
        IFS=/ read -ra parts <<<"$rel"
        for part in "${parts[@]}"; do
            [[ -n "$part" ]] || continue
            if [[ ! -d "$path/$part" ]]; then
                mkdir "$path/$part"
                if [[ -f "$path/cpuset.cpus" && -f "$path/$part/cpuset.cpus" ]]; then
                    cat "$path/cpuset.cpus" >"$path/$part/cpuset.cpus"
                    cat "$path/cpuset.mems" >"$path/$part/cpuset.mems"
                fi
            fi
            path="$path/$part"
        done
    done
}
cg_join() {  # cg_join REL PID: move PID into REL in every hierarchy
    local h
    for h in $(cg_hierarchies); do echo "$2" >"$h/$1/cgroup.procs"; done
}
cg_pids() {  # every pid in the cluster's cgroups (any hierarchy), once
    local h
    for h in $(cg_hierarchies); do
        if [[ -d "$h/$CG" ]]; then find "$h/$CG" -name cgroup.procs -exec cat {} + 2>/dev/null || true; fi
    done | sort -un
}
cg_remove() {
    local h
    for h in $(cg_hierarchies); do
        [[ -d "$h/$CG" ]] || continue
        find "$h/$CG" -depth -type d -exec rmdir {} + 2>/dev/null || true
        [[ ! -d "$h/$CG" ]] || log "WARNING: could not remove cgroup $h/$CG"
    done
}

# ------------------------------------------------------------------ processes
pidfile_pid() { if [[ -s "$1" ]]; then tr -dc '0-9' <"$1"; fi; }
alive() { [[ "$1" =~ ^[0-9]+$ ]] && kill -0 "$1" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null; }
# ours PID: alive and in the cluster's cgroup (a recorded pid reused by another process is not)
ours() { alive "$1" && grep -q ":/$CG/" "/proc/$1/cgroup" 2>/dev/null; }

# launch NAME NETNS CGROUP CMD...: run CMD in NETNS as its own session, in the cgroup
# $CG/CGROUP, stdio to $LOGS/NAME.log, pid to $RUN/NAME.pid
launch() {
    local name="$1" ns="$2" cg="$3"
    shift 3
    cg_make "$CG/$cg"
    (
        cg_join "$CG/$cg" "$BASHPID"
        cd /
        exec nsenter --net="$(ns_path "$ns")" -- setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1
    ) &
    echo "$!" >"$RUN/$name.pid"
    log "$name: pid $! (log $LOGS/$name.log)"
}

stop_pidfile() {  # stop_pidfile NAME [TIMEOUT_S]: SIGTERM the recorded pid, then SIGKILL
    local name="$1" timeout="${2:-20}" pid i
    pid="$(pidfile_pid "$RUN/$name.pid")"
    if [[ -n "$pid" ]] && ours "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < timeout * 10; i++)); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then
            log "$name: pid $pid still alive after ${timeout} s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$RUN/$name.pid"
}

sweep_cgroups() {  # SIGKILL whatever is still in the cluster's cgroups (shims, containers)
    local round pids
    for ((round = 0; round < 50; round++)); do
        pids="$(cg_pids)"
        [[ -n "$pids" ]] || return 0
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 0.2
    done
    log "WARNING: processes left in the cluster's cgroups: $(cg_pids | tr '\n' ' ')"
}

# ------------------------------------------------------------------ network
net_up() {
    local n ns other dev
    dev="$(ip -4 route show default | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')"
    [[ -n "$dev" ]] || die "no default route on this machine: pods could not reach the registries"
    echo "$dev" >"$RUN/uplink"
    for ns in "$HUB_NS" "$CP_NS" "${NODES[@]/#/foci-k8s-}"; do
        [[ -e "$(ns_path "$ns")" ]] && die "netns $ns exists: run '$0 stop' first"
    done
    ip route show | grep -qE '^10\.23[123]\.' && die "routes for 10.231-233 exist on this machine: another cluster or network uses them"

    ns_add "$HUB_NS"
    in_ns "$HUB_NS" ip link set lo up
    in_ns "$HUB_NS" ip link add br0 type bridge
    in_ns "$HUB_NS" ip addr add "$HUB_IP/24" dev br0
    in_ns "$HUB_NS" ip link set br0 up
    ip link add "$HOST_IF" type veth peer name up0 netns "$(ns_path "$HUB_NS")"
    ip addr add "$HOST_IP/30" dev "$HOST_IF"
    ip link set "$HOST_IF" up
    in_ns "$HUB_NS" ip addr add "$HUB_UP_IP/30" dev up0
    in_ns "$HUB_NS" ip link set up0 up
    in_ns "$HUB_NS" ip route add default via "$HOST_IP"
    in_ns "$HUB_NS" sysctl -qw net.ipv4.ip_forward=1
    ip route add "$NODE_NET" via "$HUB_UP_IP" dev "$HOST_IF"
    ip route add "$POD_NET" via "$HUB_UP_IP" dev "$HOST_IF"

    attach() {  # attach NS IP: a netns on the hub's bridge
        ns_add "$1"
        in_ns "$1" ip link set lo up
        in_ns "$HUB_NS" ip link add "v-${1#foci-k8s-}" type veth peer name eth0 netns "$(ns_path "$1")"
        in_ns "$HUB_NS" ip link set "v-${1#foci-k8s-}" master br0 up
        in_ns "$1" ip addr add "$2/24" dev eth0
        in_ns "$1" ip link set eth0 up
        in_ns "$1" ip route add default via "$HUB_IP"
    }
    attach "$CP_NS" "$CP_IP"
    for n in "${NODES[@]}"; do
        ns="$(node_ns "$n")"
        attach "$ns" "$(node_ip "$n")"
        in_ns "$ns" sysctl -qw net.ipv4.ip_forward=1
        # bridged pod-to-pod traffic on one node must pass netfilter for NetworkPolicy
        in_ns "$ns" sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
        in_ns "$HUB_NS" ip route add "$(node_pod_cidr "$n")" via "$(node_ip "$n")"
        for other in "${NODES[@]}"; do
            [[ "$other" == "$n" ]] && continue
            in_ns "$ns" ip route add "$(node_pod_cidr "$other")" via "$(node_ip "$other")"
        done
    done

    # the host: NAT out of the uplink for DNS and HTTP(S) only; nothing else leaves, and
    # nothing from the cluster reaches the host itself (replies to the host's own connections,
    # e.g. kubectl to the API server, pass as ESTABLISHED)
    iptables -N "$CHAIN_FWD"
    iptables -A "$CHAIN_FWD" -o "$HOST_IF" -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
    iptables -A "$CHAIN_FWD" -i "$HOST_IF" -o "$dev" -p udp --dport 53 -j ACCEPT
    iptables -A "$CHAIN_FWD" -i "$HOST_IF" -o "$dev" -p tcp -m multiport --dports 53,80,443 -j ACCEPT
    iptables -A "$CHAIN_FWD" -i "$HOST_IF" -j DROP
    iptables -A "$CHAIN_FWD" -o "$HOST_IF" -j DROP
    iptables -I FORWARD 1 -j "$CHAIN_FWD"
    iptables -N "$CHAIN_IN"
    iptables -A "$CHAIN_IN" -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
    iptables -A "$CHAIN_IN" -j DROP
    iptables -I INPUT 1 -i "$HOST_IF" -j "$CHAIN_IN"
    iptables -t nat -N "$CHAIN_NAT"
    iptables -t nat -A "$CHAIN_NAT" -s "$NODE_NET" -o "$dev" -j MASQUERADE
    iptables -t nat -A "$CHAIN_NAT" -s "$POD_NET" -o "$dev" -j MASQUERADE
    iptables -t nat -I POSTROUTING 1 -j "$CHAIN_NAT"
    if [[ "$(cat /proc/sys/net/ipv4/ip_forward)" != 1 ]]; then
        echo 0 >"$RUN/host-ip-forward-was"
        sysctl -qw net.ipv4.ip_forward=1
    fi
}

net_down() {
    local ns
    while iptables -D FORWARD -j "$CHAIN_FWD" 2>/dev/null; do :; done
    while iptables -D INPUT -i "$HOST_IF" -j "$CHAIN_IN" 2>/dev/null; do :; done
    while iptables -t nat -D POSTROUTING -j "$CHAIN_NAT" 2>/dev/null; do :; done
    iptables -F "$CHAIN_FWD" 2>/dev/null && iptables -X "$CHAIN_FWD"
    iptables -F "$CHAIN_IN" 2>/dev/null && iptables -X "$CHAIN_IN"
    iptables -t nat -F "$CHAIN_NAT" 2>/dev/null && iptables -t nat -X "$CHAIN_NAT"
    if [[ -f "$RUN/host-ip-forward-was" ]]; then
        sysctl -qw net.ipv4.ip_forward="$(cat "$RUN/host-ip-forward-was")"
        rm -f "$RUN/host-ip-forward-was"
    fi
    ip link del "$HOST_IF" 2>/dev/null || true   # its routes go with it
    for ns in "${NODES[@]/#/foci-k8s-}" "$CP_NS" "$HUB_NS"; do
        ns_del "$ns"
    done
    return 0
}

# ------------------------------------------------------------------ PKI (openssl, EC P-256)
cert() {  # cert NAME CN [O] [SAN]: $PKI/NAME.{key,crt} signed by the cluster CA
    local name="$1" cn="$2" org="${3:-}" san="${4:-}" subj
    [[ -s "$PKI/$name.crt" ]] && return 0
    subj="/CN=$cn"
    [[ -n "$org" ]] && subj="/O=$org$subj"
    openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/$name.key" 2>/dev/null
    openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
    {
        echo "basicConstraints=CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=serverAuth,clientAuth"
        if [[ -n "$san" ]]; then echo "subjectAltName=$san"; fi
    } >"$PKI/$name.ext"
    openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" \
        -CAcreateserial -days 3650 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
    rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

kubeconfig() {  # kubeconfig FILE CERTNAME
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: fusion-oci
  cluster:
    server: $API
    certificate-authority: $PKI/ca.crt
users:
- name: $2
  user:
    client-certificate: $PKI/$2.crt
    client-key: $PKI/$2.key
contexts:
- name: fusion-oci
  context: {cluster: fusion-oci, user: $2}
current-context: fusion-oci
EOF
}

pki() {
    mkdir -p "$PKI"
    chmod 700 "$PKI"
    if [[ ! -s "$PKI/ca.crt" ]]; then
        openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/ca.key" 2>/dev/null
        openssl req -x509 -new -key "$PKI/ca.key" -subj "/CN=fusion-oci-cluster-ca" -days 3650 \
            -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$PKI/ca.crt" 2>/dev/null
    fi
    [[ -s "$PKI/sa.key" ]] || openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/sa.key" 2>/dev/null
    [[ -s "$PKI/sa.pub" ]] || openssl ec -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
    cert apiserver kube-apiserver "" \
        "IP:$CP_IP,IP:10.233.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
    cert admin fusion-oci-admin system:masters
    cert controller-manager system:kube-controller-manager
    cert scheduler system:kube-scheduler
    # the agent-sandbox controller and kube-router (a test cluster: they get cluster-admin
    # through their group)
    cert agent-sandbox agent-sandbox-controller system:masters
    cert netpol kube-router system:masters
    local n
    for n in "${NODES[@]}"; do
        cert "kubelet-$n" "system:node:$(node_name "$n")" system:nodes
        cert "kubelet-$n-serving" "$(node_name "$n")" "" "IP:$(node_ip "$n"),DNS:$(node_name "$n")"
    done
    kubeconfig "$STATE/admin.kubeconfig" admin
    kubeconfig "$RUN/controller-manager.kubeconfig" controller-manager
    kubeconfig "$RUN/scheduler.kubeconfig" scheduler
    kubeconfig "$RUN/agent-sandbox.kubeconfig" agent-sandbox
    kubeconfig "$RUN/netpol.kubeconfig" netpol
    for n in "${NODES[@]}"; do kubeconfig "$RUN/kubelet-$n.kubeconfig" "kubelet-$n"; done
}

# ------------------------------------------------------------------ images
# The pause image: Kubernetes' own pause.c (in the k8s.io/kubernetes module), compiled static.
# The task image: the project's node image (images/node) as the podman engine holds it.
# Both go to the nodes as OCI archives (`podman save --format oci-archive`, `ctr images import`).
images_prepare() {
    mkdir -p "$IMAGES"
    if [[ ! -s "$IMAGES/pause.oci.tar" ]]; then
        local tmp
        tmp="$(mktemp -d "$STATE/pause.XXXXXX")"
        gcc -Os -s -static -DVERSION=v3.10-fusion-oci -o "$tmp/pause" "$BIN/pause.c"
        tar -C "$tmp" -cf "$tmp/rootfs.tar" pause
        podman import --change 'ENTRYPOINT ["/pause"]' "$tmp/rootfs.tar" "$PAUSE_IMAGE" >/dev/null
        podman save --format oci-archive -o "$IMAGES/pause.oci.tar.tmp" "$PAUSE_IMAGE" >/dev/null 2>&1
        mv "$IMAGES/pause.oci.tar.tmp" "$IMAGES/pause.oci.tar"
        rm -rf "$tmp"
    fi
    local ref
    # (awk reads all of podman's output: `head -1` exiting first would SIGPIPE podman, and
    # under pipefail the assignment fails and set -e ends the start, as it did once there
    # were two node images)
    ref="${FUSION_OCI_CLUSTER_NODE_IMAGE:-$(podman images --sort created --format '{{.Repository}}:{{.Tag}}' \
        --filter reference='localhost/fusion-oci/node:*' 2>/dev/null | awk 'NR == 1')}"
    if [[ -z "$ref" || "$ref" == *"<none>"* ]]; then
        log "images: no localhost/fusion-oci/node image in podman yet: the cluster starts without" \
            "a task image ('$0 load-image REF' imports one later; the cluster tests do)"
        return 0
    fi
    # The tests load the image they need (load-image): a node image that cannot be saved now
    # (one another podman command is removing) leaves the nodes without one, not the start
    # failed.
    (save_node_image "$ref") || log "images: could not save $ref from podman; the cluster starts without a task image"
}

save_node_image() {  # save_node_image REF: the podman image REF as an archive, once per image id
    local ref="$1" id
    id="$(podman image inspect --format '{{.Id}}' "$ref")" || die "no image $ref in podman"
    if [[ ! -s "$IMAGES/node-$id.oci.tar" ]]; then
        rm -f "$IMAGES"/node-*.tar
        log "images: saving $ref from podman"
        podman save --format oci-archive -o "$IMAGES/node-$id.oci.tar.tmp" "$ref" >/dev/null 2>&1
        mv "$IMAGES/node-$id.oci.tar.tmp" "$IMAGES/node-$id.oci.tar"
    fi
    echo "$ref" >"$RUN/node-image"
    echo "$IMAGES/node-$id.oci.tar" >"$RUN/node-image-archive"
}

images_import() {  # images_import NODE: import both archives unless this node already has them
    local n="$1" sock="$RUN/$1/containerd.sock" ref archive
    ref="$(cat "$RUN/node-image" 2>/dev/null || true)"
    archive="$(cat "$RUN/node-image-archive" 2>/dev/null || true)"
    local have
    have="$(ctr -a "$sock" -n k8s.io images ls -q 2>/dev/null || true)"
    if ! grep -qxF "$PAUSE_IMAGE" <<<"$have"; then
        ctr -a "$sock" -n k8s.io images import --base-name "${PAUSE_IMAGE%:*}" \
            "$IMAGES/pause.oci.tar" >/dev/null
    fi
    [[ -n "$ref" ]] || return 0
    if ! grep -qxF "$ref" <<<"$have" || [[ "$(cat "$STATE/$n/node-image-archive" 2>/dev/null)" != "$archive" ]]; then
        log "$n: importing $ref"
        ctr -a "$sock" -n k8s.io images import --base-name "${ref%:*}" "$archive" >/dev/null
        echo "$archive" >"$STATE/$n/node-image-archive"
    fi
}

# ------------------------------------------------------------------ node config
containerd_config() {
    local n="$1" d="$STATE/$1"
    mkdir -p "$d/containerd" "$RUN/$n/containerd-state" "$d/cni/net.d"
    cat >"$RUN/$n/containerd.toml" <<EOF
version = 2
root = "$d/containerd"
state = "$RUN/$n/containerd-state"
oom_score = 0
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "$RUN/$n/containerd.sock"
[ttrpc]
  address = "$RUN/$n/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # no CAP_SYS_RESOURCE here: never lower a container's OOM score below containerd's own
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  max_container_log_line_size = 16384
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "/usr/sbin/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$d/cni/net.d"
    max_conf_num = 1
EOF
    cat >"$d/cni/net.d/10-fusion-oci.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "foci-k8s-$n",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$RUN/$n/cni-ipam",
        "ranges": [[{"subnet": "$(node_pod_cidr "$n")"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

kubelet_config() {
    local n="$1"
    mkdir -p "$RUN/$n/kubelet" "$RUN/$n/pod-logs"
    cat >"$RUN/$n/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $(node_ip "$n")
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $PKI/kubelet-$n-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-$n-serving.key
# no systemd on these machines; a cgroup v1 (hybrid) host
cgroupDriver: cgroupfs
cgroupRoot: /$CG/$n
failCgroupV1: false
containerRuntimeEndpoint: unix://$RUN/$n/containerd.sock
podLogsDir: $RUN/$n/pod-logs
resolvConf: /etc/resolv.conf
failSwapOn: false
registerNode: true
nodeStatusUpdateFrequency: 4s
nodeStatusReportFrequency: 10s
syncFrequency: 10s
fileCheckFrequency: 10s
serializeImagePulls: false
maxPods: 60
# the machine's disk is shared: never evict for it, never garbage-collect the imported images
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
shutdownGracePeriod: 0s
rotateCertificates: false
serverTLSBootstrap: false
EOF
}

# ------------------------------------------------------------------ waits
wait_until() {  # wait_until WHAT TIMEOUT PIDNAME CMD...: poll CMD; fail early if PIDNAME died
    local what="$1" timeout="$2" pidname="$3" t0=$SECONDS pid
    shift 3
    until "$@" >/dev/null 2>&1; do
        if [[ -n "$pidname" ]]; then
            pid="$(pidfile_pid "$RUN/$pidname.pid")"
            if ! alive "$pid"; then
                log "$pidname exited before $what; last lines of $LOGS/$pidname.log:"
                tail -n 30 "$LOGS/$pidname.log" >&2 || true
                return 1
            fi
        fi
        if ((SECONDS - t0 >= timeout)); then
            log "no $what after ${timeout} s${pidname:+; last lines of $LOGS/$pidname.log:}"
            [[ -z "$pidname" ]] || tail -n 30 "$LOGS/$pidname.log" >&2 || true
            return 1
        fi
        sleep 0.3
    done
    log "$what after $((SECONDS - t0)) s"
}
api_ready() { kubectl_ get --raw /readyz; }
crds_established() {  # every CRD of agent-sandbox's manifests says Established=True
    local f name
    for f in "$BIN"/agent-sandbox/*_*.yaml; do
        name="$(basename "$f" .yaml)"
        name="${name#*_}.${name%%_*}"
        [[ "$(kubectl_ get crd "$name" \
            -o 'jsonpath={.status.conditions[?(@.type=="Established")].status}' 2>/dev/null)" == True ]] \
            || return 1
    done
}
nodes_ready() {
    local n out
    out="$(kubectl_ get nodes -o jsonpath='{range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}')"
    for n in "${NODES[@]}"; do grep -qx "$(node_name "$n")=True" <<<"$out" || return 1; done
}

# ------------------------------------------------------------------ start
start_node() {
    local n="$1" ns
    ns="$(node_ns "$n")"
    mkdir -p "$RUN/$n"
    cg_make "$CG/$n"   # the kubelet's cgroupRoot: its pods go below it
    containerd_config "$n"
    kubelet_config "$n"
    launch "containerd-$n" "$ns" "$n-containerd" containerd --config "$RUN/$n/containerd.toml"
}

start_netpol() {  # after the node registered: kube-router looks its node up once, at start
    local n="$1" ns
    ns="$(node_ns "$n")"
    # NetworkPolicy: kube-router's firewall only (iptables + ipset in the node's netns)
    launch "netpol-$n" "$ns" "$n-netpol" "$BIN/kube-router" --kubeconfig "$RUN/netpol.kubeconfig" \
        --run-firewall=true --run-router=false --run-service-proxy=false \
        --hostname-override "$(node_name "$n")" --service-cluster-ip-range "$SERVICE_CIDR" \
        --enable-ipv4=true --enable-ipv6=false --enable-cni=false \
        --iptables-sync-period 1m --metrics-port 0 --health-port 20244 --v=1
}

SECCOMP_PROFILE="fusion-oci/task.json"   # kubernetes.seccompProfile of the tests' settings

seccomp_profile() {  # seccomp_profile NODE: the bundle's profile as a Localhost profile there
    local dir="$RUN/$1/kubelet/seccomp/${SECCOMP_PROFILE%/*}"
    mkdir -p "$dir"
    # What a team does once per node (docs/kubernetes.md): the profile every local bundle has,
    # in the OCI form containerd's CRI loads for a Localhost profile.
    PYTHONPATH="$ROOT" python3 -S -c 'import json, platform, sys
from fusion_oci.oci.seccomp import default_profile
json.dump(default_profile(platform.machine()), sys.stdout)' >"$dir/${SECCOMP_PROFILE##*/}.tmp"
    mv "$dir/${SECCOMP_PROFILE##*/}.tmp" "$dir/${SECCOMP_PROFILE##*/}"
}

start_node_agents() {
    local n="$1" ns
    ns="$(node_ns "$n")"
    seccomp_profile "$n"
    launch "kubelet-$n" "$ns" "$n-kubelet" "$BIN/kubelet" \
        --config "$RUN/$n/kubelet.yaml" --kubeconfig "$RUN/kubelet-$n.kubeconfig" \
        --root-dir "$RUN/$n/kubelet" --cert-dir "$RUN/$n/kubelet/pki" \
        --hostname-override "$(node_name "$n")" --node-ip "$(node_ip "$n")" --v=1
}

cmd_start() {
    local t0=$SECONDS n
    if [[ -s "$RUN/apiserver.pid" ]] && alive "$(pidfile_pid "$RUN/apiserver.pid")"; then
        die "the cluster runs already (scripts/cluster.sh status); stop it first"
    fi
    command -v containerd >/dev/null || die "containerd not found: run scripts/install.sh"
    BIN="$(bin_dir)" || die "the Kubernetes build failed (see above)"
    # a start that fails half-way leaves nothing running (its logs stay for the diagnosis)
    trap 'rc=$?; trap - EXIT; if ((rc != 0)); then
        log "start failed: stopping what it started (logs in $LOGS)"; cleanup_all quiet; fi
        exit $rc' EXIT
    # leftovers of a crashed run (processes are gone: cmd_stop ends them all)
    cleanup_all quiet
    mkdir -p "$RUN" "$LOGS"
    # the logs of the previous run are kept one run back
    if compgen -G "$LOGS/*.log" >/dev/null; then
        rm -rf "$LOGS.previous"
        mv "$LOGS" "$LOGS.previous"
        mkdir -p "$LOGS"
    fi
    echo "$BIN" >"$RUN/bin"
    # folders the kubelet and the CNI library make in fixed places: removed by stop (when
    # empty) if they did not exist before the cluster's first start
    local d
    for d in /var/lib/cni /var/lib/cni/results /var/log/containers; do
        if [[ ! -e "$d" ]] && ! grep -qxF "$d" "$STATE/created-dirs" 2>/dev/null; then
            echo "$d" >>"$STATE/created-dirs"
        fi
    done
    cg_make "$CG"
    net_up
    pki
    images_prepare &
    local images_pid=$!

    launch etcd "$CP_NS" etcd "$BIN/etcd" --name fusion-oci --data-dir "$RUN/etcd" \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster fusion-oci=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381 \
        --quota-backend-bytes 1073741824 --unsafe-no-fsync --log-level warn
    for n in "${NODES[@]}"; do start_node "$n"; done
    launch apiserver "$CP_NS" apiserver "$BIN/kube-apiserver" \
        --etcd-servers http://127.0.0.1:2379 --bind-address "$CP_IP" --advertise-address "$CP_IP" \
        --secure-port 6443 --service-cluster-ip-range "$SERVICE_CIDR" \
        --client-ca-file "$PKI/ca.crt" --tls-cert-file "$PKI/apiserver.crt" \
        --tls-private-key-file "$PKI/apiserver.key" \
        --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
        --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
        --kubelet-certificate-authority "$PKI/ca.crt" --kubelet-preferred-address-types InternalIP \
        --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
        --allow-privileged=true --profiling=false \
        --default-not-ready-toleration-seconds 10 --default-unreachable-toleration-seconds 10 \
        --v=1
    wait_until "API server ready" 90 apiserver api_ready || die "the API server did not come up"
    launch controller-manager "$CP_NS" controller-manager "$BIN/kube-controller-manager" \
        --kubeconfig "$RUN/controller-manager.kubeconfig" \
        --authentication-kubeconfig "$RUN/controller-manager.kubeconfig" \
        --authorization-kubeconfig "$RUN/controller-manager.kubeconfig" \
        --bind-address 127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
        --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
        --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
        --node-monitor-period 2s --node-monitor-grace-period 16s --v=1
    launch scheduler "$CP_NS" scheduler "$BIN/kube-scheduler" \
        --kubeconfig "$RUN/scheduler.kubeconfig" \
        --authentication-kubeconfig "$RUN/scheduler.kubeconfig" \
        --authorization-kubeconfig "$RUN/scheduler.kubeconfig" \
        --bind-address 127.0.0.1 --leader-elect=false --v=1
    # agent-sandbox: its CRDs and RBAC from the module, its controller with the extensions
    # (SandboxTemplate, SandboxClaim, SandboxWarmPool)
    kubectl_ apply --server-side -f "$BIN/agent-sandbox/" >"$LOGS/agent-sandbox-apply.log" 2>&1 \
        || { tail -n 20 "$LOGS/agent-sandbox-apply.log" >&2; die "could not apply agent-sandbox's CRDs"; }
    # each CRD by name, polled: `kubectl wait crd --all` right after the apply can list none
    # yet and fail at once ("no matching resources"), which ended a CI start once
    wait_until "agent-sandbox's CRDs established" 120 apiserver crds_established || {
        kubectl_ get crd -o wide >&2 || true
        die "agent-sandbox's CRDs were not established"
    }
    launch agent-sandbox "$CP_NS" agent-sandbox "$BIN/agent-sandbox-controller" \
        --kubeconfig "$RUN/agent-sandbox.kubeconfig" --extensions --leader-elect=false \
        --metrics-bind-address 127.0.0.1:8080 --health-probe-bind-address 127.0.0.1:8081

    wait "$images_pid" || die "could not prepare the images"
    for n in "${NODES[@]}"; do
        wait_until "containerd $n answering" 60 "containerd-$n" \
            ctr -a "$RUN/$n/containerd.sock" version || die "containerd on $n did not come up"
    done
    local ipids=()
    for n in "${NODES[@]}"; do images_import "$n" & ipids+=("$!"); done
    for n in "${ipids[@]}"; do wait "$n" || die "image import failed"; done
    for n in "${NODES[@]}"; do start_node_agents "$n"; done
    wait_until "both nodes Ready" "$START_TIMEOUT" "" nodes_ready || {
        for n in "${NODES[@]}"; do tail -n 20 "$LOGS/kubelet-$n.log" >&2 || true; done
        die "the nodes did not become Ready"
    }
    for n in "${NODES[@]}"; do start_netpol "$n"; done
    for n in "${NODES[@]}"; do
        wait_until "kube-router on $n healthy" 60 "netpol-$n" \
            in_ns "$(node_ns "$n")" curl -sf http://127.0.0.1:20244/healthz \
            || die "kube-router on $n did not come up"
    done
    wait_until "agent-sandbox controller healthy" 60 agent-sandbox \
        in_ns "$CP_NS" curl -sf http://127.0.0.1:8081/readyz || die "agent-sandbox did not come up"
    trap - EXIT
    echo "$((SECONDS - t0))" >"$RUN/start-seconds"
    log "cluster up in $((SECONDS - t0)) s: $(kubectl_ get nodes --no-headers | awk '{print $1 "=" $2}' | tr '\n' ' ')"
    log "use it: eval \"\$($0 env)\", then \$FUSION_OCI_K8S_BIN/kubectl get nodes"
}

# ------------------------------------------------------------------ stop
# cleanup_all [quiet]: everything the cluster made outside $STATE's kept files. Safe to run
# when nothing runs, and after a crash (what is gone is skipped).
cleanup_all() {
    local n name pid addr
    # 1. graceful: nodes' agents first, then the control plane
    for n in "${NODES[@]}"; do stop_pidfile "kubelet-$n" 20; stop_pidfile "netpol-$n" 10; done
    for name in agent-sandbox scheduler controller-manager; do stop_pidfile "$name" 10; done
    # 2. the containers, through their containerd while it answers (so shims exit cleanly)
    for n in "${NODES[@]}"; do
        local sock="$RUN/$n/containerd.sock" ids
        pid="$(pidfile_pid "$RUN/containerd-$n.pid")"
        if [[ -n "$pid" ]] && ours "$pid" && ctr -a "$sock" version >/dev/null 2>&1; then
            ids="$(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null || true)"
            for name in $ids; do ctr -a "$sock" -n k8s.io tasks kill -s SIGKILL "$name" >/dev/null 2>&1 || true; done
            for name in $ids; do
                ctr -a "$sock" -n k8s.io tasks delete -f "$name" >/dev/null 2>&1 || true
            done
            ids="$(ctr -a "$sock" -n k8s.io containers ls -q 2>/dev/null || true)"
            for name in $ids; do ctr -a "$sock" -n k8s.io containers delete "$name" >/dev/null 2>&1 || true; done
        fi
        # the shims' sockets live in /run/containerd/s (containerd's fixed place): remember ours
        for addr in "$RUN/$n"/containerd-state/io.containerd.runtime.v2.task/*/*/address; do
            [[ -f "$addr" ]] && sed 's|^unix://||' "$addr" >>"$RUN/shim-sockets"
        done
        stop_pidfile "containerd-$n" 20
    done
    stop_pidfile apiserver 10
    stop_pidfile etcd 10
    # 3. whatever is left in the cluster's cgroups: shims, containers, a killed node's pods
    sweep_cgroups
    # 4. mounts under $STATE (pod volumes, rootfs overlays, netns binds), deepest first
    local m
    for ((round = 0; round < 5; round++)); do
        m="$(awk -v s="$STATE/" 'index($5, s) == 1 {print $5}' /proc/self/mountinfo | sort -r)"
        [[ -n "$m" ]] || break
        for name in $m; do umount "$name" 2>/dev/null || umount -l "$name" 2>/dev/null || true; done
    done
    # 5. files the runtime keeps in fixed places outside $STATE
    if [[ -f "$RUN/shim-sockets" ]]; then
        while read -r addr; do [[ "$addr" == /run/containerd/s/* ]] && rm -f "$addr"; done <"$RUN/shim-sockets"
        rm -f "$RUN/shim-sockets"
    fi
    for addr in /var/log/containers/*.log; do
        [[ -L "$addr" && "$(readlink "$addr")" == "$STATE/"* ]] && rm -f "$addr"
    done
    # the CNI library's cache of each pod sandbox's networks (ours name a netns under $STATE):
    # a sandbox removed without CNI DEL (a killed node, stop's direct removal) leaves them
    local f
    for f in /var/lib/cni/results/*; do
        if [[ -f "$f" ]] && grep -qF "$STATE/" "$f"; then rm -f "$f"; fi
    done
    # 6. network (netns, veths, routes, iptables), 7. cgroups
    net_down
    cg_remove
    if [[ -f "$STATE/created-dirs" ]]; then
        # the ones not empty yet (another program's files in them) stay listed for next time
        tac "$STATE/created-dirs" | while read -r d; do rmdir "$d" 2>/dev/null || true; done
        local kept
        kept="$(while read -r d; do if [[ -e "$d" ]]; then echo "$d"; fi; done <"$STATE/created-dirs")"
        if [[ -n "$kept" ]]; then echo "$kept" >"$STATE/created-dirs"; else rm -f "$STATE/created-dirs"; fi
    fi
    [[ "${1:-}" == quiet ]] || log "stopped; logs kept in $LOGS"
    # the per-start state (etcd data, kubelet dirs, sockets): a fresh cluster on every start
    rm -rf "$RUN"
}

cmd_kill_node() {
    local n="${1:-}" h pids
    [[ " ${NODES[*]} " == *" $n "* ]] || die "kill-node: want one of: ${NODES[*]}"
    # everything of that node: kubelet, containerd (with its shims), kube-router,
    # and its pods, all at once with SIGKILL, as when the machine behind it dies
    for ((round = 0; round < 20; round++)); do
        pids="$(for h in $(cg_hierarchies); do
            for c in "$h/$CG/$n" "$h/$CG/$n-kubelet" "$h/$CG/$n-containerd" "$h/$CG/$n-netpol"; do
                if [[ -d "$c" ]]; then find "$c" -name cgroup.procs -exec cat {} + 2>/dev/null || true; fi
            done
        done | sort -un)"
        [[ -n "$pids" ]] || break
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 0.2
    done
    log "node $n killed (kubelet, containerd, kube-router, shims and pods)"
}

cmd_load_image() {  # load-image REF: import a podman image into both nodes (once)
    local ref="${1:-}" n
    [[ -n "$ref" ]] || die "load-image: want an image reference (a localhost/fusion-oci/node:TAG of podman's)"
    [[ -d "$RUN" ]] || die "the cluster is not running"
    mkdir -p "$IMAGES"
    save_node_image "$ref"
    local pids=()
    for n in "${NODES[@]}"; do images_import "$n" & pids+=("$!"); done
    for n in "${pids[@]}"; do wait "$n" || die "image import failed"; done
    log "$ref is in both nodes"
}

cmd_status() {
    local name pid rc=0
    [[ -d "$RUN" ]] || { echo "cluster: down"; return 1; }
    for name in etcd apiserver controller-manager scheduler agent-sandbox \
        containerd-n1 kubelet-n1 netpol-n1 containerd-n2 kubelet-n2 netpol-n2; do
        pid="$(pidfile_pid "$RUN/$name.pid")"
        if [[ -n "$pid" ]] && alive "$pid"; then echo "$name: running (pid $pid)"
        else echo "$name: not running"; rc=1; fi
    done
    BIN="$(cat "$RUN/bin" 2>/dev/null || true)"
    if [[ -n "$BIN" ]] && nodes_ready; then echo "nodes: Ready"; else echo "nodes: not Ready"; rc=1; fi
    return $rc
}

cmd_env() {
    local bin
    bin="$(cat "$RUN/bin" 2>/dev/null || bash "$ROOT/tools/k8s/build.sh" --path 2>/dev/null || true)"
    echo "export KUBECONFIG=$STATE/admin.kubeconfig"
    echo "export FUSION_OCI_CLUSTER_STATE=$STATE"
    echo "export FUSION_OCI_K8S_BIN=$bin"
    echo "export FUSION_OCI_K8S_NODE_IMAGE=$(cat "$RUN/node-image" 2>/dev/null || true)"
    echo "export FUSION_OCI_K8S_HUB_NETNS=$(ns_path "$HUB_NS")"
    echo "export FUSION_OCI_K8S_HUB_IP=$HUB_IP"
    echo "export FUSION_OCI_K8S_HOST_IP=$HOST_IP"
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cleanup_all ;;
    status) cmd_status ;;
    env) cmd_env ;;
    kill-node) shift; cmd_kill_node "$@" ;;
    load-image) shift; cmd_load_image "$@" ;;
    clean) cleanup_all quiet; rm -rf "$STATE"; log "removed $STATE" ;;
    *) echo "usage: $0 start|stop|status|env|kill-node NODE|load-image REF|clean" >&2; exit 2 ;;
esac
