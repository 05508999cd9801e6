#!/usr/bin/env bash
# A local PostgreSQL primary with a streaming standby on loopback, for the
# failover tests (tests/cluster) and `make cluster-up`: node a on
# 127.0.0.1:5441 (the primary at first), node b on 127.0.0.1:5442 (its
# standby, application_name eo_standby), data under $EO_PGPAIR_DIR (default
# /tmp/eo-pg-pair-<port base>), trust auth for postgres, database test. Asynchronous
# replication at first: a test sets synchronous_standby_names and
# synchronous_commit with ALTER SYSTEM. Beside the server of `make services`,
# which it leaves alone. EO_PGPAIR_PORT_BASE (default 5440: a on base+1, b
# on base+2) runs another pair beside.
#
#   scripts/pg-pair.sh up            create and start both (a fresh pair every time)
#   scripts/pg-pair.sh down          stop both and remove the data
#   scripts/pg-pair.sh crash a|b     stop a node as a crash does (immediate: no checkpoint, nothing more sent)
#   scripts/pg-pair.sh promote a|b   promote a standby and wait until it takes writes
#   scripts/pg-pair.sh url           print the multi-host URL that finds the primary (target_session_attrs=read-write)
set -euo pipefail

PBASE=${EO_PGPAIR_PORT_BASE:-5440}
DIR=${EO_PGPAIR_DIR:-/tmp/eo-pg-pair-$PBASE}
# The newest version whose server binaries are installed (a client-only
# version has no initdb).
VERSION=${EO_PG_VERSION:-$(ls -d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -1 | cut -d/ -f5 || true)}
BIN=/usr/lib/postgresql/$VERSION/bin

say() { echo "pg-pair: $*" >&2; }
die() { say "$*"; exit 1; }

port() { case $1 in a) echo $((PBASE + 1)) ;; b) echo $((PBASE + 2)) ;; *) die "node is a or b, not $1" ;; esac; }

as_pg() {
	if [ "$(id -u)" = 0 ]; then
		runuser -u postgres -- "$@"
	else
		"$@"
	fi
}

check_installed() {
	[ -x "$BIN/initdb" ] || die "PostgreSQL server binaries not found under /usr/lib/postgresql: run 'make services' first"
}

pgctl() { # pgctl node args...
	local n=$1
	shift
	as_pg "$BIN/pg_ctl" -D "$DIR/$n" -l "$DIR/$n.log" "$@"
}

up() {
	check_installed
	down >/dev/null 2>&1 || true
	mkdir -p "$DIR"
	[ "$(id -u)" = 0 ] && chown postgres:postgres "$DIR"
	as_pg "$BIN/initdb" -D "$DIR/a" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$DIR/initdb.log" 2>&1 ||
		die "initdb failed: $(tail -5 "$DIR/initdb.log")"
	cat >>"$DIR/a/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $(port a)
unix_socket_directories = '$DIR'
wal_level = replica
max_wal_senders = 5
max_replication_slots = 5
hot_standby = on
wal_keep_size = 256MB
max_connections = 200
fsync = on
synchronous_commit = on
synchronous_standby_names = ''
CONF
	echo "host replication all 127.0.0.1/32 trust" >>"$DIR/a/pg_hba.conf"
	pgctl a -w start >/dev/null || die "node a did not start: $(tail -5 "$DIR/a.log")"
	as_pg "$BIN/psql" -h 127.0.0.1 -p "$(port a)" -U postgres -qc 'CREATE DATABASE test' postgres >/dev/null
	as_pg "$BIN/pg_basebackup" -h 127.0.0.1 -p "$(port a)" -U postgres -D "$DIR/b" -X stream -c fast >/dev/null 2>"$DIR/basebackup.log" ||
		die "pg_basebackup failed: $(tail -5 "$DIR/basebackup.log")"
	sed -i "s/^port = .*/port = $(port b)/" "$DIR/b/postgresql.conf"
	cat >>"$DIR/b/postgresql.auto.conf" <<CONF
primary_conninfo = 'host=127.0.0.1 port=$(port a) user=postgres application_name=eo_standby'
CONF
	as_pg touch "$DIR/b/standby.signal"
	pgctl b -w start >/dev/null || die "node b did not start: $(tail -5 "$DIR/b.log")"
	# The standby streams.
	for _ in $(seq 1 100); do
		if [ "$(as_pg "$BIN/psql" -h 127.0.0.1 -p "$(port a)" -U postgres -Atc "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'eo_standby' AND state = 'streaming'" postgres)" = 1 ]; then
			say "primary a at 127.0.0.1:$(port a), standby b at 127.0.0.1:$(port b), streaming"
			return 0
		fi
		sleep 0.1
	done
	die "the standby does not stream: $(tail -5 "$DIR/b.log")"
}

down() {
	for n in a b; do
		[ -f "$DIR/$n/postmaster.pid" ] && pgctl "$n" -m immediate stop >/dev/null 2>&1 || true
	done
	rm -rf "$DIR"
	say "stopped, $DIR removed"
}

crash() {
	pgctl "$1" -m immediate stop >/dev/null || die "could not stop node $1"
}

promote() {
	pgctl "$1" -w promote >/dev/null || die "could not promote node $1: $(tail -5 "$DIR/$1.log")"
}

url() {
	echo "postgres://postgres@127.0.0.1:$(port a),127.0.0.1:$(port b)/test?sslmode=disable&target_session_attrs=read-write"
}

case "${1:-}" in
up) up ;;
down) down ;;
crash) crash "${2:?crash a|b}" ;;
promote) promote "${2:?promote a|b}" ;;
url) url ;;
*) die "usage: $0 up|down|crash a|b|promote a|b|url" ;;
esac
