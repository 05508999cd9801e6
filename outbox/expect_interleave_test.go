package outbox_test

import (
	"context"
	stdsql "database/sql"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// Requeue and Discard of one row with the version an operator saw, while
// a second operator requeues the row and the relay quarantines it again,
// in a transaction the action waits for: once it commits, the action must
// see the new failure record and refuse (ErrChanged), or, when the row was
// requeued and not quarantined again, refuse as not quarantined; nothing
// done either way. Both drivers, under a database whose default isolation
// is READ COMMITTED, REPEATABLE READ or SERIALIZABLE, and through
// PgBouncer in transaction pooling.
func TestRowActionSeesWhatAnotherPartyDidWhileItWaited(t *testing.T) {
	t.Parallel()
	urls := map[string]func(t *testing.T) string{
		"read-committed":  func(t *testing.T) string { return testenv.DatabaseURL() },
		"repeatable-read": func(t *testing.T) string { return testenv.DatabaseURLWithIsolation(t, testenv.RepeatableRead) },
		"serializable":    func(t *testing.T) string { return testenv.DatabaseURLWithIsolation(t, testenv.Serializable) },
		"pgbouncer":       func(t *testing.T) string { return testenv.PgBouncer(t, "transaction") },
	}
	for name, url := range urls {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			u := url(t)
			for _, d := range testenv.DriversFor(t, u) {
				t.Run(d.Name, func(t *testing.T) {
					ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
					t.Cleanup(cancel)
					b := newBundle(t, ctx, d.DB, testenv.Schema(t))
					db := b.schema()
					for _, verb := range []string{"requeue", "discard"} {
						act := func(id int64, e outbox.Expect) error {
							if verb == "requeue" {
								return mustStore(t, db).Requeue(ctx, id, e)
							}
							return mustStore(t, db).Discard(ctx, id, e)
						}
						for _, again := range []bool{true, false} {
							ids := b.seed(t, seedRow{Topic: "t", UUID: verb + strconv.FormatBool(again), State: outbox.StateQuarantined, LastError: "too large"})
							shown, err := mustStore(t, db).Get(ctx, ids[0])
							require.NoError(t, err)

							tx, err := d.DB.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
							require.NoError(t, err)
							var pid int
							require.NoError(t, seam.QueryRow(ctx, tx, `SELECT pg_backend_pid()`, nil, &pid))
							_, err = tx.ExecContext(ctx, `UPDATE `+b.tables.Outbox()+` SET failures = 0, attempts = 0, quarantined_at = NULL WHERE id = $1`, ids[0])
							require.NoError(t, err)
							if again {
								_, err = tx.ExecContext(ctx, `UPDATE `+b.tables.Outbox()+` SET failures = 5, attempts = 5, quarantined_at = clock_timestamp() WHERE id = $1`, ids[0])
								require.NoError(t, err)
							}
							done := make(chan error, 1)
							go func() { done <- act(ids[0], outbox.Expect{Version: shown.Version}) }()
							testenv.Eventually(t, 20*time.Second, func() bool {
								var n int
								err := seam.QueryRow(ctx, d.DB, `SELECT count(*) FROM pg_stat_activity WHERE `+strconv.Itoa(pid)+` = ANY(pg_blocking_pids(pid))`, nil, &n)
								return err == nil && n > 0
							}, "the %s waits for the other transaction", verb)
							require.NoError(t, tx.Commit())
							err = <-done
							if again {
								require.ErrorIs(t, err, outbox.ErrChanged, verb)
							} else {
								require.ErrorIs(t, err, outbox.ErrNotQuarantined, verb)
							}
							now, err := mustStore(t, db).Get(ctx, ids[0])
							require.NoError(t, err, "%s: the row stays", verb)
							require.Equal(t, again, now.Quarantined(), "%s: untouched", verb)
						}
					}
				})
			}
		})
	}
}
