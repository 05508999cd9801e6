package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestQuickstart runs the quickstart on its own schema and queues: run
// fails unless every order took effect exactly once and its event was
// relayed once, with the duplicates and the lost ack's redelivery blocked.
func TestQuickstart(t *testing.T) {
	t.Parallel()
	n := names{
		schema:    testenv.Unique(t, "qs_"),
		orders:    testenv.Queue(t, "qs_orders_"),
		confirmed: testenv.Queue(t, "qs_confirmed_"),
	}
	pool := testenv.Pool(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		_, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{n.schema}.Sanitize()+` CASCADE`)
		require.NoError(t, err)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	require.NoError(t, run(ctx, &out, n), "output:\n%s", out.String())
	require.Contains(t, out.String(), "exactly once")
}
