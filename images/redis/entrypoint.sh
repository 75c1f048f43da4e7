#!/bin/sh
# Redis on the container's own loopback (the only interface it has), nothing kept on disk:
# a per-task cache. REDIS_PASSWORD: require it (`AUTH`).
set -eu
set -- --bind 127.0.0.1 --port "${REDIS_PORT:-6379}" --protected-mode no --save '' \
    --appendonly no --daemonize no "$@"
if [ -n "${REDIS_PASSWORD:-}" ]; then
    set -- "$@" --requirepass "$REDIS_PASSWORD"
fi
exec redis-server "$@"
