package testenv

import (
	"context"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// PgBouncer forwards queries in transaction pooling over at most 4 server
// connections, and its cleanup leaves no process and no listener behind.
func TestPgBouncer(t *testing.T) {
	var (
		connString string
		pid        string
	)
	t.Run("running", func(t *testing.T) {
		connString = PgBouncer(t, "transaction")
		u, err := url.Parse(connString)
		require.NoError(t, err)
		require.Equal(t, "127.0.0.1", u.Hostname())
		require.Equal(t, PgBouncerExecMode, u.Query().Get("default_query_exec_mode"))
		pid = pgbouncerPID(t, u.Port())

		cfg, err := pgxpool.ParseConfig(connString)
		require.NoError(t, err)
		cfg.MaxConns = 16
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		defer pool.Close()

		// 16 clients, each in transactions of its own: the backends they
		// see are the pool's 4 at most.
		var mu sync.Mutex
		backends := map[int32]bool{}
		var wg sync.WaitGroup
		for i := 0; i < 16; i++ {
			wg.Go(func() {
				for j := 0; j < 10; j++ {
					var pid int32
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						return tx.QueryRow(ctx, "SELECT pg_backend_pid() FROM pg_sleep(0.005)").Scan(&pid)
					})
					if !assertNoError(t, err) {
						return
					}
					mu.Lock()
					backends[pid] = true
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		require.NotEmpty(t, backends)
		require.LessOrEqual(t, len(backends), 4, "server connections are shared")

		// One client alone: its transactions still run in different
		// server sessions (server_round_robin), so a test relying on
		// session state fails here instead of passing by luck.
		conn, err := pgx.Connect(ctx, connString)
		require.NoError(t, err)
		defer func() { _ = conn.Close(ctx) }()
		sessions := map[int32]bool{}
		for i := 0; i < 8; i++ {
			var pid int32
			require.NoError(t, conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
			sessions[pid] = true
		}
		require.Greater(t, len(sessions), 1, "one client's transactions all ran in one server session")
	})
	require.NotEmpty(t, pid)
	_, err := os.Stat("/proc/" + pid)
	require.True(t, os.IsNotExist(err), "pgbouncer (pid %s) still running after cleanup", pid)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = pgx.Connect(ctx, connString)
	require.Error(t, err, "nothing listens after cleanup")
}

func assertNoError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}

// pgbouncerPID finds the pgbouncer process whose configuration listens on
// port.
func pgbouncerPID(t *testing.T, port string) string {
	t.Helper()
	procs, err := filepath.Glob("/proc/[0-9]*/cmdline")
	require.NoError(t, err)
	for _, p := range procs {
		data, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(data), "\x00"), "\x00")
		if len(args) != 2 || filepath.Base(args[0]) != "pgbouncer" {
			continue
		}
		ini, err := os.ReadFile(args[1])
		if err == nil && strings.Contains(string(ini), "\nlisten_port = "+port+"\n") {
			return strings.Split(p, "/")[2]
		}
	}
	t.Fatalf("no pgbouncer process listens on port %s", port)
	return ""
}
