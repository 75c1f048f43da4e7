#!/bin/sh
# The security probes that apply to `fusion-oci run --backend bubblewrap` inside the fusion-oci
# image (docs/ci.md): run as the image's unprivileged user, the container standing in for the
# host. One line per probe: `PROBE NAME blocked` or `PROBE NAME LEAK detail`; `WORKS ...`
# lines show the sandbox ran at all. Not here: memory/pids limits (no cgroup is delegated to
# an unprivileged user in a container) and egress (needs /dev/net/tun in the container).
set -u
probe() { if [ "$2" = ok ]; then echo "PROBE $1 blocked"; else echo "PROBE $1 LEAK $3"; fi; }
# PROBE_BACKEND=native (with fallback) is the control run: the probes must see its leaks.
BACKEND=${PROBE_BACKEND:-bubblewrap}
MODE=${PROBE_FAILURE_MODE:-fail-hard}
run() {
    fusion-oci run --backend "$BACKEND" --failure-mode "$MODE" --network none \
        --worktree "$HOME/wt" -- "$1" 2>&1
}

cd "$HOME" || exit 1
git init -q wt && git -C wt -c user.name=t -c user.email=t@x.invalid commit -q --allow-empty -m init
mkdir -p .ssh && echo CANARY-home-key > .ssh/id_ed25519
export GITHUB_TOKEN=CANARY-token-value
sleep 300 & OUTER=$!
python3 -m http.server 18080 --bind 127.0.0.1 >/dev/null 2>&1 & WEB=$!
sleep 1

r=$(run 'echo sandboxed-ok; id -u')
case "$r" in *sandboxed-ok*) echo "WORKS $r" | tr '\n' ' '; echo ;; *) echo "BROKEN $r"; exit 3 ;; esac

r=$(run "cat $HOME/.ssh/id_ed25519; cat ~/.ssh/id_ed25519; ls -A ~")
case "$r" in *CANARY-home-key*) probe home-canary leak "$r" ;; *) probe home-canary ok ;; esac

run "echo pwn > $HOME/pwned; echo pwn > /tmp/pwned-probe; echo ok > inside.txt" >/dev/null
if [ -e "$HOME/pwned" ] || [ -e /tmp/pwned-probe ] || [ ! -e wt/inside.txt ]; then
    probe write-outside-worktree leak "outside files: $(ls "$HOME" /tmp | tr '\n' ' ')"
else probe write-outside-worktree ok; fi

r=$(run 'env')
case "$r" in *CANARY-token*) probe secret-env leak "$r" ;; *) probe secret-env ok ;; esac

r=$(run "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 18080), 2); print('CONNECTED')\"")
case "$r" in *CONNECTED*) probe loopback-tcp leak "$r" ;; *) probe loopback-tcp ok ;; esac

r=$(run "kill -TERM $OUTER && echo KILLED; cat /proc/$OUTER/cmdline && echo SEEN")
if kill -0 "$OUTER" 2>/dev/null; then
    case "$r" in *KILLED*|*SEEN*) probe outer-process leak "$r" ;; *) probe outer-process ok ;; esac
else probe outer-process leak "the outer sleep was killed"; fi

r=$(run 'printf "#!/bin/sh\necho evil\n" > .git/hooks/post-commit && echo WROTE-HOOK; git config core.fsmonitor evil && echo WROTE-CONFIG')
if [ -e wt/.git/hooks/post-commit ] || grep -q fsmonitor wt/.git/config; then
    probe git-hooks-config leak "$r"
else probe git-hooks-config ok; fi

r=$(run 'unshare -U true && echo UNSHARED; mkdir -p m; mount -t tmpfs x m 2>/dev/null && echo MOUNTED')
case "$r" in *UNSHARED*|*MOUNTED*) probe unshare-mount leak "$r" ;; *) probe unshare-mount ok ;; esac

fusion-oci run --backend "$BACKEND" --failure-mode "$MODE" --network none \
    --worktree "$HOME/wt" --timeout-ms 1000 \
    -- 'sleep 77 & sleep 78' >/dev/null 2>&1
rc=$?
sleep 1
left=$(for p in /proc/[0-9]*; do tr '\0' ' ' < "$p/cmdline" 2>/dev/null; echo; done | grep -c '^sleep 7[78]')
if [ "$rc" = 124 ] && [ "$left" = 0 ]; then probe timeout-tree ok
else probe timeout-tree leak "rc=$rc left=$left"; fi

kill "$OUTER" "$WEB" 2>/dev/null
exit 0
