#!/usr/bin/env bash
# A local three-node RabbitMQ cluster on loopback, for the cluster tests
# (tests/cluster) and `make cluster-up`: nodes eo-rmq1..3@localhost, AMQP on
# 127.0.0.1:5691..5693, Erlang distribution on 25691..25693, data under
# $EO_CLUSTER_DIR (default /tmp/<name>-cluster-<port base>). Beside the single
# rabbit@localhost node of `make services`, which it leaves alone.
# EO_RMQ_PORT_BASE (default 5690: node n listens on base+n, distribution on
# base+20000+n) and EO_RMQ_NAME (default eo-rmq) run another cluster beside.
#
#   scripts/rabbit-cluster.sh up          start the nodes that are down, wait for the cluster
#   scripts/rabbit-cluster.sh down        stop every node and remove the data
#   scripts/rabbit-cluster.sh kill N      SIGKILL node N (1..3): a crash, no goodbye
#   scripts/rabbit-cluster.sh start N     start node N again (it rejoins with its data)
#   scripts/rabbit-cluster.sh urls        print the three AMQP URLs, one per line
#   scripts/rabbit-cluster.sh status      cluster_status as node 1 (or the first that answers) sees it
set -euo pipefail

BASE=${EO_RMQ_PORT_BASE:-5690}
NAME=${EO_RMQ_NAME:-eo-rmq}
DIR=${EO_CLUSTER_DIR:-/tmp/$NAME-cluster-$BASE}
BIN=/usr/lib/rabbitmq/bin
NODES=(1 2 3)
WAIT=${EO_CLUSTER_WAIT:-90}

say() { echo "rabbit-cluster: $*" >&2; }
die() { say "$*"; exit 1; }

node() { echo "$NAME$1@localhost"; }
amqp_port() { echo $((BASE + $1)); }
dist_port() { echo $((BASE + 20000 + $1)); }

# The nodes run as the rabbitmq user, with its Erlang cookie (that of the
# rabbit@localhost node, so that rabbitmqctl as that user reaches them).
as_rabbit() {
	if [ "$(id -u)" = 0 ]; then
		runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq "$@"
	elif [ "$(id -un)" = rabbitmq ]; then
		env HOME=/var/lib/rabbitmq "$@"
	else
		die "run as root or rabbitmq (the nodes use the rabbitmq user's Erlang cookie)"
	fi
}

ctl() { # ctl N args...
	local n=$1
	shift
	as_rabbit env RABBITMQ_NODENAME="$(node "$n")" "$BIN/rabbitmqctl" -n "$(node "$n")" "$@"
}

check_installed() {
	[ -x "$BIN/rabbitmq-server" ] || die "RabbitMQ is not installed ($BIN/rabbitmq-server missing): run 'make services' first"
	id rabbitmq >/dev/null 2>&1 || die "no rabbitmq user: install RabbitMQ with 'make services'"
}

prepare() {
	mkdir -p "$DIR"
	chown rabbitmq:rabbitmq "$DIR" 2>/dev/null || true
	echo '[].' >"$DIR/enabled_plugins"
	for n in "${NODES[@]}"; do
		mkdir -p "$DIR/n$n"
		cat >"$DIR/n$n/rabbitmq.conf" <<CONF
listeners.tcp.1 = 127.0.0.1:$(amqp_port "$n")
loopback_users = none
cluster_formation.peer_discovery_backend = classic_config
cluster_formation.classic_config.nodes.1 = $(node 1)
cluster_formation.classic_config.nodes.2 = $(node 2)
cluster_formation.classic_config.nodes.3 = $(node 3)
cluster_partition_handling = pause_minority
disk_free_limit.absolute = 50MB
log.file.level = warning
CONF
	done
	chown -R rabbitmq:rabbitmq "$DIR" 2>/dev/null || true
}

pidfile() { echo "$DIR/n$1/pid"; }

running() { # the node's VM is alive (a pid file left by a crashed run may name another process)
	local p
	p=$(cat "$(pidfile "$1")" 2>/dev/null) || return 1
	[ -n "$p" ] && kill -0 "$p" 2>/dev/null && tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RABBITMQ_NODENAME=$(node "$1")"
}

start_node() {
	local n=$1
	if running "$n"; then return 0; fi
	rm -f "$(pidfile "$n")"
	as_rabbit env \
		RABBITMQ_NODENAME="$(node "$n")" \
		RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
		RABBITMQ_NODE_PORT="$(amqp_port "$n")" \
		RABBITMQ_DIST_PORT="$(dist_port "$n")" \
		RABBITMQ_CONFIG_FILE="$DIR/n$n/rabbitmq.conf" \
		RABBITMQ_ADVANCED_CONFIG_FILE="$DIR/n$n/advanced.config" \
		RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/enabled_plugins" \
		RABBITMQ_MNESIA_BASE="$DIR/n$n/mnesia" \
		RABBITMQ_LOG_BASE="$DIR/n$n/log" \
		RABBITMQ_PID_FILE="$(pidfile "$n")" \
		ERL_EPMD_ADDRESS=127.0.0.1 \
		"$BIN/rabbitmq-server" >"$DIR/n$n/stdout.log" 2>&1 &
	# The pid file appears once the VM runs.
	for _ in $(seq 1 100); do
		[ -s "$(pidfile "$n")" ] && return 0
		sleep 0.1
	done
	return 0
}

await_node() {
	local n=$1
	if ! timeout "$WAIT" bash -c "until (exec 3<>/dev/tcp/127.0.0.1/$(amqp_port "$n")) 2>/dev/null; do sleep 0.2; done"; then
		die "node $(node "$n") did not listen on 127.0.0.1:$(amqp_port "$n") within ${WAIT}s (see $DIR/n$n/log/ and $DIR/n$n/stdout.log)"
	fi
}

up() {
	check_installed
	prepare
	for n in "${NODES[@]}"; do start_node "$n"; done
	for n in "${NODES[@]}"; do await_node "$n"; done
	# Every node sees three running nodes.
	local deadline=$((SECONDS + WAIT))
	until [ "$(ctl 1 cluster_status --formatter json 2>/dev/null | grep -o '"running_nodes":\[[^]]*\]' | grep -o "$NAME" | wc -l)" = 3 ]; do
		[ $SECONDS -lt $deadline ] || die "the three nodes did not form a cluster within ${WAIT}s: $(ctl 1 cluster_status 2>&1 | tail -5)"
		sleep 1
	done
	say "3 nodes up: $(urls | tr '\n' ' ')"
}

down() {
	for n in "${NODES[@]}"; do
		if running "$n"; then kill -9 "$(cat "$(pidfile "$n")")" 2>/dev/null || true; fi
	done
	# epmd forgets a node once its VM is gone; the data goes with it.
	sleep 0.5
	rm -rf "$DIR"
	say "stopped, $DIR removed"
}

kill_node() {
	running "$1" || { say "node $1 is not running"; return 0; }
	kill -9 "$(cat "$(pidfile "$1")")"
	for _ in $(seq 1 50); do running "$1" || return 0; sleep 0.1; done
}

urls() {
	for n in "${NODES[@]}"; do echo "amqp://guest:guest@127.0.0.1:$(amqp_port "$n")/"; done
}

status() {
	for n in "${NODES[@]}"; do
		if running "$n" && ctl "$n" cluster_status 2>/dev/null; then return 0; fi
	done
	die "no node answers"
}

cmd=${1:-}
case "$cmd" in
up) up ;;
down) down ;;
kill) [ -n "${2:-}" ] || die "kill N"; kill_node "$2" ;;
start) [ -n "${2:-}" ] || die "start N"; check_installed; start_node "$2"; await_node "$2" ;;
urls) urls ;;
status) status ;;
*) die "usage: $0 up|down|kill N|start N|urls|status" ;;
esac
