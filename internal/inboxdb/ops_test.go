package inboxdb_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
)

func TestLookup(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		_, err := b.store.Lookup(b.ctx, b.db, "c", "missing")
		require.ErrorIs(t, err, inboxdb.ErrNotFound)
		require.Contains(t, err.Error(), "missing")

		before := time.Now()
		b.claim(t, "c", "k")
		rec, err := b.store.Lookup(b.ctx, b.db, "c", "k")
		require.NoError(t, err)
		require.Equal(t, "c", rec.Consumer)
		require.Equal(t, "k", rec.Key)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 1, rec.Attempts)
		require.Zero(t, rec.Duplicates)
		require.Nil(t, rec.LeaseUntil)
		require.Empty(t, rec.LastError)
		require.WithinDuration(t, before, rec.FirstSeenAt, time.Minute)
		require.NotNil(t, rec.ProcessedAt)
		require.WithinDuration(t, rec.FirstSeenAt, *rec.ProcessedAt, time.Second)

		_, err = b.store.Lookup(b.ctx, b.db, "other", "k")
		require.ErrorIs(t, err, inboxdb.ErrNotFound, "keys are per consumer")

		// Lease-mode columns are read back too.
		b.exec(t, "INSERT INTO "+b.store.Table()+b.sql(` (consumer, message_key, status, attempts, lease_until, last_error)
VALUES ('c', 'leased', 'processing', 3, '2030-01-02T03:04:05Z', 'timeout')`, ` (consumer, message_key, status, attempts, lease_until, last_error, first_seen_at)
VALUES ('c', 'leased', 'processing', 3, '2030-01-02 03:04:05', 'timeout', UTC_TIMESTAMP(6))`))
		rec, err = b.store.Lookup(b.ctx, b.db, "c", "leased")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusProcessing, rec.Status)
		require.Equal(t, 3, rec.Attempts)
		require.Equal(t, "timeout", rec.LastError)
		require.NotNil(t, rec.LeaseUntil)
		require.True(t, rec.LeaseUntil.Equal(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)), rec.LeaseUntil.String())
		require.Nil(t, rec.ProcessedAt)
	})
}

func TestForget(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.claim(t, "c", "k")
		b.claim(t, "c2", "k")
		require.False(t, b.claim(t, "c", "k").Claimed)

		existed, err := b.store.Forget(b.ctx, b.db, "c", "k")
		require.NoError(t, err)
		require.True(t, existed)
		_, err = b.store.Lookup(b.ctx, b.db, "c", "k")
		require.ErrorIs(t, err, inboxdb.ErrNotFound)
		_, err = b.store.Lookup(b.ctx, b.db, "c2", "k")
		require.NoError(t, err, "Forget touches one consumer's key only")

		existed, err = b.store.Forget(b.ctx, b.db, "c", "k")
		require.NoError(t, err)
		require.False(t, existed)

		res := b.claim(t, "c", "k")
		require.True(t, res.Claimed, "a forgotten key runs again")
		rec, err := b.store.Lookup(b.ctx, b.db, "c", "k")
		require.NoError(t, err)
		require.Zero(t, rec.Duplicates, "the new record starts afresh")

		// Forget inside a transaction that rolls back forgets nothing.
		tx := b.begin(t)
		existed, err = b.store.Forget(b.ctx, tx, "c", "k")
		require.NoError(t, err)
		require.True(t, existed)
		require.NoError(t, tx.Rollback())
		require.False(t, b.claim(t, "c", "k").Claimed)
	})
}

func TestStats(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		empty, err := b.store.Stats(b.ctx, b.db, "")
		require.NoError(t, err)
		require.Equal(t, inboxdb.Stats{Rows: map[string]int64{}}, empty)

		for _, k := range []string{"a-1", "a-2", "a-3"} {
			b.claim(t, "a", k)
		}
		b.claim(t, "a", "a-1") // duplicate
		b.claim(t, "a", "a-1") // duplicate
		b.claim(t, "b", "b-1")
		b.claim(t, "b", "b-1") // duplicate
		b.exec(t, "INSERT INTO "+b.store.Table()+b.sql(` (consumer, message_key, status) VALUES
('b', 'b-failed', 'failed'), ('b', 'b-parked', 'parked'), ('b', 'b-processing', 'processing')`, ` (consumer, message_key, status, first_seen_at) VALUES
('b', 'b-failed', 'failed', UTC_TIMESTAMP(6)), ('b', 'b-parked', 'parked', UTC_TIMESTAMP(6)), ('b', 'b-processing', 'processing', UTC_TIMESTAMP(6))`))
		oldest := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
		require.Equal(t, int64(1), b.exec(t, "UPDATE "+b.store.Table()+b.sql(" SET first_seen_at = $1", " SET first_seen_at = ?")+" WHERE consumer = 'b' AND message_key = 'b-parked'", oldest))
		aOldest := time.Date(2002, 1, 1, 0, 0, 0, 0, time.UTC)
		require.Equal(t, int64(1), b.exec(t, "UPDATE "+b.store.Table()+b.sql(" SET first_seen_at = $1", " SET first_seen_at = ?")+" WHERE consumer = 'a' AND message_key = 'a-2'", aOldest))

		all, err := b.store.Stats(b.ctx, b.db, "")
		require.NoError(t, err)
		require.Equal(t, map[string]int64{
			inboxdb.StatusDone: 4, inboxdb.StatusFailed: 1, inboxdb.StatusParked: 1, inboxdb.StatusProcessing: 1,
		}, all.Rows)
		require.Equal(t, int64(7), all.Total)
		require.Equal(t, int64(3), all.Duplicates)
		require.NotNil(t, all.OldestFirstSeen)
		require.True(t, oldest.Equal(*all.OldestFirstSeen), all.OldestFirstSeen.String())

		a, err := b.store.Stats(b.ctx, b.db, "a")
		require.NoError(t, err)
		require.Equal(t, map[string]int64{inboxdb.StatusDone: 3}, a.Rows)
		require.Equal(t, int64(3), a.Total)
		require.Equal(t, int64(2), a.Duplicates)
		require.NotNil(t, a.OldestFirstSeen)
		require.True(t, aOldest.Equal(*a.OldestFirstSeen), a.OldestFirstSeen.String())

		bs, err := b.store.Stats(b.ctx, b.db, "b")
		require.NoError(t, err)
		require.Equal(t, map[string]int64{
			inboxdb.StatusDone: 1, inboxdb.StatusFailed: 1, inboxdb.StatusParked: 1, inboxdb.StatusProcessing: 1,
		}, bs.Rows)
		require.Equal(t, int64(4), bs.Total)
		require.Equal(t, int64(1), bs.Duplicates)

		none, err := b.store.Stats(b.ctx, b.db, "nobody")
		require.NoError(t, err)
		require.Zero(t, none.Total)
		require.Empty(t, none.Rows)
		require.Nil(t, none.OldestFirstSeen)
	})
}
