package inboxdb_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

func TestPurge(t *testing.T) {
	t.Parallel()
	eachEnginePlain(t, func(t *testing.T, b bundle) {
		table := b.store.Table()
		// Consumer c1: 5,000 old rows (done and failed), 100 recent ones, and
		// an old row in each status Purge must keep. Consumer c2: 7 old rows.
		// MariaDB: seq_1_to_N is its Sequence engine's table of 1..N.
		b.exec(t, "INSERT INTO "+table+b.sql(` (consumer, message_key, status)
SELECT 'c1', 'old-' || g, CASE WHEN g % 2 = 0 THEN 'done' ELSE 'failed' END FROM generate_series(1, 5000) g`, ` (consumer, message_key, status, first_seen_at)
SELECT 'c1', CONCAT('old-', seq), IF(seq % 2 = 0, 'done', 'failed'), UTC_TIMESTAMP(6) FROM seq_1_to_5000`))
		b.exec(t, "INSERT INTO "+table+b.sql(` (consumer, message_key, status)
SELECT 'c1', 'recent-' || g, 'done' FROM generate_series(1, 100) g`, ` (consumer, message_key, status, first_seen_at)
SELECT 'c1', CONCAT('recent-', seq), 'done', UTC_TIMESTAMP(6) FROM seq_1_to_100`))
		b.exec(t, "INSERT INTO "+table+b.sql(` (consumer, message_key, status)
SELECT 'c2', 'old-' || g, 'done' FROM generate_series(1, 7) g`, ` (consumer, message_key, status, first_seen_at)
SELECT 'c2', CONCAT('old-', seq), 'done', UTC_TIMESTAMP(6) FROM seq_1_to_7`))
		b.exec(t, "INSERT INTO "+table+b.sql(` (consumer, message_key, status, lease_until) VALUES
('c1', 'old-processing', 'processing', now() + interval '1 hour'), ('c1', 'old-parked', 'parked', NULL)`, ` (consumer, message_key, status, lease_until, first_seen_at) VALUES
('c1', 'old-processing', 'processing', UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UTC_TIMESTAMP(6)), ('c1', 'old-parked', 'parked', NULL, UTC_TIMESTAMP(6))`))
		require.Equal(t, int64(5009), b.exec(t, "UPDATE "+table+
			b.sql(` SET first_seen_at = now() - interval '48 hours' WHERE message_key LIKE 'old-%'`,
				` SET first_seen_at = UTC_TIMESTAMP(6) - INTERVAL 48 HOUR WHERE message_key LIKE 'old-%'`)))
		require.Equal(t, int64(5109), b.count(t, ""))

		opts := inboxdb.PurgeOptions{OlderThan: 24 * time.Hour, Consumer: "c1", BatchSize: 500, MaxBatches: 3}
		n, err := b.store.Purge(b.ctx, b.db, opts)
		require.NoError(t, err)
		require.Equal(t, int64(1500), n, "MaxBatches 3 of 500 rows")
		require.Equal(t, int64(5109-1500), b.count(t, ""))

		opts.MaxBatches = 0
		n, err = b.store.Purge(b.ctx, b.db, opts)
		require.NoError(t, err)
		require.Equal(t, int64(3500), n, "the rest of c1's old done/failed rows")

		require.Equal(t, []string{"old-parked", "old-processing"},
			b.strings(t, "SELECT message_key FROM "+table+" WHERE consumer = 'c1' AND message_key NOT LIKE 'recent-%' ORDER BY 1"),
			"processing and parked rows are never purged")
		require.Equal(t, int64(100), b.count(t, "consumer = 'c1' AND message_key LIKE 'recent-%'"), "recent rows stay")
		require.Equal(t, int64(7), b.count(t, "consumer = 'c2'"), "the consumer filter spares other consumers")

		n, err = b.store.Purge(b.ctx, b.db, opts)
		require.NoError(t, err)
		require.Zero(t, n, "nothing left to purge for c1")

		// All consumers, default batch size.
		n, err = b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: 24 * time.Hour})
		require.NoError(t, err)
		require.Equal(t, int64(7), n)
		require.Equal(t, int64(102), b.count(t, ""))

		// A shorter age reaches the recent rows too, but still not the
		// processing and parked ones.
		n, err = b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: time.Nanosecond, BatchSize: 30})
		require.NoError(t, err)
		require.Equal(t, int64(100), n)
		require.Equal(t, int64(2), b.count(t, ""))
	})
}

func TestPurgeSkipsLockedRows(t *testing.T) {
	t.Parallel()
	eachEnginePlain(t, func(t *testing.T, b bundle) {
		table := b.store.Table()
		b.exec(t, "INSERT INTO "+table+b.sql(` (consumer, message_key, first_seen_at)
SELECT 'c', 'k-' || g, now() - interval '2 days' FROM generate_series(1, 10) g`, ` (consumer, message_key, first_seen_at)
SELECT 'c', CONCAT('k-', seq), UTC_TIMESTAMP(6) - INTERVAL 2 DAY FROM seq_1_to_10`))

		// Another transaction holds a row (a concurrent duplicate claim does).
		tx := b.begin(t)
		res, err := b.store.ClaimTx(b.ctx, tx, "c", "k-1")
		require.NoError(t, err)
		require.False(t, res.Claimed)

		purged := make(chan int64, 1)
		go func() {
			n, err := b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: time.Hour, BatchSize: 3})
			if err != nil {
				n = -1
			}
			purged <- n
		}()
		select {
		case n := <-purged:
			require.Equal(t, int64(9), n, "the locked row is skipped, the others are purged")
		case <-time.After(10 * time.Second):
			if b.mysql() {
				t.Log(b.strings(t, "SELECT CONCAT(COMMAND, ' ', COALESCE(STATE, ''), ' ', COALESCE(INFO, '')) FROM information_schema.PROCESSLIST WHERE TIME_MS > 1000 AND COMMAND <> 'Sleep'"))
			}
			t.Fatal("Purge waited for a locked row instead of skipping it")
		}
		require.NoError(t, tx.Commit())

		n, err := b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: time.Hour})
		require.NoError(t, err)
		require.Equal(t, int64(1), n)
		require.Zero(t, b.count(t, ""))
	})
}

func TestPurgeOptions(t *testing.T) {
	t.Parallel()
	eachEnginePlain(t, func(t *testing.T, b bundle) {
		b.exec(t, "INSERT INTO "+b.store.Table()+b.sql(` (consumer, message_key, first_seen_at)
VALUES ('c', 'k', now() - interval '2 days')`, ` (consumer, message_key, first_seen_at)
VALUES ('c', 'k', UTC_TIMESTAMP(6) - INTERVAL 2 DAY)`))

		for _, tc := range []struct {
			opts  inboxdb.PurgeOptions
			field string
		}{
			{inboxdb.PurgeOptions{}, "OlderThan"},
			{inboxdb.PurgeOptions{OlderThan: -time.Hour}, "OlderThan"},
			{inboxdb.PurgeOptions{OlderThan: time.Hour, BatchSize: -1}, "BatchSize"},
		} {
			n, err := b.store.Purge(b.ctx, b.db, tc.opts)
			require.Error(t, err, "%+v", tc.opts)
			require.Contains(t, err.Error(), tc.field)
			require.Zero(t, n)
		}

		cancelled, cancel := context.WithCancel(b.ctx)
		cancel()
		n, err := b.store.Purge(cancelled, b.db, inboxdb.PurgeOptions{OlderThan: time.Hour})
		require.ErrorIs(t, err, context.Canceled)
		require.Zero(t, n)

		var left int64
		require.NoError(t, seam.QueryRow(b.ctx, b.db, "SELECT COUNT(*) FROM "+b.store.Table(), nil, &left))
		require.Equal(t, int64(1), left, "rejected options delete nothing")
	})
}

// Retention ages a record from when it last finished (processed_at), never
// from when it was first seen: a lease-mode key first seen days ago that
// finished moments ago is kept; one that finished long ago goes.
func TestPurgeAgesByFinish(t *testing.T) {
	t.Parallel()
	eachEnginePlain(t, func(t *testing.T, b bundle) {
		table := b.store.Table()
		b.exec(t, "INSERT INTO "+table+b.sql(` (consumer, message_key, status, first_seen_at, processed_at) VALUES
('c', 'seen-long-ago-finished-now', 'done', now() - interval '5 days', now()),
('c', 'failed-now', 'failed', now() - interval '5 days', now()),
('c', 'finished-long-ago', 'done', now() - interval '5 days', now() - interval '3 days'),
('c', 'failed-long-ago', 'failed', now() - interval '5 days', now() - interval '3 days')`, ` (consumer, message_key, status, first_seen_at, processed_at) VALUES
('c', 'seen-long-ago-finished-now', 'done', UTC_TIMESTAMP(6) - INTERVAL 5 DAY, UTC_TIMESTAMP(6)),
('c', 'failed-now', 'failed', UTC_TIMESTAMP(6) - INTERVAL 5 DAY, UTC_TIMESTAMP(6)),
('c', 'finished-long-ago', 'done', UTC_TIMESTAMP(6) - INTERVAL 5 DAY, UTC_TIMESTAMP(6) - INTERVAL 3 DAY),
('c', 'failed-long-ago', 'failed', UTC_TIMESTAMP(6) - INTERVAL 5 DAY, UTC_TIMESTAMP(6) - INTERVAL 3 DAY)`))
		n, err := b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: 24 * time.Hour})
		require.NoError(t, err)
		require.Equal(t, int64(2), n)
		require.Equal(t, []string{"failed-now", "seen-long-ago-finished-now"},
			b.strings(t, "SELECT message_key FROM "+table+" ORDER BY 1"))
	})
}
