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
// PgBouncer in transaction pooling; and MariaDB (its default isolation,
// REPEATABLE READ: the action's locking read sees the latest commit).
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
					rowActionInterleaved(t, d, newBundle(t, ctx, d.DB, testenv.Schema(t)))
				})
			}
		})
	}
	t.Run(testenv.MariaDB, func(t *testing.T) {
		t.Parallel()
		d := testenv.DriverNamed(t, testenv.MariaDB)
		tb := testenv.NewBundle(t, d)
		tables := tb.DB
		tables.Conn = nil
		rowActionInterleaved(t, d, newBundle(t, tb.Ctx, d.DB, tables))
	})
}

func rowActionInterleaved(t *testing.T, d testenv.Driver, b bundle) {
	ctx := b.ctx
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
			require.NoError(t, seam.QueryRow(ctx, tx, b.sql(`SELECT pg_backend_pid()`, `SELECT CONNECTION_ID()`), nil, &pid))
			_, err = tx.ExecContext(ctx, `UPDATE `+b.tables.Outbox()+` SET failures = 0, attempts = 0, quarantined_at = NULL WHERE id = `+b.sql(`$1`, `?`), ids[0])
			require.NoError(t, err)
			if again {
				_, err = tx.ExecContext(ctx, `UPDATE `+b.tables.Outbox()+` SET failures = 5, attempts = 5, quarantined_at = `+
					b.sql(`clock_timestamp() WHERE id = $1`, `UTC_TIMESTAMP(6) WHERE id = ?`), ids[0])
				require.NoError(t, err)
			}
			done := make(chan error, 1)
			go func() { done <- act(ids[0], outbox.Expect{Version: shown.Version}) }()
			testenv.Eventually(t, 20*time.Second, func() bool {
				var n int
				if b.mysql() {
					// Another session runs the action's locking read of
					// this test's table, which the transaction's lock
					// holds back. (InnoDB's INNODB_TRX does not list
					// MariaDB's wait while the optimizer reads the row by
					// its primary key: the session list does.)
					err := seam.QueryRow(ctx, d.DB, `SELECT COUNT(*) FROM information_schema.PROCESSLIST
WHERE ID <> ? AND LOCATE(?, INFO) > 0 AND LOCATE('FOR UPDATE', INFO) > 0`, []any{pid, b.tables.Outbox()}, &n)
					return err == nil && n > 0
				}
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
}
