#!/usr/bin/env bash
# Start/stop the engine services the fusion-oci tests talk to, and print their addresses.
#
#   scripts/services.sh start [SERVICE...]   start what is not answering yet, wait until it answers
#   scripts/services.sh stop  [SERVICE...]   stop what this script started (by pidfile only)
#   scripts/services.sh status               say which services answer
#   scripts/services.sh env                  print the `export` lines the tests use
#
# SERVICE is one of: docker podman docker-rootless podman-rootless (default: all four).
# State (pidfiles, logs, sockets) lives in /run/fusion-oci-ci; docker's data root is
# /var/lib/fusion-oci-ci/docker so images survive between runs on the same machine. The
# rootless engines (podman's API service and a rootless dockerd under rootlesskit) run as the
# unprivileged user $FUSION_OCI_ROOTLESS_USER (default fusionci), with their sockets and data
# in that user's own places (/run/user/UID, ~/.local/share), as the user's own setup would.
# `start` appends the names of the services it really started (not the ones that were already
# answering) to $FUSION_OCI_STARTED_FILE when that is set, so a caller can stop only those.
# Processes are only ever stopped by the pids recorded in the pidfiles (the machine is shared:
# no pkill/killall by name); the one addition is a killed rootless dockerd's left-over shims and
# containers, found by the containerd socket of that user's exec root that each shim names.
set -euo pipefail

STATE=/run/fusion-oci-ci
DATA=/var/lib/fusion-oci-ci
DOCKER_SOCK="$STATE/docker.sock"
DOCKER_PIDFILE="$STATE/dockerd.pid"
DOCKER_EXEC_ROOT="$STATE/docker-exec"
DOCKER_LOG="$STATE/dockerd.log"
DOCKER_HOST_FILE="$STATE/docker.host"   # written when an engine already at the system socket is reused
SYSTEM_DOCKER_SOCK=/var/run/docker.sock
PODMAN_SOCK="$STATE/podman.sock"
PODMAN_PIDFILE="$STATE/podman.pid"
PODMAN_LOG="$STATE/podman.log"
ROOTLESS_USER="${FUSION_OCI_ROOTLESS_USER:-fusionci}"
ROOTLESS_PIDFILE="$STATE/podman-rootless.pid"
ROOTLESS_LOG="$STATE/podman-rootless.log"
DOCKERLESS_PIDFILE="$STATE/docker-rootless.pid"   # rootlesskit's pid (the tree's top)
DOCKERLESS_LOG="$STATE/docker-rootless.log"
OCI_SCHEMA_DIR=/usr/share/gocode/src/github.com/opencontainers/runtime-spec/schema
DROPIN=/etc/containers/containers.conf.d/50-fusion-oci.conf
DOCKER_TIMEOUT="${FUSION_OCI_DOCKER_TIMEOUT:-60}"
PODMAN_TIMEOUT="${FUSION_OCI_PODMAN_TIMEOUT:-30}"
DOCKERLESS_TIMEOUT="${FUSION_OCI_DOCKER_ROOTLESS_TIMEOUT:-60}"
ALL_SERVICES=(docker podman docker-rootless podman-rootless)

log() { printf '[services] %s\n' "$*" >&2; }
die() { printf '[services] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ "$(id -u)" -ne 0 ]]; then
    if [[ "${1:-}" != env ]] && command -v sudo >/dev/null 2>&1; then
        exec sudo --preserve-env=FUSION_OCI_STARTED_FILE,FUSION_OCI_ROOTLESS_USER \
            bash "${BASH_SOURCE[0]}" "$@"
    fi
    [[ "${1:-}" == env ]] || die "must run as root (or with sudo)"
fi

rootless_uid() {
    id -u "$ROOTLESS_USER" 2>/dev/null \
        || die "user $ROOTLESS_USER does not exist: run scripts/install.sh first"
}
rootless_runtime_dir() { echo "/run/user/$(rootless_uid)"; }
rootless_sock() { echo "$(rootless_runtime_dir)/podman/podman.sock"; }
# where a rootless dockerd listens by default ($XDG_RUNTIME_DIR/docker.sock), which is where
# the docker SDK/CLI of that user (and fusion-oci's docker runtime) look for it
dockerless_sock() { echo "$(rootless_runtime_dir)/docker.sock"; }

# `podman --runtime runc` is only needed on a cgroup v1/hybrid host without install.sh's drop-in.
podman_runtime_args() {
    if [[ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs && ! -f "$DROPIN" ]]; then
        echo --runtime runc
    fi
}

# ------------------------------------------------------------------ pid helpers
pid_cmdline() { tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null || true; }
# pid_matches PID WORD: PID is alive and its argv mentions WORD (guards against reused pids)
pid_matches() {
    [[ "$1" =~ ^[0-9]+$ ]] && kill -0 "$1" 2>/dev/null && [[ "$(pid_cmdline "$1")" == *"$2"* ]]
}
pidfile_pid() { [[ -s "$1" ]] && tr -dc '0-9' <"$1" || true; }

# descendants PID: all live descendants of PID, deepest first
descendants() {
    local kid
    for kid in $(ps -eo pid=,ppid= | awk -v p="$1" '$2 == p {print $1}'); do
        descendants "$kid"
        echo "$kid"
    done
}

# stop_pid PID WORD NAME: SIGTERM, wait up to 30 s, then SIGKILL
stop_pid() {
    local pid="$1" word="$2" name="$3" i
    pid_matches "$pid" "$word" || return 0
    log "$name: stopping pid $pid"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 300; i++)); do
        pid_matches "$pid" "$word" || return 0
        sleep 0.1
    done
    log "$name: pid $pid still alive after 30 s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        pid_matches "$pid" "$word" || return 0
        sleep 0.1
    done
    log "$name: WARNING: pid $pid did not die"
}

# ------------------------------------------------------------------ probes
docker_host() {
    if [[ -s "$DOCKER_HOST_FILE" ]]; then cat "$DOCKER_HOST_FILE"; else echo "unix://$DOCKER_SOCK"; fi
}
sock_ping() {  # sock_ping SOCKET PATH
    [[ -S "$1" ]] && [[ "$(curl -sf --max-time 5 --unix-socket "$1" "http://d$2" 2>/dev/null)" == OK ]]
}
docker_ok() {
    [[ -S "$1" ]] && docker -H "unix://$1" version --format '{{.Server.Version}}' >/dev/null 2>&1
}
podman_ok() { sock_ping "$1" /v4.0.0/libpod/_ping; }
service_ok() {
    case "$1" in
        docker) docker_ok "$(docker_host | sed 's|^unix://||')" ;;
        podman) podman_ok "$PODMAN_SOCK" ;;
        podman-rootless) podman_ok "$(rootless_sock)" ;;
        docker-rootless) docker_ok "$(dockerless_sock)" ;;
    esac
}

# wait_for NAME TIMEOUT PID WORD LOGFILE
wait_for() {
    local name="$1" timeout="$2" pid="$3" word="$4" logfile="$5" start=$SECONDS
    while ! service_ok "$name"; do
        if ! pid_matches "$pid" "$word"; then
            log "$name: process $pid exited before answering; last lines of $logfile:"
            tail -n 30 "$logfile" >&2 || true
            return 1
        fi
        if ((SECONDS - start >= timeout)); then
            log "$name: no answer after ${timeout} s; last lines of $logfile:"
            tail -n 30 "$logfile" >&2 || true
            return 1
        fi
        sleep 0.2
    done
    log "$name: answering after $((SECONDS - start)) s"
}

record_started() {
    if [[ -n "${FUSION_OCI_STARTED_FILE:-}" ]]; then echo "$1" >>"$FUSION_OCI_STARTED_FILE"; fi
}

# ------------------------------------------------------------------ launchers
# Each launcher prints the pid it started (or nothing when the service already answers).
# Daemons run in their own session (setsid) with stdio on their log, so they outlive the
# caller's terminal/process group; `setsid` execs in place here (a background job of a script
# is not a group leader), so $! is the daemon's own pid.

launch_docker() {
    rm -f "$DOCKER_HOST_FILE"
    if docker_ok "$DOCKER_SOCK"; then log "docker: already answering at unix://$DOCKER_SOCK"; return; fi
    local pid
    pid="$(pidfile_pid "$DOCKER_PIDFILE")"
    if [[ -n "$pid" ]] && pid_matches "$pid" dockerd; then
        log "docker: dockerd pid $pid is running but not answering yet; waiting for it"
        echo "$pid"; return
    fi
    if docker_ok "$SYSTEM_DOCKER_SOCK"; then
        # A second dockerd next to a running one would fight over docker0 and iptables.
        log "docker: an engine already answers at unix://$SYSTEM_DOCKER_SOCK; using it"
        echo "unix://$SYSTEM_DOCKER_SOCK" >"$DOCKER_HOST_FILE"
        return
    fi
    command -v dockerd >/dev/null || die "dockerd not found: run scripts/install.sh first"
    rm -f "$DOCKER_PIDFILE" "$DOCKER_SOCK"   # stale leftovers of a killed daemon
    # dockerd trusts containerd's pidfile in the exec root and waits forever-ish (then fails with
    # "timeout waiting for containerd to start") when that pid is dead but not yet reaped, which
    # happens here after a SIGKILL because init reaps orphans late. Drop such a stale pidfile;
    # a containerd of ours that really still runs is left for dockerd to reuse.
    local cpidf="$DOCKER_EXEC_ROOT/containerd/containerd.pid" cpid
    cpid="$(pidfile_pid "$cpidf")"
    if [[ -f "$cpidf" ]] && ! { [[ -n "$cpid" ]] && pid_matches "$cpid" "$DOCKER_EXEC_ROOT"; }; then
        log "docker: removing stale $cpidf (pid ${cpid:-?} is gone)"
        rm -f "$cpidf"
    fi
    mkdir -p "$DATA/docker" "$DOCKER_EXEC_ROOT"
    (
        cd /
        exec setsid dockerd --host "unix://$DOCKER_SOCK" --data-root "$DATA/docker" \
            --exec-root "$DOCKER_EXEC_ROOT" --pidfile "$DOCKER_PIDFILE" \
            </dev/null >>"$DOCKER_LOG" 2>&1
    ) &
    log "docker: started dockerd pid $! (log $DOCKER_LOG)"
    record_started docker
    echo "$!"
}

launch_podman() {
    if podman_ok "$PODMAN_SOCK"; then log "podman: already answering at unix://$PODMAN_SOCK"; return; fi
    local pid
    pid="$(pidfile_pid "$PODMAN_PIDFILE")"
    if [[ -n "$pid" ]] && pid_matches "$pid" podman; then
        log "podman: service pid $pid is running but not answering yet; waiting for it"
        echo "$pid"; return
    fi
    command -v podman >/dev/null || die "podman not found: run scripts/install.sh first"
    rm -f "$PODMAN_PIDFILE" "$PODMAN_SOCK"
    # shellcheck disable=SC2046
    (
        cd /
        exec setsid podman $(podman_runtime_args) system service --time=0 "unix://$PODMAN_SOCK" \
            </dev/null >>"$PODMAN_LOG" 2>&1
    ) &
    echo "$!" >"$PODMAN_PIDFILE"
    log "podman: started rootful podman service pid $! (log $PODMAN_LOG)"
    record_started podman
    echo "$!"
}

# When every process of a machine was ended at once (a session's stop, a crash), rootless
# podman's records can still say a container runs whose processes, and the pause process that
# held the user namespace, are gone. podman then refuses every command ("invalid internal
# status, try resetting the pause process with podman system migrate"). Its own fix is
# `podman system migrate`, which marks those containers stopped and starts a new pause process.
repair_rootless_state() {
    local xdg="$1" pause out
    pause="$(pidfile_pid "$xdg/libpod/tmp/pause.pid")"
    if [[ -n "$pause" ]] && kill -0 "$pause" 2>/dev/null; then return 0; fi
    out="$(cd / && runuser -u "$ROOTLESS_USER" -- env XDG_RUNTIME_DIR="$xdg" \
        podman $(podman_runtime_args) info --format '{{.Host.OCIRuntime.Name}}' 2>&1)" && return 0
    if [[ "$out" == *"invalid internal status"* || "$out" == *"pause process"* ]]; then
        log "podman-rootless: stale state (a container recorded as running has no process left); running 'podman system migrate' as $ROOTLESS_USER"
        (cd / && runuser -u "$ROOTLESS_USER" -- env XDG_RUNTIME_DIR="$xdg" \
            podman $(podman_runtime_args) system migrate) >>"$ROOTLESS_LOG" 2>&1 \
            || log "podman-rootless: 'podman system migrate' failed (see $ROOTLESS_LOG)"
    fi
}

# ensure_runtime_dir LABEL DIR UID GID: the user's XDG_RUNTIME_DIR as logind would make it
# (there may be no logind/systemd here).
ensure_runtime_dir() {
    [[ -d "$2" ]] && return 0
    install -d -m 700 -o "$3" -g "$4" "$2"
    log "$1: created $2"
}

launch_podman_rootless() {
    local uid gid home xdg sock pid
    uid="$(rootless_uid)"
    gid="$(id -g "$ROOTLESS_USER")"
    home="$(getent passwd "$ROOTLESS_USER" | cut -d: -f6)"
    xdg="$(rootless_runtime_dir)"
    sock="$(rootless_sock)"
    if podman_ok "$sock"; then log "podman-rootless: already answering at unix://$sock"; return; fi
    pid="$(pidfile_pid "$ROOTLESS_PIDFILE")"
    if [[ -n "$pid" ]] && pid_matches "$pid" podman; then
        log "podman-rootless: service pid $pid is running but not answering yet; waiting for it"
        echo "$pid"; return
    fi
    ensure_runtime_dir podman-rootless "$xdg" "$uid" "$gid"
    # podman does not create the socket's directory itself
    install -d -m 700 -o "$uid" -g "$gid" "$(dirname "$sock")"
    rm -f "$ROOTLESS_PIDFILE" "$sock"
    repair_rootless_state "$xdg" >&2
    # setpriv execs in place (unlike runuser/su, which fork and wait), so $! is podman's pid.
    # shellcheck disable=SC2046
    (
        cd /
        exec setsid setpriv --reuid="$uid" --regid="$gid" --init-groups \
            env -i HOME="$home" USER="$ROOTLESS_USER" LOGNAME="$ROOTLESS_USER" \
            PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            XDG_RUNTIME_DIR="$xdg" \
            podman $(podman_runtime_args) system service --time=0 "unix://$sock" \
            </dev/null >>"$ROOTLESS_LOG" 2>&1
    ) &
    echo "$!" >"$ROOTLESS_PIDFILE"
    log "podman-rootless: started podman service as $ROOTLESS_USER, pid $! (log $ROOTLESS_LOG)"
    record_started podman-rootless
    echo "$!"
}

# A rootless dockerd: Docker's own dockerd-rootless.sh runs rootlesskit (user, mount and network
# namespaces, slirp4netns for the network) and dockerd inside it, as the user, with the user's
# own data root (~/.local/share/docker), exec root ($XDG_RUNTIME_DIR/docker) and socket
# ($XDG_RUNTIME_DIR/docker.sock). On a cgroup v1/hybrid host it runs without cgroups (like
# rootless podman there): no memory/pids/CPU limits, which fusion-oci reports as unenforced.
dockerless_script() {
    command -v dockerd-rootless.sh 2>/dev/null \
        || { [[ -x /usr/share/docker.io/contrib/dockerd-rootless.sh ]] \
            && echo /usr/share/docker.io/contrib/dockerd-rootless.sh; } \
        || die "dockerd-rootless.sh not found (Debian's docker.io ships it in /usr/share/docker.io/contrib): run scripts/install.sh first"
}

# Native overlay in a user namespace needs Linux 5.11; older kernels get fuse-overlayfs, and
# only without either the vfs driver, which copies the whole image for every container.
# Measured here (bench_containers.py, 10 runs each, one after the other): a warm sandbox's
# prepare took 292 ms on overlay2 against 354 ms on fuse-overlayfs, which also runs a FUSE
# daemon per container; a warm command does not touch the storage driver (2.5-4.4 ms on both).
dockerless_storage() {
    local kmajor kminor
    IFS=. read -r kmajor kminor _ <<<"$(uname -r)"
    if (( kmajor > 5 || (kmajor == 5 && kminor >= 11) )); then echo overlay2
    elif command -v fuse-overlayfs >/dev/null; then echo fuse-overlayfs
    else echo vfs; fi
}

# dockerless_tree [TOP]: every process of the rootless dockerd, deepest first: the containerd
# shims with their containers, which daemonize out of the tree (re-parented to init) and outlive
# a killed dockerd (each names its containerd's socket in the user's exec root), then the
# descendants of TOP, rootlesskit (its namespaced child, dockerd, containerd, slirp4netns).
dockerless_tree() {
    local top="${1:-}" address shim
    address="-address $(rootless_runtime_dir)/docker/containerd/containerd.sock"
    for shim in $(ps -u "$(rootless_uid)" -o pid=,comm= | awk '$2 ~ /^containerd-shim/ {print $1}'); do
        [[ " $(pid_cmdline "$shim")" == *" $address "* ]] || continue
        descendants "$shim"
        echo "$shim"
    done
    if [[ -n "$top" ]]; then descendants "$top"; fi
}

launch_docker_rootless() {
    local uid gid home xdg sock pid script storage f fpid
    uid="$(rootless_uid)"
    gid="$(id -g "$ROOTLESS_USER")"
    home="$(getent passwd "$ROOTLESS_USER" | cut -d: -f6)"
    xdg="$(rootless_runtime_dir)"
    sock="$(dockerless_sock)"
    if docker_ok "$sock"; then log "docker-rootless: already answering at unix://$sock"; return; fi
    pid="$(pidfile_pid "$DOCKERLESS_PIDFILE")"
    if [[ -n "$pid" ]] && pid_matches "$pid" rootlesskit; then
        log "docker-rootless: rootlesskit pid $pid is running but dockerd does not answer yet; waiting for it"
        echo "$pid"; return
    fi
    script="$(dockerless_script)"
    command -v rootlesskit >/dev/null || die "rootlesskit not found: run scripts/install.sh first"
    ensure_runtime_dir docker-rootless "$xdg" "$uid" "$gid"
    # Leftovers of a daemon that was killed: dockerd refuses to start while its pidfile names a
    # live process (a reused pid counts), and it waits on containerd's stale pidfile as the
    # rootful one does (see launch_docker).
    for f in "$xdg/docker.pid:dockerd" "$xdg/docker/containerd/containerd.pid:containerd"; do
        fpid="$(pidfile_pid "${f%%:*}")"
        if [[ -f "${f%%:*}" ]] && ! { [[ -n "$fpid" ]] && pid_matches "$fpid" "${f##*:}" \
            && [[ "$(stat -c %u "/proc/$fpid")" == "$uid" ]]; }; then
            log "docker-rootless: removing stale ${f%%:*} (pid ${fpid:-?} is not a ${f##*:} of $ROOTLESS_USER)"
            rm -f "${f%%:*}"
        fi
    done
    rm -f "$DOCKERLESS_PIDFILE" "$sock"
    storage="${FUSION_OCI_DOCKER_ROOTLESS_STORAGE:-$(dockerless_storage)}"
    # setpriv execs in place, and so do env, the script (into rootlesskit) and setsid: $! is
    # rootlesskit's pid, the top of the tree. slirp4netns with its own MTU default (65520, what
    # the script picks when it chooses slirp4netns itself); rootlesskit's state in the user's
    # runtime dir, not a random /tmp folder.
    (
        cd /
        exec setsid setpriv --reuid="$uid" --regid="$gid" --init-groups \
            env -i HOME="$home" USER="$ROOTLESS_USER" LOGNAME="$ROOTLESS_USER" \
            PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            XDG_RUNTIME_DIR="$xdg" \
            DOCKERD_ROOTLESS_ROOTLESSKIT_NET=slirp4netns DOCKERD_ROOTLESS_ROOTLESSKIT_MTU=65520 \
            DOCKERD_ROOTLESS_ROOTLESSKIT_FLAGS="--state-dir=$xdg/dockerd-rootless" \
            "$script" --host "unix://$sock" --storage-driver "$storage" \
            </dev/null >>"$DOCKERLESS_LOG" 2>&1
    ) &
    echo "$!" >"$DOCKERLESS_PIDFILE"
    log "docker-rootless: started rootless dockerd ($storage) as $ROOTLESS_USER, rootlesskit pid $! (log $DOCKERLESS_LOG)"
    record_started docker-rootless
    echo "$!"
}

stop_docker_rootless() {
    local pid xdg dpid kid
    local -a tree=()
    xdg="$(rootless_runtime_dir)"
    pid="$(pidfile_pid "$DOCKERLESS_PIDFILE")"
    if [[ -n "$pid" ]] && pid_matches "$pid" rootlesskit; then
        # The whole tree first: once its top is gone its parts are re-parented and cannot be
        # found by parent any more.
        mapfile -t tree < <(dockerless_tree "$pid")
        # dockerd first, so that it stops its containers and containerd in order; rootlesskit
        # exits when its child does.
        dpid="$(pidfile_pid "$xdg/docker.pid")"
        if [[ -n "$dpid" ]] && pid_matches "$dpid" dockerd; then
            stop_pid "$dpid" dockerd "docker-rootless's dockerd"
        fi
        stop_pid "$pid" rootlesskit docker-rootless
    else
        log "docker-rootless: no rootless dockerd of ours is running"
        # A killed daemon's shims and containers may still run; not while a containerd of that
        # exec root lives (then they belong to a daemon someone else started).
        dpid="$(pidfile_pid "$xdg/docker/containerd/containerd.pid")"
        if [[ -n "$dpid" ]] && pid_matches "$dpid" containerd; then
            log "docker-rootless: containerd pid $dpid of $xdg/docker runs (not ours): leaving its containers"
        else
            mapfile -t tree < <(dockerless_tree)
        fi
    fi
    # What did not end with its daemon (a shim, a container's process) has nothing left to shut
    # down in order, and a container's init ignores SIGTERM: SIGKILL, by pid, deepest first.
    local left=0
    for kid in "${tree[@]}"; do
        kill -0 "$kid" 2>/dev/null || continue
        [[ "$(ps -o stat= -p "$kid" 2>/dev/null)" == Z* ]] && continue  # dead, not reaped yet
        log "docker-rootless: killing left-over pid $kid ($(pid_cmdline "$kid" | cut -c1-70))"
        kill -KILL "$kid" 2>/dev/null || true
        left=1
    done
    if ((left)); then sleep 0.5; fi
    rm -f "$DOCKERLESS_PIDFILE"
}

# ------------------------------------------------------------------ commands
selected() {
    local s
    if (($# == 0)); then set -- "${ALL_SERVICES[@]}"; fi
    for s in "$@"; do
        case "$s" in
            docker | podman | podman-rootless | docker-rootless) echo "$s" ;;
            *) die "unknown service '$s' (want: ${ALL_SERVICES[*]})" ;;
        esac
    done
}

cmd_start() {
    local t0=$SECONDS s pid rc=0
    local -A pids=()
    mkdir -p "$STATE"
    chmod 755 "$STATE"
    for s in $(selected "$@"); do
        case "$s" in
            docker) pids[$s]="$(launch_docker)" ;;
            podman) pids[$s]="$(launch_podman)" ;;
            podman-rootless) pids[$s]="$(launch_podman_rootless)" ;;
            docker-rootless) pids[$s]="$(launch_docker_rootless)" ;;
        esac
    done
    for s in $(selected "$@"); do
        pid="${pids[$s]:-}"
        [[ -n "$pid" ]] || continue
        case "$s" in
            docker) wait_for docker "$DOCKER_TIMEOUT" "$pid" dockerd "$DOCKER_LOG" || rc=1 ;;
            podman) wait_for podman "$PODMAN_TIMEOUT" "$pid" podman "$PODMAN_LOG" || rc=1 ;;
            podman-rootless)
                wait_for podman-rootless "$PODMAN_TIMEOUT" "$pid" podman "$ROOTLESS_LOG" || rc=1
                ;;
            docker-rootless)
                wait_for docker-rootless "$DOCKERLESS_TIMEOUT" "$pid" rootlesskit "$DOCKERLESS_LOG" \
                    || rc=1
                ;;
        esac
    done
    if [[ " $* " == *" podman-rootless "* || $# -eq 0 ]] && ((rc == 0)); then
        # one direct check that rootless podman itself works for the user, not just the socket
        local info
        if info="$(cd / && runuser -u "$ROOTLESS_USER" -- env XDG_RUNTIME_DIR="$(rootless_runtime_dir)" \
            podman info --format '{{.Host.OCIRuntime.Name}} {{.Store.GraphDriverName}}' 2>/dev/null)"; then
            log "podman-rootless: 'podman info' as $ROOTLESS_USER works (runtime, storage: $info)"
        else
            log "podman-rootless: 'podman info' as $ROOTLESS_USER FAILED"
            rc=1
        fi
    fi
    if [[ " $* " == *" docker-rootless "* || $# -eq 0 ]] && ((rc == 0)); then
        # the daemon at the socket is the rootless one (not some rootful dockerd listening there)
        local dinfo
        dinfo="$(docker -H "unix://$(dockerless_sock)" info \
            --format '{{.Driver}} {{json .SecurityOptions}} cgroup v{{.CgroupVersion}}' 2>/dev/null || true)"
        if [[ "$dinfo" == *name=rootless* ]]; then
            log "docker-rootless: rootless dockerd as $ROOTLESS_USER answers (storage, security, cgroup: $dinfo)"
        else
            log "docker-rootless: the dockerd at unix://$(dockerless_sock) is not rootless: ${dinfo:-no answer}"
            rc=1
        fi
    fi
    ((rc == 0)) || die "some services did not come up"
    log "all requested services answer (start took $((SECONDS - t0)) s)"
}

stop_rootless_pause() {
    # Rootless podman leaves a "pause" process (catatonit -P) that holds its user namespace.
    # Stop it too, via podman's own pidfile, but only if nothing else of that user still runs.
    local uid xdg pidf pid others
    uid="$(id -u "$ROOTLESS_USER" 2>/dev/null)" || return 0
    xdg="/run/user/$uid"
    pidf="$xdg/libpod/tmp/pause.pid"
    pid="$(pidfile_pid "$pidf")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
    [[ "$(stat -c %u "/proc/$pid")" == "$uid" ]] || return 0
    # (zombies do not count: this machine's init may be slow to reap orphans)
    others="$(ps -u "$uid" -o pid=,stat= | awk -v p="$pid" '$1 != p && $2 !~ /^Z/ {print $1}')"
    if [[ -n "$others" ]]; then
        log "podman-rootless: leaving pause process $pid: other processes of $ROOTLESS_USER run: $(echo $others)"
        return 0
    fi
    stop_pid "$pid" "" "podman-rootless pause process"
    rm -f "$pidf"
}

cmd_stop() {
    local s pid cpid
    for s in $(selected "$@"); do
        case "$s" in
            docker)
                rm -f "$DOCKER_HOST_FILE"
                pid="$(pidfile_pid "$DOCKER_PIDFILE")"
                if [[ -n "$pid" ]] && pid_matches "$pid" dockerd; then
                    stop_pid "$pid" dockerd docker
                else
                    log "docker: no dockerd of ours is running"
                fi
                # containerd managed by that dockerd normally exits with it; not if it was SIGKILLed
                cpid="$(pidfile_pid "$DOCKER_EXEC_ROOT/containerd/containerd.pid")"
                if [[ -n "$cpid" ]] && pid_matches "$cpid" "$DOCKER_EXEC_ROOT"; then
                    stop_pid "$cpid" "$DOCKER_EXEC_ROOT" "docker's containerd"
                fi
                rm -f "$DOCKER_PIDFILE"
                ;;
            podman)
                pid="$(pidfile_pid "$PODMAN_PIDFILE")"
                if [[ -n "$pid" ]] && pid_matches "$pid" podman; then
                    stop_pid "$pid" podman podman
                else
                    log "podman: no podman service of ours is running"
                fi
                rm -f "$PODMAN_PIDFILE" "$PODMAN_SOCK"
                ;;
            podman-rootless)
                pid="$(pidfile_pid "$ROOTLESS_PIDFILE")"
                if [[ -n "$pid" ]] && pid_matches "$pid" podman; then
                    # When no pause process existed yet, rootless podman re-executes itself in a
                    # child inside the new user namespace and that child is the real service; it
                    # survives SIGTERM to the parent, so stop the podman descendants first.
                    local kid
                    for kid in $(descendants "$pid"); do
                        stop_pid "$kid" podman "podman-rootless (child of $pid)"
                    done
                    stop_pid "$pid" podman podman-rootless
                else
                    log "podman-rootless: no podman service of ours is running"
                fi
                stop_rootless_pause
                rm -f "$ROOTLESS_PIDFILE"
                ;;
            docker-rootless) stop_docker_rootless ;;
        esac
    done
}

cmd_status() {
    local s rc=0
    for s in "${ALL_SERVICES[@]}"; do
        if service_ok "$s"; then echo "$s: up"; else echo "$s: down"; rc=1; fi
    done
    return $rc
}

cmd_env() {
    echo "export DOCKER_HOST=$(docker_host)"
    echo "export FUSION_OCI_PODMAN_URL=unix://$PODMAN_SOCK"
    echo "export FUSION_OCI_ROOTLESS_USER=$ROOTLESS_USER"
    echo "export FUSION_OCI_ROOTLESS_PODMAN_URL=unix://$(rootless_sock)"
    echo "export FUSION_OCI_ROOTLESS_DOCKER_URL=unix://$(dockerless_sock)"
    echo "export FUSION_OCI_OCI_SCHEMA_DIR=$OCI_SCHEMA_DIR"
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    status) cmd_status ;;
    env) cmd_env ;;
    *) echo "usage: $0 start|stop [docker|podman|docker-rootless|podman-rootless]... | status | env" >&2; exit 2 ;;
esac
