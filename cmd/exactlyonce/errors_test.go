package main

import (
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Bad input: exit status 2, a one-line message saying what is wrong, and
// where the usage is; nothing is contacted.
func TestUsageErrors(t *testing.T) {
	t.Parallel()
	db := []string{envDatabaseURL + "=postgres://nobody@127.0.0.1:1/none"}
	amqp := append([]string{envAMQPURL + "=amqp://nobody@127.0.0.1:1/"}, db...)
	for _, tc := range []struct {
		env  []string
		args []string
		want string
	}{
		{db, nil, "missing command (one of: inbox, migrate, outbox, parked, ui)"},
		{db, []string{"inbox"}, "missing command (one of: forget, parked, purge, release, show, stats)"},
		{db, []string{"nope"}, `unknown command "nope"`},
		{db, []string{"outbox", "nope"}, `unknown command "nope" for "exactlyonce outbox"`},
		{db, []string{"inbox", "stats", "--bogus"}, "unknown flag: --bogus"},
		{db, []string{"inbox", "stats", "extra"}, `unknown command "extra"`},
		{db, []string{"inbox", "show", "key"}, "--consumer is required"},
		{db, []string{"inbox", "show", "-c", "orders"}, "expected exactly one KEY argument, got 0"},
		{db, []string{"inbox", "show", "-c", "orders", "a", "b"}, "expected exactly one KEY argument, got 2"},
		{db, []string{"inbox", "show", "-c", "orders", ""}, "KEY must not be empty"},
		{db, []string{"inbox", "forget", "-c", "orders", ""}, "KEY must not be empty"},
		{db, []string{"inbox", "release", "k"}, "--consumer is required"},
		{db, []string{"inbox", "parked", "--limit", "0"}, "--limit must be at least 1"},
		{db, []string{"inbox", "purge"}, "--older-than is required"},
		{db, []string{"inbox", "purge", "--older-than", "soon"}, `invalid duration "soon"`},
		{db, []string{"inbox", "purge", "--older-than", "-5h"}, "--older-than must be positive"},
		{db, []string{"inbox", "purge", "--older-than", "1h", "--batch-size", "0"}, "--batch-size must be at least 1"},
		{db, []string{"inbox", "stats", "--schema", "x;DROP TABLE y"}, "DB.Schema"},
		{db, []string{"inbox", "stats", "--inbox-table", "same", "--outbox-table", "same"}, "both"},
		{db, []string{"inbox", "stats", "--timeout", "soon"}, `invalid argument "soon" for "--timeout"`},
		{db, []string{"outbox", "pending", "--quarantined", "--failing"}, "exclude each other"},
		{nil, []string{"inbox", "stats"}, "no database: set DATABASE_URL or --database-url"},
		{[]string{envDatabaseURL + "=postgres://u:secret@host:port/db"}, []string{"inbox", "stats"}, "invalid database URL"},
		{db, []string{"outbox", "relay"}, "no broker: set AMQP_URL or --amqp-url"},
		{amqp, []string{"outbox", "relay", "--publisher", "kafka"}, `--publisher "kafka"`},
		{amqp, []string{"outbox", "relay", "--batch-size", "0"}, "--batch-size must be 1..10000"},
		{amqp, []string{"outbox", "relay", "--workers", "0"}, "--workers must be 1..64"},
		{amqp, []string{"outbox", "relay", "--poll-interval", "0s"}, "must be positive"},
		{amqp, []string{"outbox", "relay", "--log-level", "loud"}, `--log-level "loud"`},
	} {
		r := cli(t, tc.env, tc.args...)
		requireExit(t, r, exitUsage, tc.want)
		require.NotContains(t, r.stderr, "secret", "no password in messages")
	}

	r := cli(t, nil, "--help")
	requireOK(t, r)
	require.Contains(t, r.stdout, "Exit status: 0 ok, 1 the operation")
	require.Contains(t, r.stdout, "3 no such record")
}

// A database that refuses connections, and one that accepts them and never
// answers: exit status 1 with one clear line, well within the timeouts,
// also with --json (which prints nothing on stdout then).
func TestUnreachableDatabase(t *testing.T) {
	t.Parallel()
	// A closed port: connection refused.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closedPort := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())

	// A port that accepts and then says nothing.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var conns []net.Conn
	var mu sync.Mutex
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	})
	t.Cleanup(func() {
		_ = silent.Close()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	silentPort := silent.Addr().(*net.TCPAddr).Port

	url := func(port int) []string {
		return []string{envDatabaseURL + "=postgres://postgres@127.0.0.1:" + strconv.Itoa(port) + "/test?sslmode=disable"}
	}
	for _, args := range [][]string{
		{"inbox", "stats"}, {"inbox", "stats", "--json"}, {"migrate", "up"}, {"migrate", "status", "--json"},
		{"outbox", "pending"}, {"inbox", "purge", "--older-than", "30d"},
	} {
		r := cli(t, url(closedPort), args...)
		requireExit(t, r, exitFailed, "cannot connect to PostgreSQL")
		require.Contains(t, r.stderr, "connection refused")
		require.Less(t, r.took, 15*time.Second)
	}

	// Without sslmode pgx tries twice (TLS, then plain) and says so twice:
	// said once.
	r := cli(t, []string{envDatabaseURL + "=postgres://postgres@127.0.0.1:" + strconv.Itoa(closedPort) + "/test"}, "inbox", "stats")
	requireExit(t, r, exitFailed, "cannot connect to PostgreSQL")
	require.Equal(t, 1, strings.Count(r.stderr, "connection refused"), "%s", r)

	r = cli(t, url(silentPort), "inbox", "stats", "--connect-timeout", "1s")
	requireExit(t, r, exitFailed, "cannot connect to PostgreSQL")
	require.Less(t, r.took, 10*time.Second, "the connect timeout bounds it")

	r = cli(t, append(url(silentPort), envAMQPURL+"=amqp://guest:guest@127.0.0.1:1/"), "outbox", "relay", "--once", "--connect-timeout", "1s")
	requireExit(t, r, exitFailed, "cannot connect to PostgreSQL")
	require.Less(t, r.took, 10*time.Second)
}
