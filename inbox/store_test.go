package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// bundle is what a test of one driver works with: the public store under
// test, and the internal one (the middleware's) to write records with.
type bundle struct {
	ctx   context.Context
	db    sqlschema.DB
	store *inbox.Store
	inner *inboxdb.Store
}

// eachDriver runs f once per driver (testenv.ForEachDriver), each with its
// own migrated schema.
func eachDriver(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	testenv.ForEachDriver(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		f(t, newBundle(t, testenv.WithConn(testenv.Schema(t), d.DB), 60*time.Second))
	})
}

// eachEngine runs f once per driver of either engine
// (testenv.ForEachEngine: PostgreSQL's and MariaDB), each with its own
// migrated schema (on MySQL a database).
func eachEngine(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	testenv.ForEachEngine(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		f(t, newBundle(t, testenv.NewBundle(t, d).DB, 60*time.Second))
	})
}

// mysql is true for a bundle on MySQL/MariaDB.
func (b bundle) mysql() bool { return b.db.Dialect == sqlschema.MySQL }

// sql returns pg or mysql: a test's own statement in the bundle's dialect.
func (b bundle) sql(pg, mysql string) string {
	if b.mysql() {
		return mysql
	}
	return pg
}

// newBundle is the bundle of db (a migrated schema reached through one
// driver), its context bounded by timeout.
func newBundle(t *testing.T, db sqlschema.DB, timeout time.Duration) bundle {
	t.Helper()
	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	t.Cleanup(cancel)
	return bundle{ctx: ctx, db: db, store: store, inner: inner}
}

// claim records (consumer, key) as done, as the middleware's
// transactional mode does.
func (b bundle) claim(t *testing.T, consumer, key string) {
	t.Helper()
	tx, err := b.db.Conn.BeginTx(b.ctx, nil)
	require.NoError(t, err)
	res, err := b.inner.ClaimTx(b.ctx, tx, consumer, key)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, tx.Commit())
}

// park records (consumer, key) as parked with reason, first seen minutes
// ago.
func (b bundle) park(t *testing.T, consumer, key, reason string, minutes int) {
	t.Helper()
	require.NoError(t, b.inner.Park(b.ctx, b.db.Conn, consumer, key, reason, nil))
	if b.mysql() {
		b.exec(t, "UPDATE "+b.db.Inbox()+" SET first_seen_at = UTC_TIMESTAMP(6) - INTERVAL ? MINUTE WHERE consumer = ? AND message_key = ?",
			minutes, consumer, key)
		return
	}
	b.exec(t, "UPDATE "+b.db.Inbox()+" SET first_seen_at = now() - make_interval(mins => $3) WHERE consumer = $1 AND message_key = $2",
		consumer, key, minutes)
}

func (b bundle) exec(t *testing.T, q string, args ...any) int64 {
	t.Helper()
	res, err := b.db.Conn.ExecContext(b.ctx, q, args...)
	require.NoError(t, err)
	n, err := res.RowsAffected()
	require.NoError(t, err)
	return n
}

func TestNewStore(t *testing.T) {
	t.Parallel()
	_, err := inbox.NewStore(sqlschema.DB{})
	require.ErrorContains(t, err, "DB.Conn is nil")
	require.True(t, strings.HasPrefix(err.Error(), "inbox: NewStore: "), err.Error())

	conn := testenv.Drivers(t)[0].DB
	_, err = inbox.NewStore(sqlschema.DB{Conn: conn, InboxTable: `x"; DROP TABLE y; --`})
	require.ErrorContains(t, err, "invalid SQL identifier")
	require.ErrorContains(t, err, "DB.InboxTable")

	s, err := inbox.NewStore(sqlschema.DB{Conn: conn})
	require.NoError(t, err, "the defaults are valid, and NewStore does not touch the database")
	require.NotNil(t, s)
}

func TestStoreGetAndForget(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		_, err := b.store.Get(b.ctx, "c", "missing")
		require.ErrorIs(t, err, inbox.ErrNotFound)
		require.True(t, errors.Is(err, inboxdb.ErrNotFound), "the same sentinel as the store's")
		require.ErrorContains(t, err, "missing")
		require.True(t, strings.HasPrefix(err.Error(), "inbox: get: "), err.Error())
		require.NotErrorIs(t, err, sqlschema.ErrNotMigrated)

		start := time.Now()
		b.claim(t, "c", "k")
		rec, err := b.store.Get(b.ctx, "c", "k")
		require.NoError(t, err)
		require.Equal(t, "c", rec.Consumer)
		require.Equal(t, "k", rec.Key)
		require.Equal(t, "done", rec.Status)
		require.Equal(t, 1, rec.Attempts)
		require.Zero(t, rec.Duplicates)
		require.Nil(t, rec.LeaseUntil)
		require.WithinDuration(t, start, rec.FirstSeenAt, time.Minute)
		require.NotNil(t, rec.ProcessedAt)
		require.Empty(t, rec.LastError)

		// Every column of the record comes through (a lease-mode record
		// whose attempt was interrupted).
		b.exec(t, "INSERT INTO "+b.db.Inbox()+b.sql(` (consumer, message_key, status, attempts, duplicates, lease_until, processed_at, last_error, interrupted, interruptions)
VALUES ('c', 'leased', 'processing', 3, 4, '2030-01-02T03:04:05Z', '2029-01-01T00:00:00Z', 'timeout', true, 2)`,
			` (consumer, message_key, status, attempts, duplicates, lease_until, processed_at, last_error, interrupted, interruptions, first_seen_at)
VALUES ('c', 'leased', 'processing', 3, 4, '2030-01-02 03:04:05', '2029-01-01 00:00:00', 'timeout', true, 2, UTC_TIMESTAMP(6))`))
		rec, err = b.store.Get(b.ctx, "c", "leased")
		require.NoError(t, err)
		inner, err := b.inner.Lookup(b.ctx, b.db.Conn, "c", "leased")
		require.NoError(t, err)
		require.Equal(t, inbox.Record{
			Consumer: "c", Key: "leased", Status: "processing", Attempts: 3, Duplicates: 4,
			LeaseUntil: inner.LeaseUntil, FirstSeenAt: inner.FirstSeenAt, ProcessedAt: inner.ProcessedAt,
			LastError: "timeout", Interrupted: true, Interruptions: 2, Version: rec.Version,
		}, rec)
		require.NotEmpty(t, rec.Version)
		require.True(t, rec.LeaseUntil.Equal(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)), rec.LeaseUntil.String())
		require.True(t, rec.ProcessedAt.Equal(time.Date(2029, 1, 1, 0, 0, 0, 0, time.UTC)), rec.ProcessedAt.String())

		_, err = b.store.Get(b.ctx, "other", "k")
		require.ErrorIs(t, err, inbox.ErrNotFound, "keys are per consumer")

		// Forget: the record goes, once; the next delivery runs again.
		b.claim(t, "c2", "k")
		ok, err := b.store.Forget(b.ctx, "c", "k", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		_, err = b.store.Get(b.ctx, "c", "k")
		require.ErrorIs(t, err, inbox.ErrNotFound)
		_, err = b.store.Get(b.ctx, "c2", "k")
		require.NoError(t, err, "Forget touches one consumer's key only")
		ok, err = b.store.Forget(b.ctx, "c", "k", inbox.Expect{})
		require.NoError(t, err)
		require.False(t, ok, "nothing left to forget")
		b.claim(t, "c", "k") // claimed again: require.True(res.Claimed) inside
	})
}

// TestStoreParkedAndRelease lists parked keys (ListParked, lease mode's
// statements): on PostgreSQL until wt-lease's MySQL statements are merged.
func TestStoreParkedAndRelease(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		b.park(t, "c1", "p-b", "reason b", 10)
		b.park(t, "c1", "p-a", "reason a", 30)
		b.park(t, "c1", "p-c", "reason c", 20)
		b.park(t, "c2", "p-x", "reason x", 25)
		b.claim(t, "c1", "done")

		keys := func(recs []inbox.Record) []string {
			out := []string{}
			for _, r := range recs {
				require.Equal(t, "parked", r.Status)
				out = append(out, r.Consumer+"/"+r.Key)
			}
			return out
		}
		list := func(consumer string, limit int) []string {
			recs, err := b.store.Parked(b.ctx, consumer, limit)
			require.NoError(t, err)
			return keys(recs)
		}
		require.Equal(t, []string{"c1/p-a", "c1/p-c", "c1/p-b"}, list("c1", 0), "oldest first; limit <= 0 means the default")
		require.Equal(t, []string{"c1/p-a", "c1/p-c"}, list("c1", 2))
		require.Equal(t, []string{"c1/p-a", "c2/p-x", "c1/p-c", "c1/p-b"}, list("", 100), "all consumers")
		require.Empty(t, list("nobody", 10))
		recs, err := b.store.Parked(b.ctx, "c2", 1)
		require.NoError(t, err)
		require.Len(t, recs, 1)
		require.Equal(t, "reason x", recs[0].LastError)
		require.Equal(t, 1, recs[0].Attempts)

		// Release: parked -> failed, once; per consumer; only parked keys.
		ok, err := b.store.Release(b.ctx, "c1", "p-c", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		rec, err := b.store.Get(b.ctx, "c1", "p-c")
		require.NoError(t, err)
		require.Equal(t, "failed", rec.Status)
		require.Equal(t, "reason c", rec.LastError, "the reason stays for the record")
		ok, err = b.store.Release(b.ctx, "c1", "p-c", inbox.Expect{})
		require.NoError(t, err)
		require.False(t, ok, "no longer parked")
		for _, k := range []string{"done", "no-such-key"} {
			ok, err = b.store.Release(b.ctx, "c1", k, inbox.Expect{})
			require.NoError(t, err)
			require.False(t, ok, k)
		}
		ok, err = b.store.Release(b.ctx, "c2", "p-a", inbox.Expect{})
		require.NoError(t, err)
		require.False(t, ok, "release is per consumer")
		require.Equal(t, []string{"c1/p-a", "c1/p-b"}, list("c1", 0))
		rec, err = b.store.Get(b.ctx, "c1", "done")
		require.NoError(t, err)
		require.Equal(t, "done", rec.Status)

		// The released key runs again at its next delivery.
		tx, err := b.db.Conn.BeginTx(b.ctx, nil)
		require.NoError(t, err)
		res, err := b.inner.ClaimTx(b.ctx, tx, "c1", "p-c")
		require.NoError(t, err)
		require.True(t, res.Claimed)
		require.NoError(t, tx.Commit())
	})
}

func TestStoreStats(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		empty, err := b.store.Stats(b.ctx, "")
		require.NoError(t, err)
		require.Equal(t, inbox.Stats{Rows: map[string]int64{}}, empty)

		for _, k := range []string{"a-1", "a-2", "a-3"} {
			b.claim(t, "a", k)
		}
		b.exec(t, "UPDATE "+b.db.Inbox()+" SET duplicates = 2 WHERE message_key = 'a-1'")
		b.park(t, "b", "b-parked", "permanent", 0)
		b.exec(t, "INSERT INTO "+b.db.Inbox()+b.sql(` (consumer, message_key, status) VALUES ('b', 'b-failed', 'failed'), ('b', 'b-processing', 'processing')`,
			` (consumer, message_key, status, first_seen_at) VALUES ('b', 'b-failed', 'failed', UTC_TIMESTAMP(6)), ('b', 'b-processing', 'processing', UTC_TIMESTAMP(6))`))
		oldest := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
		b.exec(t, "UPDATE "+b.db.Inbox()+b.sql(" SET first_seen_at = $1", " SET first_seen_at = ?")+" WHERE message_key = 'b-parked'", oldest)

		all, err := b.store.Stats(b.ctx, "")
		require.NoError(t, err)
		require.Equal(t, map[string]int64{"done": 3, "failed": 1, "parked": 1, "processing": 1}, all.Rows)
		require.Equal(t, int64(6), all.Total)
		require.Equal(t, int64(2), all.Duplicates)
		require.NotNil(t, all.OldestFirstSeen)
		require.True(t, oldest.Equal(*all.OldestFirstSeen), all.OldestFirstSeen.String())

		a, err := b.store.Stats(b.ctx, "a")
		require.NoError(t, err)
		require.Equal(t, map[string]int64{"done": 3}, a.Rows)
		require.Equal(t, int64(3), a.Total)
		require.Equal(t, int64(2), a.Duplicates)

		none, err := b.store.Stats(b.ctx, "nobody")
		require.NoError(t, err)
		require.Zero(t, none.Total)
		require.Empty(t, none.Rows)
		require.Nil(t, none.OldestFirstSeen)
	})
}

func TestStorePurge(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		table := b.db.Inbox()
		if b.mysql() { // seq_1_to_25: MariaDB's Sequence engine
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, processed_at, first_seen_at)
SELECT 'c1', CONCAT('old-', seq), IF(seq % 2 = 0, 'done', 'failed'), UTC_TIMESTAMP(6) - INTERVAL 48 HOUR, UTC_TIMESTAMP(6) FROM seq_1_to_25`)
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, processed_at, first_seen_at) VALUES
('c1', 'recent', 'done', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6)),
('c2', 'old-c2', 'done', UTC_TIMESTAMP(6) - INTERVAL 48 HOUR, UTC_TIMESTAMP(6)),
('c1', 'old-processing', 'processing', UTC_TIMESTAMP(6) - INTERVAL 48 HOUR, UTC_TIMESTAMP(6)),
('c1', 'old-parked', 'parked', UTC_TIMESTAMP(6) - INTERVAL 48 HOUR, UTC_TIMESTAMP(6))`)
		} else {
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, processed_at)
SELECT 'c1', 'old-' || g, CASE WHEN g % 2 = 0 THEN 'done' ELSE 'failed' END, now() - interval '48 hours' FROM generate_series(1, 25) g`)
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, processed_at) VALUES
('c1', 'recent', 'done', now()),
('c2', 'old-c2', 'done', now() - interval '48 hours'),
('c1', 'old-processing', 'processing', now() - interval '48 hours'),
('c1', 'old-parked', 'parked', now() - interval '48 hours')`)
		}

		for _, tc := range []struct {
			opts  inbox.PurgeOptions
			field string
		}{
			{inbox.PurgeOptions{}, "OlderThan"},
			{inbox.PurgeOptions{OlderThan: -time.Hour}, "OlderThan"},
			{inbox.PurgeOptions{OlderThan: time.Hour, BatchSize: -1}, "BatchSize"},
		} {
			n, err := b.store.Purge(b.ctx, tc.opts)
			require.ErrorContains(t, err, tc.field, "%+v", tc.opts)
			require.True(t, strings.HasPrefix(err.Error(), "inbox: purge: "), err.Error())
			require.Zero(t, n)
		}

		n, err := b.store.Purge(b.ctx, inbox.PurgeOptions{OlderThan: 24 * time.Hour, Consumer: "c1", BatchSize: 10, MaxBatches: 2})
		require.NoError(t, err)
		require.Equal(t, int64(20), n, "MaxBatches 2 of 10 rows")
		n, err = b.store.Purge(b.ctx, inbox.PurgeOptions{OlderThan: 24 * time.Hour, Consumer: "c1", BatchSize: 10})
		require.NoError(t, err)
		require.Equal(t, int64(5), n, "the rest of c1's old done and failed records")
		n, err = b.store.Purge(b.ctx, inbox.PurgeOptions{OlderThan: 24 * time.Hour})
		require.NoError(t, err)
		require.Equal(t, int64(1), n, "c2's old record")

		rows, err := b.db.Conn.QueryContext(b.ctx, "SELECT message_key FROM "+table+" ORDER BY 1")
		require.NoError(t, err)
		var left []string
		for rows.Next() {
			var k string
			require.NoError(t, rows.Scan(&k))
			left = append(left, k)
		}
		require.NoError(t, rows.Close())
		require.Equal(t, []string{"old-parked", "old-processing", "recent"}, left,
			"recent, processing and parked records are never purged")
	})
}

// Against a schema that was never migrated, every operation says so:
// sqlschema.ErrNotMigrated with the fix, never "not found" or zero rows.
func TestStoreNotMigrated(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		db := sqlschema.DB{Conn: b.db.Conn, Schema: testenv.Unique(t, "eo_none_")}
		t.Cleanup(func() {
			_, _ = b.db.Conn.ExecContext(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE")
		})
		s, err := inbox.NewStore(db)
		require.NoError(t, err)
		check := func(err error) {
			t.Helper()
			require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
			require.NotErrorIs(t, err, inbox.ErrNotFound)
			require.ErrorContains(t, err, "run sqlschema.Migrate")
			require.ErrorContains(t, err, db.Schema)
			require.True(t, strings.HasPrefix(err.Error(), "inbox: "), err.Error())
		}
		_, err = s.Get(b.ctx, "c", "k")
		check(err)
		_, err = s.Forget(b.ctx, "c", "k", inbox.Expect{})
		check(err)
		_, err = s.Parked(b.ctx, "", 0)
		check(err)
		_, err = s.Release(b.ctx, "c", "k", inbox.Expect{})
		check(err)
		_, err = s.Stats(b.ctx, "")
		check(err)
		_, err = s.Purge(b.ctx, inbox.PurgeOptions{OlderThan: time.Hour})
		check(err)
	})
}

// The operator's view of purge exclusivity and progress: a purge that meets
// another's lock returns an error wrapping inbox.ErrPurgeRunning (with the
// "inbox: purge: " prefix); Progress sees every batch. On the partitioned
// layout MaintainPartitions creates the partitions due, and every Store
// method works; on the plain one it is refused.
func TestStorePurgeLockAndPartitions(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		b.exec(t, "INSERT INTO "+b.db.Inbox()+` (consumer, message_key, status, processed_at)
SELECT 'c', 'old-' || g, 'done', now() - interval '48 hours' FROM generate_series(1, 25) g`)
		other, err := b.db.Conn.BeginTx(b.ctx, nil)
		require.NoError(t, err)
		defer func() { _ = other.Rollback() }()
		_, err = other.ExecContext(b.ctx, "SELECT pg_advisory_xact_lock(x'656f7075'::int, hashtext($1))", b.db.Inbox())
		require.NoError(t, err)
		n, err := b.store.Purge(b.ctx, inbox.PurgeOptions{OlderThan: time.Hour})
		require.ErrorIs(t, err, inbox.ErrPurgeRunning)
		require.True(t, strings.HasPrefix(err.Error(), "inbox: purge: "), err.Error())
		require.Zero(t, n)
		require.NoError(t, other.Rollback())

		var seen []int64
		n, err = b.store.Purge(b.ctx, inbox.PurgeOptions{OlderThan: time.Hour, BatchSize: 10, Progress: func(d int64) { seen = append(seen, d) }})
		require.NoError(t, err)
		require.Equal(t, int64(25), n)
		require.Equal(t, []int64{10, 10, 5}, seen)

		_, err = b.store.MaintainPartitions(b.ctx)
		require.ErrorContains(t, err, "not partitioned")

		pdb := testenv.WithConn(testenv.SchemaWith(t, sqlschema.DB{Partitions: &sqlschema.Partitioning{Interval: sqlschema.Hourly, Ahead: 4}}), b.db.Conn)
		ps, err := inbox.NewStore(pdb)
		require.NoError(t, err)
		created, err := ps.MaintainPartitions(b.ctx)
		require.NoError(t, err)
		require.Empty(t, created, "Migrate created them")
		inner, err := inboxdb.NewStore(inboxdb.Config{Tables: pdb})
		require.NoError(t, err)
		pb := bundle{ctx: b.ctx, db: pdb, store: ps, inner: inner}
		pb.claim(t, "c", "k")
		rec, err := ps.Get(b.ctx, "c", "k")
		require.NoError(t, err)
		require.Equal(t, "done", rec.Status)
		st, err := ps.Stats(b.ctx, "c")
		require.NoError(t, err)
		require.Equal(t, int64(1), st.Total)
		require.NoError(t, inner.Park(b.ctx, pdb.Conn, "c", "p", "permanent", nil))
		parked, err := ps.Parked(b.ctx, "c", 0)
		require.NoError(t, err)
		require.Len(t, parked, 1)
		ok, err := ps.Release(b.ctx, "c", "p", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		ok, err = ps.Forget(b.ctx, "c", "k", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		n, err = ps.Purge(b.ctx, inbox.PurgeOptions{OlderThan: time.Hour})
		require.NoError(t, err)
		require.Zero(t, n, "nothing is past retention")
	})
}
