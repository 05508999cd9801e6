package outbox_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestPendingStats(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, outbox.Pending{}, p, "an empty outbox has no count, no oldest row and no age")

		b.seed(t, seedRow{Topic: "t", UUID: "p-1"}, seedRow{Topic: "t", UUID: "p-2"}, seedRow{Topic: "t", UUID: "p-3"})
		require.Equal(t, int64(1), b.exec(t, "UPDATE "+b.tables.Outbox()+b.sql(
			" SET created_at = now() - interval '90 seconds' WHERE uuid = 'p-2'",
			" SET created_at = UTC_TIMESTAMP(6) - INTERVAL 90 SECOND WHERE uuid = 'p-2'")))

		before := time.Now()
		p, err = mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(3), p.Count)
		require.NotNil(t, p.OldestCreatedAt)
		require.WithinDuration(t, before.Add(-90*time.Second), *p.OldestCreatedAt, 30*time.Second)
		require.GreaterOrEqual(t, p.OldestAge, 90*time.Second)
		require.Less(t, p.OldestAge, 120*time.Second)

		// A quarantined row counts, but not in the lag of the live stream; a
		// row retrying after failures is failing.
		require.Equal(t, int64(1), b.exec(t, "UPDATE "+b.tables.Outbox()+b.sql(
			" SET quarantined_at = now(), failures = 7 WHERE uuid = 'p-2'",
			" SET quarantined_at = UTC_TIMESTAMP(6), failures = 7 WHERE uuid = 'p-2'")))
		require.Equal(t, int64(1), b.exec(t, "UPDATE "+b.tables.Outbox()+" SET failures = 2 WHERE uuid = 'p-3'"))
		p, err = mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(3), p.Count)
		require.Equal(t, int64(1), p.Quarantined)
		require.Equal(t, int64(1), p.Failing)
		require.Less(t, p.OldestAge, 60*time.Second, "the quarantined row is not the oldest of the live stream")
		require.Less(t, before.Add(-60*time.Second), *p.OldestCreatedAt)

		// A transaction sees its own uncommitted rows; others do not.
		tx := b.begin(t)
		b.seedIn(t, tx, seedRow{Topic: "t", UUID: "p-4"})
		require.Equal(t, int64(4), b.pending(t, tx))
		require.Equal(t, int64(3), b.pending(t, b.db))
		require.NoError(t, tx.Rollback())

		bad := b.schema()
		bad.OutboxTable = "no-such table"
		_, err = outbox.NewStore(bad)
		require.ErrorContains(t, err, "invalid SQL identifier")
		require.ErrorContains(t, err, "DB.OutboxTable")
		missing := b.schema()
		missing.OutboxTable = "missing"
		_, err = mustStore(t, missing).Pending(b.ctx)
		require.Error(t, err, "a missing table is an error, not an empty outbox")
		require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
		noConn := b.schema()
		noConn.Conn = nil
		_, err = outbox.NewStore(noConn)
		require.ErrorContains(t, err, "DB.Conn is nil")
	})
}
