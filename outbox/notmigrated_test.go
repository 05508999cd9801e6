package outbox_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// neverMigrated returns the bundle's driver with a schema of its own that
// nothing ever migrated (dropped at cleanup, should anything create it).
func (b bundle) neverMigrated(t *testing.T) sqlschema.DB {
	t.Helper()
	db := sqlschema.DB{Conn: b.db, Dialect: b.tables.Dialect, Schema: testenv.Unique(t, "eo_none_")}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		drop := b.sql("DROP SCHEMA IF EXISTS "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE", "DROP DATABASE IF EXISTS "+testenv.QuoteMySQL(db.Schema))
		if _, err := b.db.ExecContext(ctx, drop); err != nil {
			t.Errorf("dropping schema %s: %v", db.Schema, err)
		}
	})
	return db
}

// requireNotMigrated asserts that err is sqlschema.ErrNotMigrated with the
// fix in its text: run Migrate, for this schema and table.
func requireNotMigrated(t *testing.T, err error, db sqlschema.DB) {
	t.Helper()
	db = db.WithDefaults()
	require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
	require.ErrorContains(t, err, "run sqlschema.Migrate")
	require.ErrorContains(t, err, `Schema: "`+db.Schema+`"`, "the error names the schema")
	require.ErrorContains(t, err, `OutboxTable: "`+db.OutboxTable+`"`, "the error names the table")
}

// A relay against a schema that was never migrated: Flush returns
// ErrNotMigrated with the fix, and Run logs it, at error level, saying
// what to run, and then polls slowly (MaxErrorBackoff) instead of
// hammering the database.
func TestRelayNotMigrated(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		db := b.neverMigrated(t)
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: &recorder{}, Logger: testenv.Logger(t)})
		require.NoError(t, err, "NewRelay does not touch the database")
		n, err := relay.Flush(b.ctx)
		require.Zero(t, n)
		requireNotMigrated(t, err, db)
		require.ErrorContains(t, err, "outbox relay", "the error says who failed")
		require.ErrorIs(t, relay.Stats().LastError, sqlschema.ErrNotMigrated, "Stats keeps the error as returned, hint included")
		require.Equal(t, int64(1), relay.Stats().Failures)

		logger := watermill.NewCaptureLogger()
		rec := &recorder{}
		relay, err = outbox.NewRelay(outbox.RelayConfig{
			DB: db, Publisher: rec, Logger: logger,
			PollInterval: time.Millisecond, ErrorBackoff: time.Millisecond, MaxErrorBackoff: time.Hour,
		})
		require.NoError(t, err)
		stop := runRelay(t, relay)
		// The failing polls' lines (the start-up check reports the missing
		// migrations too, once: see TestRelayStartupCheck).
		errorLogs := func() []watermill.CapturedMessage {
			var polls []watermill.CapturedMessage
			for _, l := range logger.Captured()[watermill.ErrorLogLevel] {
				if !strings.Contains(l.Msg, "start-up check") {
					polls = append(polls, l)
				}
			}
			return polls
		}
		testenv.Eventually(t, 10*time.Second, func() bool { return len(errorLogs()) > 0 },
			"Run should log that the table is not migrated")
		time.Sleep(200 * time.Millisecond) // time for more polls, were it not waiting MaxErrorBackoff
		stop()
		logs := errorLogs()
		require.Len(t, logs, 1, "one poll, then a wait of MaxErrorBackoff: %+v", logs)
		require.Contains(t, logs[0].Msg, "not migrated")
		require.ErrorIs(t, logs[0].Err, sqlschema.ErrNotMigrated)
		require.ErrorContains(t, logs[0].Err, "sqlschema.Migrate", "the log says what to run")
		require.ErrorContains(t, logs[0].Err, db.Schema)
		require.Zero(t, rec.count())
	})
}

// PendingStats and RequeueFailed against a schema that was never migrated:
// ErrNotMigrated with the fix, never an empty outbox or zero rows (on
// MySQL, a database that does not exist).
func TestOperatorsNotMigrated(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		db := b.neverMigrated(t)
		p, err := mustStore(t, db).Pending(b.ctx)
		requireNotMigrated(t, err, db)
		require.True(t, strings.HasPrefix(err.Error(), "outbox: Pending: "), err.Error())
		require.Zero(t, p)

		n, err := mustStore(t, db).RequeueFailed(b.ctx)
		requireNotMigrated(t, err, db)
		require.True(t, strings.HasPrefix(err.Error(), "outbox: RequeueFailed: "), err.Error())
		require.Zero(t, n)

		// Custom names are named in the fix.
		custom := db
		custom.OutboxTable = "my_outbox"
		_, err = mustStore(t, custom).Pending(b.ctx)
		requireNotMigrated(t, err, custom)
	})
}

// Tables older than the library (a column of a later migration missing)
// are not migrated either.
func TestRelayOlderTablesNotMigrated(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		b.publish(t, "t", message.NewMessage("m1", nil))
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: &recorder{}, Logger: testenv.Logger(t)})
		require.NoError(t, err)

		b.exec(t, "ALTER TABLE "+b.tables.Outbox()+" DROP COLUMN next_attempt_at")
		_, err = relay.Flush(b.ctx)
		requireNotMigrated(t, err, b.tables)

		b.exec(t, "ALTER TABLE "+b.tables.Outbox()+" DROP COLUMN quarantined_at")
		_, err = mustStore(t, b.schema()).Pending(b.ctx)
		requireNotMigrated(t, err, b.tables)
		_, err = mustStore(t, b.schema()).RequeueFailed(b.ctx)
		requireNotMigrated(t, err, b.tables)
	})
}

// syncBuffer is a strings.Builder safe for the relay's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
