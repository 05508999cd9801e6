package exactlyonce_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
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
// rolled back. It is never reported as a database failure. Both modes, on
// either engine (MariaDB: the session's default isolation).
func TestIsolationConcurrentCopy(t *testing.T) {
	t.Parallel()
	for _, level := range testenv.IsolationLevels {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			dbURL := testenv.DatabaseURLWithIsolation(t, level)
			role := roleOf(t, dbURL)
			admin := testenv.PoolFor(t, testenv.DirectDatabaseURL())
			drivers := testenv.DriversFor(t, dbURL)
			drivers = append(drivers, testenv.MySQLDriverWithIsolation(t, level))
			for _, d := range drivers {
				for _, lease := range []*exactlyonce.LeaseConfig{nil, {}} {
					name := fmt.Sprintf("%s/%s", d.Name, modeName(lease))
					t.Run(name, func(t *testing.T) {
						b := testenv.NewBundle(t, d)
						// Another worker: PostgreSQL's superuser pool (its
						// own default isolation), or another MariaDB
						// connection of the pool.
						otherConn, waitForWaiter := wsql.BeginnerFromPgx(admin), func() { waitForLockWaiter(t, admin, role) }
						if b.MySQL() {
							otherConn, waitForWaiter = d.DB, func() { b.WaitForLockWaiter(t) }
						}
						var ev testenv.Counters
						eo, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Lease: lease, Consumer: "c",
							NackDelay: -1, OnEvent: ev.Observe, Logger: testenv.Logger(t)})
						require.NoError(t, err)
						var runs atomic.Int64
						h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
							runs.Add(1)
							if b.MySQL() && lease == nil {
								// The handler's transaction has the level.
								var got string
								if err := testenv.QueryRow(msg.Context(), "SELECT @@tx_isolation", nil, &got); err != nil {
									return nil, err
								}
								if want := strings.ToUpper(strings.ReplaceAll(level, " ", "-")); got != want {
									return nil, fmt.Errorf("the handler's transaction is %s, want %s", got, want)
								}
							}
							return nil, nil
						})
						for _, outcome := range []string{"commit", "rollback"} {
							key := "k-" + outcome
							// Another worker's claim of the key, not committed yet.
							other, err := otherConn.BeginTx(context.Background(), nil)
							require.NoError(t, err)
							// Never left open by a failed assertion: the delivery
							// waiting behind it would never end.
							t.Cleanup(func() { _ = other.Rollback() })
							_, err = other.ExecContext(context.Background(), b.SQL(
								`INSERT INTO `+b.DB.Inbox()+` (consumer, message_key, status, attempts, processed_at) VALUES ('c', $1, 'done', 1, now())`,
								`INSERT INTO `+b.DB.Inbox()+` (consumer, message_key, status, attempts, first_seen_at, processed_at)
VALUES ('c', ?, 'done', 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))`), key)
							require.NoError(t, err)

							done := make(chan error, 1)
							go func() {
								_, err := h(message.NewMessage(key, nil))
								done <- err
							}()
							waitForWaiter()
							if outcome == "commit" {
								require.NoError(t, other.Commit())
							} else {
								require.NoError(t, other.Rollback())
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
