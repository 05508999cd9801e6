#!/usr/bin/env bash
# Make sure the PostgreSQL, MariaDB, RabbitMQ and Redis servers the tests need are
# reachable,
# that the pgbouncer binary is installed (tests start their own PgBouncer
# processes on free loopback ports; this script does not start one), that
# promtool is installed (the metrics tests check the alert rules with it), and
# that Chromium is installed (the console's browser test, examples/console,
# drives a headless one).
#
#   scripts/services.sh [SERVICE...]
#
# SERVICE is postgres, mariadb, rabbitmq, redis, pgbouncer, promtool or
# chromium; without any, all seven (`make services`, `make test`). `make demo` asks for
# postgres and rabbitmq only: the notifier demo uses nothing else.
#
#   DATABASE_URL  default postgres://postgres@127.0.0.1:5432/test?sslmode=disable
#   MYSQL_URL     default mysql://root@127.0.0.1:3306/test
#   AMQP_URL      default amqp://guest:guest@127.0.0.1:5672/
#   REDIS_URL     default redis://127.0.0.1:6379/0
#   SERVICES_WAIT seconds to wait for a server we started (default 60)
#
# For each URL: if its TCP port answers, fine. Otherwise, when the host is
# loopback, start the locally installed server (installing it first with
# apt-get on Debian when we are root or have sudo). Anything else exits
# non-zero with a message saying what to run.
#
# MariaDB, besides: its client must log in over TCP with MYSQL_URL's user and
# password, and the database of its path is created when missing. On
# loopback, a root with an empty password that cannot log in over TCP (the
# unix_socket authentication of Debian's package) is let in, through the
# server's socket as the system's root: root@localhost accepts an empty
# password besides unix_socket, and root@127.0.0.1 and root@::1 (empty
# password, all privileges) are created when missing. Test servers only.
set -euo pipefail

DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}"
MYSQL_URL="${MYSQL_URL:-mysql://root@127.0.0.1:3306/test}"
AMQP_URL="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/}"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
WAIT="${SERVICES_WAIT:-60}"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
apt_ran=0

say() { printf '%s\n' "$*"; }
die() {
	printf 'services: %s\n' "$1" >&2
	shift
	local line
	for line in "$@"; do printf '    %s\n' "$line" >&2; done
	exit 1
}

urldecode() { printf '%b' "${1//%/\\x}"; }

# parse_url URL DEFAULT_PORT -> sets U_USER U_PASS U_HOST U_PORT U_PATH
parse_url() {
	local url="$1" rest auth hostport
	rest="${url#*://}"
	if [[ "$rest" == "$url" ]]; then die "cannot parse URL (no scheme): $url"; fi
	rest="${rest%%\?*}"
	rest="${rest%%#*}"
	hostport="${rest%%/*}"
	if [[ "$rest" == */* ]]; then U_PATH="${rest#*/}"; else U_PATH=""; fi
	U_USER="" U_PASS=""
	if [[ "$hostport" == *@* ]]; then
		auth="${hostport%@*}"
		hostport="${hostport##*@}"
		U_USER="${auth%%:*}"
		if [[ "$auth" == *:* ]]; then U_PASS="${auth#*:}"; fi
		U_USER="$(urldecode "$U_USER")" U_PASS="$(urldecode "$U_PASS")"
	fi
	if [[ "$hostport" == \[* ]]; then # [ipv6]:port
		U_HOST="${hostport#[}"
		U_HOST="${U_HOST%%]*}"
		U_PORT="${hostport##*]}"
		U_PORT="${U_PORT#:}"
	elif [[ "$hostport" == *:* ]]; then
		U_HOST="${hostport%%:*}"
		U_PORT="${hostport##*:}"
	else
		U_HOST="$hostport" U_PORT=""
	fi
	U_HOST="${U_HOST:-localhost}"
	U_PORT="${U_PORT:-$2}"
	[[ "$U_PORT" =~ ^[0-9]+$ ]] || die "bad port '$U_PORT' in URL: $url"
}

is_loopback() {
	case "$1" in
	localhost | 127.* | ::1 | 0:0:0:0:0:0:0:1) return 0 ;;
	*) return 1 ;;
	esac
}

port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }

# wait_port HOST PORT SECONDS
wait_port() {
	local deadline=$((SECONDS + $3))
	while ((SECONDS < deadline)); do
		port_open "$1" "$2" && return 0
		sleep 1
	done
	return 1
}

# Run a command as root: directly, through sudo, or fail.
as_root() {
	if ((EUID == 0)); then
		"$@"
	elif command -v sudo >/dev/null 2>&1; then
		sudo "$@"
	else
		return 1
	fi
}

can_apt_install() {
	[[ -f /etc/debian_version ]] && command -v apt-get >/dev/null 2>&1 &&
		{ ((EUID == 0)) || command -v sudo >/dev/null 2>&1; }
}

apt_install() {
	if ((apt_ran == 0)); then
		say "$1: installing with apt-get (this takes a while)"
		as_root apt-get update -qq
		apt_ran=1
	fi
	as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

unreachable_help() { # NAME HOST PORT PKG VAR
	die "$1 is not reachable at $2:$3 and cannot be started here." \
		"Start one of these and re-run:" \
		"  docker compose -f $repo_root/compose.yaml up -d" \
		"  sudo apt-get install -y $4   (Debian/Ubuntu, local servers)" \
		"or point $5 at a running server."
}

# ---------------------------------------------------------------- PostgreSQL

pg_version() { # newest cluster version under /etc/postgresql
	# shellcheck disable=SC2012 # entries are version numbers
	ls /etc/postgresql 2>/dev/null | sort -V | tail -n1
}

pg_installed() { command -v pg_ctlcluster >/dev/null 2>&1 && [[ -n "$(pg_version)" ]]; }

pg_start() {
	local ver
	ver="$(pg_version)"
	if pg_lsclusters -h 2>/dev/null | awk -v v="$ver" '$1 == v && $2 == "main" { print $4 }' | grep -q online; then
		return 0 # running (maybe on another port: the wait below tells)
	fi
	as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start
}

# Trust loopback TCP connections in a cluster we just installed.
pg_trust_loopback() {
	local ver hba
	ver="$(pg_version)"
	hba="/etc/postgresql/$ver/main/pg_hba.conf"
	if ! as_root grep -Eq '^host[[:space:]]+all[[:space:]]+all[[:space:]]+127\.0\.0\.1/32[[:space:]]+trust' "$hba"; then
		as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
		as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main reload
	fi
}

pg_ensure_db() {
	local db="${U_PATH%%/*}"
	[[ "$db" == "test" ]] || return 0
	command -v psql >/dev/null 2>&1 || return 0
	local -a psql=(psql -w -X -q -h "$U_HOST" -p "$U_PORT" -U "${U_USER:-postgres}" -d postgres -v ON_ERROR_STOP=1)
	local found
	if ! found="$(PGPASSWORD="$U_PASS" PGCONNECT_TIMEOUT=5 "${psql[@]}" -tAc "select 1 from pg_database where datname='test'" 2>&1)"; then
		say "postgres: warning: could not check for database 'test': ${found//$'\n'/ }"
		return 0
	fi
	if [[ "$found" != 1 ]]; then
		PGPASSWORD="$U_PASS" "${psql[@]}" -c 'create database test'
		say "postgres: created database test"
	fi
}

ensure_postgres() {
	parse_url "$DATABASE_URL" 5432
	local how="reachable"
	if ! port_open "$U_HOST" "$U_PORT"; then
		is_loopback "$U_HOST" || unreachable_help postgres "$U_HOST" "$U_PORT" postgresql DATABASE_URL
		if pg_installed; then
			say "postgres: not answering on $U_HOST:$U_PORT, starting the local cluster"
			how="started"
		elif can_apt_install; then
			apt_install postgresql
			how="installed"
		else
			unreachable_help postgres "$U_HOST" "$U_PORT" postgresql DATABASE_URL
		fi
		pg_start || die "postgres: could not start the local cluster (pg_ctlcluster failed; see /var/log/postgresql/)"
		wait_port "$U_HOST" "$U_PORT" "$WAIT" ||
			die "postgres: local cluster started but $U_HOST:$U_PORT did not answer within ${WAIT}s (is it on another port? see pg_lsclusters)"
		if [[ "$how" == installed ]]; then pg_trust_loopback; fi
	fi
	if is_loopback "$U_HOST"; then pg_ensure_db; fi
	say "postgres: $how at $U_HOST:$U_PORT"
}

# ------------------------------------------------------------------- MariaDB

mariadb_server_bin() {
	local b
	for b in mariadbd mysqld; do
		if command -v "$b" 2>/dev/null; then return 0; fi
		if [[ -x "/usr/sbin/$b" ]]; then
			echo "/usr/sbin/$b"
			return 0
		fi
	done
	return 1
}

mariadb_client_bin() { command -v mariadb 2>/dev/null || command -v mysql 2>/dev/null; }

mariadb_installed() { mariadb_server_bin >/dev/null; }

mariadb_log="/tmp/mariadb-exactlyonce-test.log"

# Start the installed server in the background as the mysql user, on the
# URL's port (the rest comes from its configuration, /etc/mysql/).
mariadb_start() {
	local bin
	bin="$(mariadb_server_bin)" || return 1
	as_root install -d -m 0755 -o mysql -g mysql /run/mysqld || return 1
	# A data directory the package did not initialize (or one wiped since).
	if [[ -d /var/lib/mysql ]] && ! as_root test -d /var/lib/mysql/mysql; then
		local init
		init="$(command -v mariadb-install-db 2>/dev/null || command -v mysql_install_db 2>/dev/null)" || return 1
		say "mariadb: initializing the data directory /var/lib/mysql"
		as_root "$init" --user=mysql --datadir=/var/lib/mysql >>"$mariadb_log" 2>&1 || return 1
	fi
	if command -v start-stop-daemon >/dev/null 2>&1; then
		# --oknodo: a server already running (maybe still booting) is left
		# alone; the wait below tells whether it answers.
		as_root start-stop-daemon --start --oknodo --background --output "$mariadb_log" \
			--exec "$bin" -- --user=mysql --port="$U_PORT"
	else
		as_root setsid "$bin" --user=mysql --port="$U_PORT" </dev/null >>"$mariadb_log" 2>&1 &
	fi
}

# mariadb_tcp SQL: run SQL over TCP with MYSQL_URL's user and password (no
# option files, like the tests' driver).
mariadb_tcp() {
	MYSQL_PWD="$U_PASS" "$mariadb_client" --no-defaults --protocol=TCP -h "$U_HOST" -P "$U_PORT" \
		-u "$U_USER" --connect-timeout=5 -N -B -e "$1"
}

# mariadb_socket SQL: run SQL as the server's root through its unix socket
# (Debian's root@localhost authenticates the system's root by unix_socket).
mariadb_socket() {
	as_root "$mariadb_client" --protocol=SOCKET -u root --connect-timeout=5 -N -B -e "$1"
}

# Let root log in over TCP with an empty password. Idempotent. A server that
# resolves client names takes a login from 127.0.0.1 for root@localhost:
# that account accepts an empty password too (besides unix_socket, kept
# first). One that does not (skip-name-resolve) needs root@127.0.0.1 and
# root@::1: created when missing.
mariadb_root_tcp() {
	local h sql="ALTER USER IF EXISTS 'root'@'localhost' IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD('');"
	for h in 127.0.0.1 ::1; do
		sql+="CREATE USER IF NOT EXISTS 'root'@'$h' IDENTIFIED VIA mysql_native_password USING PASSWORD('');"
		sql+="GRANT ALL PRIVILEGES ON *.* TO 'root'@'$h' WITH GRANT OPTION;"
	done
	mariadb_socket "$sql"
}

mariadb_ensure_login() {
	local out
	if out="$(mariadb_tcp 'SELECT 1' 2>&1)"; then return 0; fi
	if is_loopback "$U_HOST" && [[ "$U_USER" == root && -z "$U_PASS" ]]; then
		local fix
		fix="$(mariadb_root_tcp 2>&1)" ||
			die "mariadb: root cannot log in over TCP at $U_HOST:$U_PORT with an empty password (${out//$'\n'/ })," \
				"and granting it through the server's socket as the system's root failed: ${fix//$'\n'/ }" \
				"Run as MariaDB's root:" \
				"  ALTER USER 'root'@'localhost' IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD('');" \
				"  CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED VIA mysql_native_password USING PASSWORD('');" \
				"  GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;" \
				"or point MYSQL_URL at a user who can log in over TCP."
		out="$(mariadb_tcp 'SELECT 1' 2>&1)" ||
			die "mariadb: root still cannot log in over TCP at $U_HOST:$U_PORT after giving root@localhost, root@127.0.0.1 and root@::1 an empty password: ${out//$'\n'/ }"
		say "mariadb: root may now log in over TCP with an empty password (root@localhost, root@127.0.0.1, root@::1)"
		return 0
	fi
	die "mariadb: cannot log in at $U_HOST:$U_PORT as '$U_USER': ${out//$'\n'/ }" \
		"Fix MYSQL_URL's user and password, or give that user a login from this host."
}

mariadb_ensure_db() {
	local db="${U_PATH%%/*}" out
	db="$(urldecode "$db")"
	[[ -n "$db" ]] || return 0
	[[ "$db" =~ ^[A-Za-z0-9_$]+$ ]] || die "mariadb: database name '$db' in MYSQL_URL: use letters, digits, _ and \$ only"
	out="$(mariadb_tcp "SELECT 1 FROM information_schema.schemata WHERE schema_name = '$db'" 2>&1)" ||
		die "mariadb: could not check for database '$db': ${out//$'\n'/ }"
	[[ "$out" == 1 ]] && return 0
	if ! out="$(mariadb_tcp "CREATE DATABASE IF NOT EXISTS \`$db\`" 2>&1)"; then
		is_loopback "$U_HOST" && mariadb_socket "CREATE DATABASE IF NOT EXISTS \`$db\`" >/dev/null 2>&1 ||
			die "mariadb: could not create database '$db' as '$U_USER': ${out//$'\n'/ }" \
				"Create it (CREATE DATABASE \`$db\`) as a user allowed to, or point MYSQL_URL at an existing one."
	fi
	say "mariadb: created database $db"
}

ensure_mariadb() {
	parse_url "$MYSQL_URL" 3306
	U_USER="${U_USER:-root}"
	local how="reachable"
	if ! port_open "$U_HOST" "$U_PORT"; then
		is_loopback "$U_HOST" || unreachable_help mariadb "$U_HOST" "$U_PORT" mariadb-server MYSQL_URL
		if mariadb_installed; then
			say "mariadb: not answering on $U_HOST:$U_PORT, starting the local server"
			how="started"
		elif can_apt_install; then
			apt_install mariadb-server
			how="installed"
		else
			unreachable_help mariadb "$U_HOST" "$U_PORT" mariadb-server MYSQL_URL
		fi
		# The package's install may have started it already.
		if ! port_open "$U_HOST" "$U_PORT"; then
			mariadb_start || die "mariadb: could not start the local server (see $mariadb_log and /var/log/mysql/)"
			wait_port "$U_HOST" "$U_PORT" "$WAIT" ||
				die "mariadb: local server started but $U_HOST:$U_PORT did not answer within ${WAIT}s (see $mariadb_log and /var/log/mysql/; is it on another port?)"
		fi
	fi
	if ! mariadb_client="$(mariadb_client_bin)"; then
		is_loopback "$U_HOST" && die "mariadb: the server answers at $U_HOST:$U_PORT but no mariadb (or mysql) client is installed to check the login and database" \
			"  sudo apt-get install -y mariadb-client   (Debian/Ubuntu)"
		say "mariadb: warning: no mariadb client installed: not checking the login or the database"
		say "mariadb: $how at $U_HOST:$U_PORT"
		return 0
	fi
	mariadb_ensure_login
	mariadb_ensure_db
	say "mariadb: $how at $U_HOST:$U_PORT"
}

# ------------------------------------------------------------------ RabbitMQ

rabbit_installed() { command -v rabbitmq-server >/dev/null 2>&1; }

rabbit_start() {
	# An Erlang VM running the rabbit node may just be booting: only wait then.
	if pgrep -f 'beam.*rabbit' >/dev/null 2>&1; then
		return 0
	fi
	as_root rabbitmq-server -detached
}

ensure_rabbitmq() {
	parse_url "$AMQP_URL" 5672
	local how="reachable"
	if ! port_open "$U_HOST" "$U_PORT"; then
		is_loopback "$U_HOST" || unreachable_help rabbitmq "$U_HOST" "$U_PORT" rabbitmq-server AMQP_URL
		if rabbit_installed; then
			say "rabbitmq: not answering on $U_HOST:$U_PORT, starting the local server"
			how="started"
		elif can_apt_install; then
			apt_install rabbitmq-server
			how="installed"
		else
			unreachable_help rabbitmq "$U_HOST" "$U_PORT" rabbitmq-server AMQP_URL
		fi
		rabbit_start || die "rabbitmq: could not start the local server (see /var/log/rabbitmq/)"
		wait_port "$U_HOST" "$U_PORT" "$WAIT" ||
			die "rabbitmq: local server started but $U_HOST:$U_PORT did not answer within ${WAIT}s (see /var/log/rabbitmq/)"
		# The listener opens late in boot; let the node confirm it is fully up.
		if command -v rabbitmqctl >/dev/null 2>&1; then
			as_root timeout "$WAIT" rabbitmqctl await_startup >/dev/null 2>&1 || true
		fi
	fi
	say "rabbitmq: $how at $U_HOST:$U_PORT"
}

# --------------------------------------------------------------------- Redis

redis_installed() { command -v redis-server >/dev/null 2>&1; }

redis_start() {
	# Loopback only, on the URL's port, in the background. The test data is
	# disposable: no snapshots, no append-only file (docs/redis.md says what
	# a production Redis needs instead).
	as_root redis-server --bind 127.0.0.1 --port "$U_PORT" --daemonize yes \
		--save '' --appendonly no --dir /tmp --logfile "/tmp/redis-exactlyonce-test-$U_PORT.log" --pidfile "/tmp/redis-exactlyonce-test-$U_PORT.pid"
}

ensure_redis() {
	parse_url "$REDIS_URL" 6379
	local how="reachable"
	if ! port_open "$U_HOST" "$U_PORT"; then
		is_loopback "$U_HOST" || unreachable_help redis "$U_HOST" "$U_PORT" redis-server REDIS_URL
		if redis_installed; then
			say "redis: not answering on $U_HOST:$U_PORT, starting the local server"
			how="started"
		elif can_apt_install; then
			apt_install redis-server
			how="installed"
		else
			unreachable_help redis "$U_HOST" "$U_PORT" redis-server REDIS_URL
		fi
		redis_start || die "redis: could not start the local server (see /tmp/redis-exactlyonce-test-$U_PORT.log)"
		wait_port "$U_HOST" "$U_PORT" "$WAIT" ||
			die "redis: local server started but $U_HOST:$U_PORT did not answer within ${WAIT}s (see /tmp/redis-exactlyonce-test-$U_PORT.log)"
	fi
	say "redis: $how at $U_HOST:$U_PORT"
}

# ----------------------------------------------------------------- PgBouncer

# Tests (internal/testenv.PgBouncer) look for pgbouncer in PATH, then in
# /usr/sbin (Debian installs it there, outside a normal user's PATH).
pgbouncer_path() {
	command -v pgbouncer 2>/dev/null || { [[ -x /usr/sbin/pgbouncer ]] && echo /usr/sbin/pgbouncer; }
}

ensure_pgbouncer() {
	local how="installed" bin
	if ! bin="$(pgbouncer_path)"; then
		if can_apt_install; then
			apt_install pgbouncer
			how="installed now"
		fi
		bin="$(pgbouncer_path)" ||
			die "pgbouncer is not installed and cannot be installed here (needs Debian/Ubuntu with apt-get, as root or with sudo)." \
				"The PgBouncer tests start their own pgbouncer process and fail without it. Install it and re-run:" \
				"  sudo apt-get install -y pgbouncer   (Debian/Ubuntu)" \
				"  or your system's pgbouncer package, with the binary in PATH or /usr/sbin"
	fi
	say "pgbouncer: $how at $bin (not started: tests start their own)"
}

# ------------------------------------------------------------------ promtool

# metrics/promtool_test.go runs `promtool check rules` and `promtool test
# rules` on docs/operations/alerts.yml. Debian ships promtool in the
# prometheus package, with the server: install it without recommends, and
# stop and disable the server the package enables (only promtool is wanted).
# Not installable here: a warning (the tests skip), or an error when CI=true
# (the tests would fail).
prometheus_daemon_pids() { pgrep -x prometheus 2>/dev/null || true; }

stop_prometheus_daemon() {
	if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
		as_root systemctl disable --now prometheus.service >/dev/null 2>&1 || true
	else
		as_root invoke-rc.d prometheus stop >/dev/null 2>&1 || true
		as_root update-rc.d prometheus disable >/dev/null 2>&1 || true
		# The unit's symlink, for a later boot under systemd (works offline).
		if command -v systemctl >/dev/null 2>&1; then
			as_root systemctl disable prometheus.service >/dev/null 2>&1 || true
		fi
	fi
}

ensure_promtool() {
	local bin before after pid line
	if bin="$(command -v promtool)"; then
		say "promtool: installed at $bin"
		return 0
	fi
	if ! can_apt_install; then
		local -a help=(
			"The promtool tests of metrics/ skip without it (and fail with CI=true). Install it and re-run:"
			"  sudo apt-get install -y --no-install-recommends prometheus   (Debian/Ubuntu; then: sudo systemctl disable --now prometheus)"
			"  or put promtool from https://prometheus.io/download/ in PATH"
		)
		if [[ "${CI:-}" == "true" ]]; then
			die "promtool is not installed and cannot be installed here (needs Debian/Ubuntu with apt-get, as root or with sudo)." "${help[@]}"
		fi
		say "promtool: warning: not installed and cannot be installed here (needs Debian/Ubuntu with apt-get, as root or with sudo)."
		for line in "${help[@]}"; do say "    $line"; done
		return 0
	fi
	before="$(prometheus_daemon_pids)"
	apt_install prometheus --no-install-recommends
	stop_prometheus_daemon
	# A server this install started and the stop above missed: end it by pid.
	after="$(prometheus_daemon_pids)"
	for pid in $after; do
		if ! grep -qx "$pid" <<<"$before"; then
			as_root kill "$pid" 2>/dev/null || true
		fi
	done
	bin="$(command -v promtool)" || die "promtool: the prometheus package is installed but promtool is not in PATH"
	for pid in $(prometheus_daemon_pids); do
		if ! grep -qx "$pid" <<<"$before"; then
			say "promtool: warning: a prometheus server (pid $pid) started by the package is still running; stop it"
		fi
	done
	say "promtool: installed now at $bin (the prometheus server it came with is stopped and disabled)"
}

# ------------------------------------------------------------------ Chromium

# examples/console's browser test runs a headless Chromium through chromedp
# and looks for chromium, then chromium-browser, in PATH (Debian's package is
# chromium). Nothing is started here: the test starts its own browser.
chromium_path() {
	command -v chromium 2>/dev/null || command -v chromium-browser 2>/dev/null
}

ensure_chromium() {
	local how="installed" bin
	if ! bin="$(chromium_path)"; then
		if can_apt_install; then
			# Debian's package; Ubuntu has none of that name (its chromium-browser is a snap).
			apt_install chromium ||
				die "chromium: 'apt-get install chromium' failed (above)." \
					"Install Chromium or Chrome with the binary in PATH as chromium or chromium-browser, and re-run."
			how="installed now"
		fi
		bin="$(chromium_path)" ||
			die "chromium is not installed and cannot be installed here (needs Debian/Ubuntu with apt-get, as root or with sudo)." \
				"The console's browser test (examples/console) drives a headless Chromium and fails without it. Install it and re-run:" \
				"  sudo apt-get install -y chromium   (Debian; chromium-browser on Ubuntu)" \
				"  or any Chromium or Chrome, with the binary in PATH as chromium or chromium-browser"
	fi
	say "chromium: $how at $bin (not started: the test starts its own, headless)"
}

all_services=(postgres mariadb rabbitmq redis pgbouncer promtool chromium)
if (($# == 0)); then set -- "${all_services[@]}"; fi
for service in "$@"; do # check every name before touching anything
	case "$service" in
	postgres | mariadb | rabbitmq | redis | pgbouncer | promtool | chromium) ;;
	*) die "unknown service '$service' (known: ${all_services[*]})" ;;
	esac
done
for service in "$@"; do
	"ensure_$service"
done
