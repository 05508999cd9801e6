package inboxdb_test

// The time-partitioned layout (sqlschema.DB.Partitions): a key recorded in
// one partition is recognised by every kind of claim after a partition
// boundary; concurrent claims of one key across a boundary claim it once;
// claims outside READ COMMITTED are refused (they would double-process);
// retention drops old partitions after moving the records it must keep,
// also while claims run.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// eachDriverPartitioned is eachDriver on the partitioned layout only.
func eachDriverPartitioned(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	eachDriverOf(t, []string{"partitioned"}, f)
}

func (b bundle) layout() inboxpart.Layout {
	return inboxpart.Layout{Schema: b.tables.Schema, Table: b.tables.InboxTable, Ahead: b.tables.Partitions.Ahead}
}

// today is the start of the current daily partition, by the database's clock.
func (b bundle) today(t *testing.T) time.Time {
	t.Helper()
	var now time.Time
	require.NoError(t, seam.QueryRow(b.ctx, b.db, "SELECT now()", nil, &now))
	return b.layout().Floor(now)
}

// addPastPartition attaches the daily partition daysAgo days before today,
// named as maintenance names it (so that retention manages it).
func (b bundle) addPastPartition(t *testing.T, daysAgo int) time.Time {
	t.Helper()
	l := b.layout()
	from := b.today(t).AddDate(0, 0, -daysAgo)
	q := l.Quoted(l.Name(from))
	b.exec(t, "CREATE TABLE "+q+" (LIKE "+l.Parent()+" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
	b.exec(t, "ALTER TABLE "+l.Parent()+" ATTACH PARTITION "+q+" FOR VALUES FROM ("+inboxpart.Literal(from)+") TO ("+
		inboxpart.Literal(from.AddDate(0, 0, 1))+")")
	return from
}

// partitionOf names the partition holding (consumer, key).
func (b bundle) partitionOf(t *testing.T, consumer, key string) string {
	t.Helper()
	got := b.strings(t, "SELECT tableoid::regclass::text FROM "+b.store.Table()+" WHERE consumer = $1 AND message_key = $2", consumer, key)
	require.Len(t, got, 1, "records of %q", key)
	return got[0]
}

// A key recorded yesterday (in yesterday's partition) is a duplicate for
// every claim made today, whose new record would go to today's partition:
// per-message (both drivers), the pgx one-round-trip path, group commit,
// lease mode and Park.
func TestPartitionedDuplicateAcrossBoundary(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		yesterday := b.addPastPartition(t, 1)
		table := b.store.Table()
		for _, k := range []string{"tx", "pgx", "batch", "lease", "park", "parked"} {
			status := "done"
			if k == "parked" {
				status = "parked"
			}
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, processed_at, partition_at)
VALUES ('c', $1, $2, $3::timestamptz, $3::timestamptz)`, k, status, yesterday.Add(time.Hour))
			require.Contains(t, b.partitionOf(t, "c", k), b.layout().Name(yesterday))
		}

		res := b.claim(t, "c", "tx")
		require.False(t, res.Claimed, "ClaimTx: recorded yesterday")

		pool := testenv.Pool(t)
		conn, err := pool.Acquire(b.ctx)
		require.NoError(t, err)
		defer conn.Release()
		tx, res, err := b.store.BeginClaimPgx(b.ctx, conn.Conn(), "c", "pgx")
		require.NoError(t, err)
		require.False(t, res.Claimed, "BeginClaimPgx: recorded yesterday")
		require.Nil(t, tx)

		results, errs := b.claimBatch(t, "c", "batch", "parked", "new")
		require.NoError(t, errors.Join(errs...))
		require.False(t, results[0].Claimed, "ClaimBatchTx: recorded yesterday")
		require.Equal(t, inboxdb.StatusParked, results[1].Existing.Status)
		require.True(t, results[2].Claimed)

		lc := leaseClaim(t, b, "c", "lease", time.Hour, retryExpired)
		require.Equal(t, inboxdb.LeaseDuplicate, lc.Outcome, "ClaimLease: recorded yesterday")

		require.NoError(t, b.store.Park(b.ctx, b.db, "c", "park", "permanent", nil))
		rec, err := b.store.Lookup(b.ctx, b.db, "c", "park")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, rec.Status, "Park leaves a done record done")

		for _, k := range []string{"tx", "pgx", "batch", "lease", "park", "parked"} {
			require.Equal(t, int64(1), b.count(t, "message_key = $1", k), "one record of %q", k)
			require.Contains(t, b.partitionOf(t, "c", k), b.layout().Name(yesterday), "%q stays where it was", k)
		}
		require.Equal(t, int64(1), b.count(t, "message_key = 'tx' AND duplicates = 1"))
		require.Equal(t, int64(1), b.count(t, "message_key = 'pgx' AND duplicates = 1"))
		require.Equal(t, int64(1), b.count(t, "message_key = 'batch' AND duplicates = 1"))
		require.Equal(t, int64(1), b.count(t, "message_key = 'lease' AND duplicates = 1"))
	})
}

// Two claims of one key at the same moment, one recorded in yesterday's
// partition (a store whose newest partition ended at midnight, as when
// maintenance fell behind) and one in today's: the second waits for the
// first and then sees its record (committed: a duplicate) or claims the key
// (rolled back). Then 16 claims racing on each of 20 keys, alternating the
// two stores: each key claimed once.
func TestPartitionedConcurrentClaimsAcrossBoundary(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		today := b.today(t)
		b.addPastPartition(t, 1)
		late, err := inboxdb.NewStore(inboxdb.Config{Tables: b.tables})
		require.NoError(t, err)
		late.PretendNewestPartitionEnds(today) // its records go to yesterday's partition

		for _, commit := range []bool{true, false} {
			key := fmt.Sprintf("k-%v", commit)
			tx1 := b.begin(t)
			res, err := late.ClaimTx(b.ctx, tx1, "c", key)
			require.NoError(t, err)
			require.True(t, res.Claimed)

			second := make(chan inboxdb.ClaimResult, 1)
			go func() {
				tx2, err := b.db.BeginTx(b.ctx, nil)
				if err != nil {
					second <- inboxdb.ClaimResult{}
					return
				}
				res, err := b.store.ClaimTx(b.ctx, tx2, "c", key)
				if err != nil {
					_ = tx2.Rollback()
					second <- inboxdb.ClaimResult{}
					return
				}
				_ = tx2.Commit()
				second <- res
			}()
			b.awaitBlocked(t, b.backendPID(t, tx1), "the second claim waits for the first")
			if commit {
				require.NoError(t, tx1.Commit())
			} else {
				require.NoError(t, tx1.Rollback())
			}
			res = <-second
			require.Equal(t, !commit, res.Claimed, "commit %v", commit)
			require.Equal(t, int64(1), b.count(t, "message_key = $1", key))
			want := b.layout().Name(today.AddDate(0, 0, -1))
			if !commit {
				want = b.layout().Name(today)
			}
			require.Contains(t, b.partitionOf(t, "c", key), want)
		}

		const keys, copies = 20, 16
		var claimed [keys]atomic.Int64
		var wg sync.WaitGroup
		errs := make(chan error, keys*copies)
		for i := range keys * copies {
			store := b.store
			if i%2 == 0 {
				store = late
			}
			k := i % keys
			wg.Go(func() {
				tx, err := b.db.BeginTx(b.ctx, nil)
				if err != nil {
					errs <- err
					return
				}
				res, err := store.ClaimTx(b.ctx, tx, "race", fmt.Sprint(k))
				if err != nil {
					_ = tx.Rollback()
					errs <- err
					return
				}
				if err := tx.Commit(); err != nil {
					errs <- err
					return
				}
				if res.Claimed {
					claimed[k].Add(1)
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		for k := range keys {
			require.Equal(t, int64(1), claimed[k].Load(), "key %d claimed once", k)
		}
		require.Equal(t, int64(keys), b.count(t, "consumer = 'race'"))
		require.Equal(t, int64(keys*copies-keys), testenv.Count(t, b.db, "SELECT sum(duplicates) FROM "+b.store.Table()+" WHERE consumer = 'race'"))
	})
}

// Under REPEATABLE READ or SERIALIZABLE a claim's snapshot is taken before
// its key's lock is granted: a claim committed by another transaction in
// between would be invisible and the key claimed twice. The claims in the
// caller's transaction refuse those levels (ErrNeedsReadCommitted), before
// waiting. The scenario: another worker's claim of the key is uncommitted;
// a copy arrives under the stricter level; the other commits. Without the
// refusal the copy claims the key a second time (seen: Claimed true, two
// records).
func TestPartitionedClaimsRefuseSnapshotIsolation(t *testing.T) {
	t.Parallel()
	for _, level := range []string{testenv.RepeatableRead, testenv.Serializable} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			dbURL := testenv.DatabaseURLWithIsolation(t, level)
			for i, d := range testenv.DriversFor(t, dbURL) {
				t.Run(d.Name, func(t *testing.T) {
					tables := testenv.SchemaLayout(t, "partitioned")
					store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
					require.NoError(t, err)
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					defer cancel()
					admin := testenv.Pool(t) // READ COMMITTED
					for _, path := range []string{"ClaimTx", "ClaimBatchTx", "BeginClaimPgx"} {
						if path == "BeginClaimPgx" && i != 0 {
							continue
						}
						key := "k-" + path
						other, err := admin.Begin(ctx)
						require.NoError(t, err)
						t.Cleanup(func() { _ = other.Rollback(context.Background()) })
						res, err := store.ClaimTx(ctx, wsql.TxFromPgx(other), "c", key)
						require.NoError(t, err)
						require.True(t, res.Claimed)

						type outcome struct {
							claimed bool
							err     error
						}
						copyDone := make(chan outcome, 1)
						go func() {
							switch path {
							case "BeginClaimPgx":
								pool := testenv.PoolFor(t, dbURL)
								conn, err := pool.Acquire(ctx)
								if err != nil {
									copyDone <- outcome{err: err}
									return
								}
								defer conn.Release()
								tx, res, err := store.BeginClaimPgx(ctx, conn.Conn(), "c", key)
								o := outcome{claimed: res.Claimed, err: err}
								if tx != nil {
									_ = tx.Commit(ctx)
								}
								copyDone <- o
							default:
								tx, err := d.DB.BeginTx(ctx, nil)
								if err != nil {
									copyDone <- outcome{err: err}
									return
								}
								var claimed bool
								if path == "ClaimTx" {
									var res inboxdb.ClaimResult
									res, err = store.ClaimTx(ctx, tx, "c", key)
									claimed = res.Claimed
								} else {
									var res []inboxdb.ClaimResult
									res, _, err = store.ClaimBatchTx(ctx, tx, "c", []string{key})
									claimed = err == nil && res[0].Claimed
								}
								if err != nil {
									_ = tx.Rollback()
								} else {
									_ = tx.Commit()
								}
								copyDone <- outcome{claimed: claimed, err: err}
							}
						}()
						// Give the copy the time to take its snapshot and
						// wait for the lock, were it allowed to.
						time.Sleep(300 * time.Millisecond)
						require.NoError(t, other.Commit(ctx))
						o := <-copyDone
						require.False(t, o.claimed, "%s under %s claimed a key another transaction had claimed", path, level)
						require.ErrorIs(t, o.err, inboxdb.ErrNeedsReadCommitted, path)
						require.Contains(t, o.err.Error(), level)
						require.Equal(t, int64(1), testenv.Count(t, wsql.BeginnerFromPgx(admin), "SELECT count(*) FROM "+store.Table()+" WHERE message_key = $1", key))
					}
				})
			}
		})
	}
}

// A store unaware of the layout (DB.Partitions left nil in one process)
// fails on a partitioned table instead of recording a key a second time in
// another partition: ON CONFLICT finds no unique index on (consumer,
// message_key), and the pgx path's plain INSERT lacks partition_at (no
// default in the library's table: no partition takes the row).
func TestPartitionedTableRefusesUnawareClaims(t *testing.T) {
	t.Parallel()
	tables := testenv.SchemaWith(t, sqlschema.DB{Partitions: &sqlschema.Partitioning{}})
	unaware := tables
	unaware.Partitions = nil
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: unaware})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool := testenv.Pool(t)
	db := wsql.BeginnerFromPgx(pool)

	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = store.ClaimTx(ctx, tx, "c", "k")
	require.Error(t, err)
	_ = tx.Rollback()

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, _, err = store.BeginClaimPgx(ctx, conn.Conn(), "c", "k")
	require.Error(t, err) // the NULL partition_at has no partition

	_, err = store.ClaimLease(ctx, db, "c", "k", inboxdb.LeaseOptions{Lease: time.Minute})
	require.Error(t, err)
	require.Zero(t, testenv.Count(t, db, "SELECT count(*) FROM "+tables.Inbox()))
}

// A claim at a time no partition covers (maintenance stopped: the newest
// partition ended yesterday) is recorded in the newest partition instead of
// failing, and deduplicates as any other.
func TestPartitionedClaimWithoutCurrentPartition(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		yesterday := b.addPastPartition(t, 1)
		l := b.layout()
		parts, err := l.List(b.ctx, b.db)
		require.NoError(t, err)
		for _, p := range parts {
			if p.From.After(yesterday) {
				b.exec(t, "DROP TABLE "+l.Quoted(p.Name))
			}
		}
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: b.tables})
		require.NoError(t, err)
		b.store = store

		require.True(t, b.claim(t, "c", "k").Claimed)
		require.Contains(t, b.partitionOf(t, "c", "k"), l.Name(yesterday))
		require.False(t, b.claim(t, "c", "k").Claimed)
		results, errs := b.claimBatch(t, "c", "k", "k2")
		require.NoError(t, errors.Join(errs...))
		require.False(t, results[0].Claimed)
		require.True(t, results[1].Claimed)
		require.Equal(t, inboxdb.LeaseAcquired, leaseClaim(t, b, "c", "lease", time.Hour, retryExpired).Outcome)

		created, err := b.store.MaintainPartitions(b.ctx, b.db)
		require.NoError(t, err)
		require.Len(t, created, 3, "today and two ahead")
		require.False(t, b.claim(t, "c", "k").Claimed, "still a duplicate once today's partition exists")
		b.store.PretendNewestPartitionEnds(time.Time{})
		require.True(t, b.claim(t, "c", "k3").Claimed)
		require.Contains(t, b.partitionOf(t, "c", "k3"), l.Name(b.today(t)))
	})
}

// Retention on the partitioned layout: partitions that ended more than
// OlderThan ago are dropped, after the records they must keep (parked,
// failed, processing with an expired lease, done recently) were moved to
// the current partition; a partition holding a live lease waits. The moved
// records keep deduplicating, also for claims running during the purge.
func TestPartitionedPurge(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		table := b.store.Table()
		l := b.layout()
		p3 := b.addPastPartition(t, 3)
		p2 := b.addPastPartition(t, 2)
		p1 := b.addPastPartition(t, 1)
		fill := func(from time.Time, prefix string, n int) {
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, first_seen_at, processed_at, partition_at)
SELECT 'c', $1 || g, 'done', $2::timestamptz, $2::timestamptz, $2::timestamptz FROM generate_series(1, $3) g`, prefix, from.Add(time.Hour), n)
		}
		fill(p3, "p3-", 300)
		fill(p2, "p2-", 200)
		fill(p1, "p1-", 100)
		at := p3.Add(2 * time.Hour)
		b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, first_seen_at, processed_at, partition_at, lease_until, parked_by_transaction) VALUES
('c', 'parked', 'parked', $1, $1, $1, NULL, true),
('c', 'failed', 'failed', $1, $1, $1, NULL, false),
('c', 'expired', 'processing', $1, NULL, $1, $1, false),
('c', 'done-now', 'done', $1, now(), $1, NULL, false)`, at)
		b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, first_seen_at, partition_at, lease_until)
VALUES ('c', 'live', 'processing', $1, $1, now() + interval '1 hour')`, p2.Add(time.Hour))
		for i := range 50 {
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, first_seen_at, processed_at, partition_at, parked_by_transaction)
VALUES ('c', $1, 'parked', $2, $2, $2, true)`, fmt.Sprintf("parked-%d", i), at)
		}

		// Claims of the records to keep run all through the purge: each
		// must be recognised, never claimed.
		stop := make(chan struct{})
		var claimedWrongly, duplicates atomic.Int64
		claimErrs := make(chan error, 1)
		var wg sync.WaitGroup
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				k := fmt.Sprintf("parked-%d", i%50)
				if i%7 == 0 {
					k = "done-now"
				}
				tx, err := b.db.BeginTx(b.ctx, nil)
				if err == nil {
					var res inboxdb.ClaimResult
					res, err = b.store.ClaimTx(b.ctx, tx, "c", k)
					if err == nil {
						err = tx.Commit()
					} else {
						_ = tx.Rollback()
					}
					if res.Claimed {
						claimedWrongly.Add(1)
					} else if err == nil {
						duplicates.Add(1)
					}
				}
				if err != nil {
					select {
					case claimErrs <- fmt.Errorf("claim of %q: %w", k, err):
					default:
					}
				}
			}
		})

		var progress []int64
		n, err := b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: 24 * time.Hour, BatchSize: 7,
			Progress: func(d int64) { progress = append(progress, d) }})
		close(stop)
		wg.Wait()
		require.NoError(t, err)
		select {
		case err := <-claimErrs:
			t.Fatal(err)
		default:
		}
		require.Zero(t, claimedWrongly.Load(), "a record being moved was claimed again")
		require.Positive(t, duplicates.Load())
		require.Equal(t, int64(300), n, "p3's done records; p2 waits for its live lease; p1 is recent")
		require.Equal(t, []int64{300}, progress)

		names := map[string]bool{}
		parts, err := l.List(b.ctx, b.db)
		require.NoError(t, err)
		for _, p := range parts {
			names[p.Name] = true
		}
		require.False(t, names[l.Name(p3)], "p3 dropped")
		require.True(t, names[l.Name(p2)], "p2 holds a live lease")
		require.True(t, names[l.Name(p1)], "p1 is not past retention")
		require.True(t, names[l.Name(b.today(t))])

		for _, k := range []string{"parked", "failed", "expired", "done-now", "parked-0", "parked-49"} {
			rec, err := b.store.Lookup(b.ctx, b.db, "c", k)
			require.NoError(t, err, "%q survived", k)
			require.Contains(t, b.partitionOf(t, "c", k), l.Name(b.today(t)), "%q moved to today's partition", k)
			require.Equal(t, at.UTC(), rec.FirstSeenAt.UTC(), "only partition_at changed")
		}
		require.Equal(t, inboxdb.StatusParked, b.claim(t, "c", "parked").Existing.Status, "a parked record survives its partition's drop")
		require.Equal(t, inboxdb.LeaseBusy, leaseClaim(t, b, "c", "live", time.Hour, retryExpired).Outcome)

		// The live lease ends: the next purge moves it and drops p2.
		b.exec(t, "UPDATE "+table+" SET lease_until = now() - interval '1 second' WHERE message_key = 'live'")
		n, err = b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: 24 * time.Hour})
		require.NoError(t, err)
		require.Equal(t, int64(200), n)
		require.Contains(t, b.partitionOf(t, "c", "live"), l.Name(b.today(t)))
		lc := leaseClaim(t, b, "c", "live", time.Hour, retryExpired)
		require.Equal(t, inboxdb.LeaseAcquired, lc.Outcome)
		require.True(t, lc.Interrupted)
		require.Equal(t, int64(100+4+50+1), b.count(t, ""))

		// A purge without a Consumer drops; with one it deletes rows.
		n, err = b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: time.Hour, Consumer: "c"})
		require.NoError(t, err)
		require.Equal(t, int64(100+1), n, "p1's rows and the failed one, row by row")
	})
}

// Only one purge of a table runs at a time: a purge that finds the purge
// lock taken returns ErrPurgeRunning having deleted nothing; one that loses
// it between batches stops with what it deleted. Both layouts' row purge.
func TestPurgeExclusive(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		table := b.store.Table()
		b.exec(t, "INSERT INTO "+table+` (consumer, message_key, first_seen_at, processed_at)
SELECT 'c', 'k-' || g, now() - interval '2 days', now() - interval '2 days' FROM generate_series(1, 100) g`)
		opts := inboxdb.PurgeOptions{OlderThan: time.Hour, Consumer: "c", BatchSize: 10}
		admin := testenv.Pool(t)
		hold := func() pgx.Tx {
			tx, err := admin.Begin(b.ctx)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
			_, err = tx.Exec(b.ctx, "SELECT pg_advisory_xact_lock(x'656f7075'::int, hashtext($1))", table)
			require.NoError(t, err)
			return tx
		}

		other := hold()
		n, err := b.store.Purge(b.ctx, b.db, opts)
		require.ErrorIs(t, err, inboxdb.ErrPurgeRunning)
		require.Zero(t, n)
		require.Equal(t, int64(100), b.count(t, ""))
		require.NoError(t, other.Rollback(b.ctx))

		var lost pgx.Tx
		opts.Progress = func(int64) {
			if lost == nil {
				lost = hold() // another purge takes over after the first batch
			}
		}
		n, err = b.store.Purge(b.ctx, b.db, opts)
		require.ErrorIs(t, err, inboxdb.ErrPurgeRunning)
		require.Equal(t, int64(10), n, "stopped after its first batch")
		require.NoError(t, lost.Rollback(b.ctx))

		var calls, sum int64
		opts.Progress = func(d int64) { calls++; sum += d }
		n, err = b.store.Purge(b.ctx, b.db, opts)
		require.NoError(t, err)
		require.Equal(t, int64(90), n)
		require.Equal(t, n, sum, "Progress adds up to the rows deleted")
		require.Equal(t, int64(10), calls, "9 full batches and the last, empty one")
	})
}

// Two purges racing on one table, each of many small batches: they never
// hold the purge lock at the same moment (each batch checks, while it
// holds it, that no other batch is inside), every row is deleted once, and
// a purge that meets the other's lock says so.
func TestPurgesRacing(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		table := b.store.Table()
		b.exec(t, "INSERT INTO "+table+` (consumer, message_key, first_seen_at, processed_at)
SELECT 'c', 'k-' || g, now() - interval '2 days', now() - interval '2 days' FROM generate_series(1, 3000) g`)
		var inside, overlaps atomic.Int64
		var totals [2]int64
		var errs [2]error
		var running sync.WaitGroup
		start := make(chan struct{})
		for i := range 2 {
			running.Go(func() {
				<-start
				for {
					n, err := b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: time.Hour, Consumer: "c", BatchSize: 20,
						Progress: func(int64) {
							// Called after the batch committed: the lock is
							// released; what matters is that no two batches'
							// transactions overlapped, which pg_locks shows
							// below. Count concurrent callbacks as a bonus.
							if inside.Add(1) > 1 {
								overlaps.Add(1)
							}
							inside.Add(-1)
						}})
					totals[i] += n
					if !errors.Is(err, inboxdb.ErrPurgeRunning) {
						errs[i] = err
						return
					}
				}
			})
		}
		// While they run, the purge lock never has two holders.
		watch := make(chan int64, 1)
		go func() {
			var most int64
			for range 200 {
				var holders int64
				_ = seam.QueryRow(b.ctx, b.db, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = x'656f7075'::int::oid
AND objid = hashtext($1)::oid AND objsubid = 2 AND granted`, []any{table}, &holders)
				most = max(most, holders)
				time.Sleep(time.Millisecond)
			}
			watch <- most
		}()
		close(start)
		running.Wait()
		require.NoError(t, errs[0])
		require.NoError(t, errs[1])
		require.Equal(t, int64(3000), totals[0]+totals[1], "every row deleted once")
		require.Zero(t, b.count(t, ""))
		require.LessOrEqual(t, <-watch, int64(1), "two holders of the purge lock")
	})
}
