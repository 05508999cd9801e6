package cluster_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// TestEnvironment: the cluster has three running nodes answering AMQP, and
// a pair streams, fails over and takes writes on the promoted standby.
func TestEnvironment(t *testing.T) {
	_, err := rabbit.Queues("")
	require.NoError(t, err)
	p := pgPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, p.SetReplication(ctx, "a", "remote_apply"))
	c, err := pgx.Connect(ctx, p.URL())
	require.NoError(t, err)
	_, err = c.Exec(ctx, "CREATE TABLE t (x int); INSERT INTO t VALUES (1)")
	require.NoError(t, err)
	_ = c.Close(ctx)
	require.NoError(t, p.Crash("a"))
	require.NoError(t, p.Promote("b"))
	c, err = pgx.Connect(ctx, p.URL())
	require.NoError(t, err)
	defer func() { _ = c.Close(ctx) }()
	var n int
	require.NoError(t, c.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n))
	require.Equal(t, 1, n, "a row committed with remote_apply is on the promoted standby")
}
