#!/bin/sh
# Start the cluster made at build, as the environment asks (the official image's variables):
# POSTGRES_USER (default postgres), POSTGRES_PASSWORD (then password auth over TCP),
# POSTGRES_DB (default: the user's name), POSTGRES_HOST_AUTH_METHOD (without a password:
# trust; the container is reached only by its task, through its relay).
set -eu
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ -n "${POSTGRES_PASSWORD:-}" ]; then
    auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
else
    auth=${POSTGRES_HOST_AUTH_METHOD:-trust}
fi
printf 'local all all trust\nhost all all 127.0.0.1/32 %s\nhost all all ::1/128 %s\n' \
    "$auth" "$auth" > "$PGDATA/pg_hba.conf"

ident() { printf '"%s"' "$(printf '%s' "$1" | sed 's/"/""/g')"; }
literal() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/''/g")"; }
sql=""
if [ "$user" != postgres ]; then
    sql="CREATE ROLE $(ident "$user") SUPERUSER LOGIN;
"
fi
if [ -n "${POSTGRES_PASSWORD:-}" ]; then
    sql="${sql}ALTER ROLE $(ident "$user") PASSWORD $(literal "$POSTGRES_PASSWORD");
"
fi
if [ "$db" != postgres ]; then
    # FILE_COPY: a copy of the template's files, not its pages through the WAL (0.1 s
    # instead of 0.5 s here, with fsync off).
    sql="${sql}CREATE DATABASE $(ident "$db") OWNER $(ident "$user") STRATEGY = FILE_COPY;
"
fi
if [ -n "$sql" ]; then
    # Single-user mode: one statement a line, before the server listens (so "ready" means
    # the user and database are there).
    printf '%s' "$sql" | postgres --single -D "$PGDATA" -c fsync=off -c full_page_writes=off \
        postgres >/dev/null
fi
# A throwaway database per task: durability traded for speed, as CI services do.
exec postgres -D "$PGDATA" -c listen_addresses=127.0.0.1 -c fsync=off \
    -c synchronous_commit=off -c full_page_writes=off "$@"
