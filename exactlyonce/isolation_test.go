package exactlyonce_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// waitForLockWaiter waits until a backend of role waits on a lock: the
// delivery under test is blocked behind the test's uncommitted claim.
func waitForLockWaiter(t *testing.T, pool *pgxpool.Pool, role string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() bool {
		var n int
		err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
WHERE usename = $1 AND wait_event_type = 'Lock'`, role).Scan(&n)
		return err == nil && n > 0
	}, "the delivery never waited for the concurrent claim")
}

// TestIsolationConcurrentCopy: whatever default isolation a shop sets for
// its role or database (read committed, repeatable read, serializable), a
// copy of a message that arrives while another worker's claim of the same
// key is uncommitted waits for it, then acks as a duplicate when it
// committed (the handler does not run) or runs the handler once when it
// rolled back. It is never reported as a database failure. Both modes, both
// drivers.
func TestIsolationConcurrentCopy(t *testing.T) {
	t.Parallel()
	for _, level := range testenv.IsolationLevels {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			dbURL := testenv.DatabaseURLWithIsolation(t, level)
			role := roleOf(t, dbURL)
			admin := testenv.PoolFor(t, testenv.DirectDatabaseURL())
			for _, d := range testenv.DriversFor(t, dbURL) {
				for _, lease := range []*exactlyonce.LeaseConfig{nil, {}} {
					name := fmt.Sprintf("%s/%s", d.Name, modeName(lease))
					t.Run(name, func(t *testing.T) {
						tables := testenv.WithConn(testenv.Schema(t), d.DB)
						var ev testenv.Counters
						eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, Lease: lease, Consumer: "c",
							NackDelay: -1, OnEvent: ev.Observe, Logger: testenv.Logger(t)})
						require.NoError(t, err)
						var runs atomic.Int64
						h := eo.Middleware(func(*message.Message) ([]*message.Message, error) {
							runs.Add(1)
							return nil, nil
						})
						for _, outcome := range []string{"commit", "rollback"} {
							key := "k-" + outcome
							// Another worker's claim of the key, not committed yet.
							other, err := admin.Begin(context.Background())
							require.NoError(t, err)
							// Never left open by a failed assertion: the delivery
							// waiting behind it would never end.
							t.Cleanup(func() { _ = other.Rollback(context.Background()) })
							_, err = other.Exec(context.Background(), `INSERT INTO `+tables.Inbox()+
								` (consumer, message_key, status, attempts, processed_at) VALUES ('c', $1, 'done', 1, now())`, key)
							require.NoError(t, err)

							done := make(chan error, 1)
							go func() {
								_, err := h(message.NewMessage(key, nil))
								done <- err
							}()
							waitForLockWaiter(t, admin, role)
							if outcome == "commit" {
								require.NoError(t, other.Commit(context.Background()))
							} else {
								require.NoError(t, other.Rollback(context.Background()))
							}
							select {
							case err := <-done:
								require.NoError(t, err, "%s: the waiting copy must not fail", outcome)
							case <-time.After(20 * time.Second):
								t.Fatalf("%s: the waiting copy did not finish", outcome)
							}
						}
						require.Equal(t, int64(1), runs.Load(), "the handler ran for the rolled-back claim only")
						require.Equal(t, int64(1), ev.Duplicates.Load(), "the committed claim's copy is a duplicate")
						require.Equal(t, int64(1), ev.Processed.Load())
						require.Zero(t, ev.DBUnavailable.Load())
						require.Zero(t, ev.Failed.Load())
						require.Zero(t, ev.ClaimFailed.Load())
					})
				}
			}
		})
	}
}

func modeName(lease *exactlyonce.LeaseConfig) string {
	if lease != nil {
		return "lease"
	}
	return "transactional"
}

func roleOf(t *testing.T, dbURL string) string {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	return cfg.ConnConfig.User
}
