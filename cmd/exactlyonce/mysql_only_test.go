package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// What is PostgreSQL's only is refused on MySQL/MariaDB with a usage error
// that names the flag and says why, before anything is done: the
// time-partitioned inbox (--partitions, $EXACTLYONCE_PARTITIONS, in every
// command and in 'migrate sql --dialect mysql') and the relay's LISTEN
// address for PgBouncer (--listen-url). A --dialect that contradicts the
// URL is refused too; 'migrate sql --dialect mysql' needs no database.
func TestMySQLRefusesPostgreSQLOnlyOptions(t *testing.T) {
	t.Parallel()
	d := testenv.DriverNamed(t, testenv.MariaDB)
	b := testenv.NewBundle(t, d)
	env := engineEnv(b)

	const partitions = "the time-partitioned inbox is PostgreSQL only (docs/mysql.md)"
	for _, args := range [][]string{
		{"--partitions", "daily", "migrate", "up"},
		{"--partitions", "hourly", "inbox", "stats"},
		{"--partitions", "daily", "inbox", "purge", "--older-than", "30d"},
		{"--partitions", "daily", "parked", "list"},
		{"--partitions", "daily", "outbox", "stats"},
	} {
		requireExit(t, cli(t, env, args...), exitUsage, "--partitions "+args[1]+" (or $EXACTLYONCE_PARTITIONS): "+partitions)
	}
	requireExit(t, cli(t, append(env, envPartitions+"=hourly"), "migrate", "status"), exitUsage, partitions)
	requireExit(t, cli(t, nil, "migrate", "sql", "--dialect", "mysql", "--partitions", "daily"), exitUsage, partitions)

	requireExit(t, cli(t, append(env, envAMQPURL+"="+testenv.AMQPURL()), "outbox", "relay", "--once", "--listen-url", "postgres://postgres@127.0.0.1:5432/test"),
		exitUsage, "--listen-url (or $EXACTLYONCE_LISTEN_URL) is PostgreSQL's LISTEN address")
	requireExit(t, cli(t, append(env, envAMQPURL+"="+testenv.AMQPURL(), "EXACTLYONCE_LISTEN_URL=postgres://postgres@127.0.0.1:5432/test"), "outbox", "relay", "--once"),
		exitUsage, "MySQL/MariaDB has no LISTEN")
	requireExit(t, cli(t, env, "--dialect", "postgres", "inbox", "stats"), exitUsage, "--dialect is postgres but the database URL is mysql's")

	r := cli(t, nil, "migrate", "sql", "--dialect", "mysql", "--schema", "shop")
	requireOK(t, r)
	require.Contains(t, r.stdout, "CREATE TABLE IF NOT EXISTS `shop`.`watermill_inbox`")
	require.Contains(t, r.stdout, "ENGINE = InnoDB")
	require.NotContains(t, r.stdout, "PARTITION")

	// Nothing was done: the tables are as the bundle left them.
	requireOK(t, cli(t, env, "inbox", "stats"))
}
