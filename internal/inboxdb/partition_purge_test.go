package inboxdb_test

// Retention of the partitioned layout while maintenance is behind: no
// partition covers now, so claims are recorded in the newest partition,
// which is past retention. A purge retiring that partition must never drop
// a record that commits into it while it is being retired, and a claim
// made right after the partition is gone must not fail.

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// fallBehind leaves the table as maintenance that stopped days ago leaves
// it: the newest partition is the one that started daysAgo days before
// today (it ended daysAgo-1 days ago), and none covers now. It returns the
// newest partition's start.
func (b bundle) fallBehind(t *testing.T, daysAgo int) time.Time {
	t.Helper()
	from := b.addPastPartition(t, daysAgo)
	l := b.layout()
	parts, err := l.List(b.ctx, b.db)
	require.NoError(t, err)
	for _, p := range parts {
		if p.From.After(from) {
			b.exec(t, "DROP TABLE "+l.Quoted(p.Name)) // empty: nothing claimed yet
		}
	}
	return from
}

// inFlightClaim is a claim recorded in an open transaction: commit ends it.
type inFlightClaim struct {
	pid       int
	partition string // where the uncommitted record went
	commit    func() error
}

// claimInFlight claims keys (one per path except ClaimBatchTx) through path
// in a transaction it leaves open.
func (b bundle) claimInFlight(t *testing.T, store *inboxdb.Store, path string, keys ...string) inFlightClaim {
	t.Helper()
	var tx wsql.Tx
	var commit func() error
	switch path {
	case "ClaimTx":
		tx = b.begin(t)
		res, err := store.ClaimTx(b.ctx, tx, "c", keys[0])
		require.NoError(t, err)
		require.True(t, res.Claimed)
	case "ClaimBatchTx":
		tx = b.begin(t)
		res, errs, err := store.ClaimBatchTx(b.ctx, tx, "c", keys)
		require.NoError(t, err)
		require.NoError(t, errors.Join(errs...))
		for i := range keys {
			require.True(t, res[i].Claimed)
		}
	case "BeginClaimPgx":
		conn, err := testenv.Pool(t).Acquire(b.ctx)
		require.NoError(t, err)
		t.Cleanup(conn.Release)
		ptx, res, err := store.BeginClaimPgx(b.ctx, conn.Conn(), "c", keys[0])
		require.NoError(t, err)
		require.True(t, res.Claimed)
		t.Cleanup(func() { _ = ptx.Rollback(context.Background()) })
		tx = wsql.TxFromPgx(ptx)
		commit = func() error { return ptx.Commit(b.ctx) }
	default:
		t.Fatalf("unknown claim path %q", path)
	}
	var where string
	require.NoError(t, seam.QueryRow(b.ctx, tx, "SELECT tableoid::regclass::text FROM "+store.Table()+
		" WHERE consumer = 'c' AND message_key = $1", []any{keys[0]}, &where))
	if commit == nil {
		commit = tx.Commit
	}
	return inFlightClaim{pid: b.backendPID(t, tx), partition: where, commit: commit}
}

type purgeResult struct {
	n   int64
	err error
}

// purgeAsync runs store's Purge with opts in a goroutine.
func (b bundle) purgeAsync(store *inboxdb.Store, opts inboxdb.PurgeOptions) <-chan purgeResult {
	done := make(chan purgeResult, 1)
	go func() {
		n, err := store.Purge(b.ctx, b.db, opts)
		done <- purgeResult{n, err}
	}()
	return done
}

// A claim that commits into a partition while a purge retires it.
// Maintenance is behind, so the claim goes into the newest partition, which
// ended yesterday at midnight; it is in flight (its transaction open) when
// Purge(OlderThan: 1h) runs. The purge creates today's partitions; unfenced,
// it would move the records the old partition must keep (it cannot see the
// uncommitted one), detach it (waiting for the claim to commit into it) and
// drop it, record included: the redelivery would run the handler again,
// although the key finished a moment earlier with a 1 h window (seen: the
// record gone, "no record for this consumer and key"). The purge must wait
// for the claim before it looks for the records to keep, and keep it. Each
// claim path (the caller's transaction, group commit, the pgx
// one-round-trip path), both drivers.
func TestPartitionedPurgeKeepsClaimCommittedDuringRetirement(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"ClaimTx", "ClaimBatchTx", "BeginClaimPgx"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()
			eachDriverPartitioned(t, func(t *testing.T, b bundle) {
				l := b.layout()
				old := b.fallBehind(t, 2)
				// Records that are past retention, which the purge drops.
				b.exec(t, "INSERT INTO "+b.store.Table()+` (consumer, message_key, status, first_seen_at, processed_at, partition_at)
SELECT 'c', 'old-' || g, 'done', $1::timestamptz, $1::timestamptz, $1::timestamptz FROM generate_series(1, 10) g`, old.Add(time.Hour))

				keys := []string{"k"}
				if path == "ClaimBatchTx" {
					keys = []string{"k", "k2"}
				}
				claim := b.claimInFlight(t, b.store, path, keys...)
				require.Contains(t, claim.partition, l.Name(old), "a claim while maintenance is behind goes into the newest partition")

				// The purge runs elsewhere (inbox.Store, the CLI): its own store.
				purger, err := inboxdb.NewStore(inboxdb.Config{Tables: b.tables})
				require.NoError(t, err)
				purged := b.purgeAsync(purger, inboxdb.PurgeOptions{OlderThan: time.Hour})
				b.awaitBlocked(t, claim.pid, "the purge waits for the claim in flight")
				require.NoError(t, claim.commit())
				r := <-purged
				require.NoError(t, r.err)
				for _, k := range keys {
					rec, err := b.store.Lookup(b.ctx, b.db, "c", k)
					require.NoError(t, err, "%q finished during the purge, well within OlderThan, and was dropped with its partition", k)
					require.Equal(t, inboxdb.StatusDone, rec.Status)
					require.False(t, b.claim(t, "c", k).Claimed, "the redelivery of %q ran the handler a second time", k)
				}
				require.Equal(t, int64(10), r.n, "the records past retention were dropped")
				still, err := l.List(b.ctx, b.db)
				require.NoError(t, err)
				for _, p := range still {
					require.NotEqual(t, l.Name(old), p.Name, "the partition past retention was dropped")
				}
			})
		})
	}
}

// Right after a purge retired the partition that claims were recorded in
// (maintenance was behind), a store whose knowledge of the partitions
// predates the purge (the middleware's, or any other process's) claims new
// keys through every kind of claim: none may fail. Before the fix they
// failed with "no partition of relation ... found for row" (SQLSTATE 23514)
// until the store's 10 s partition cache expired.
func TestPartitionedClaimsRightAfterRetirement(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		l := b.layout()
		old := b.fallBehind(t, 2)
		require.True(t, b.claim(t, "c", "before").Claimed)
		require.Contains(t, b.partitionOf(t, "c", "before"), l.Name(old))

		purger, err := inboxdb.NewStore(inboxdb.Config{Tables: b.tables})
		require.NoError(t, err)
		_, err = purger.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: time.Hour})
		require.NoError(t, err)
		still, err := l.List(b.ctx, b.db)
		require.NoError(t, err)
		for _, p := range still {
			require.NotEqual(t, l.Name(old), p.Name, "the partition past retention was dropped")
		}
		require.False(t, b.claim(t, "c", "before").Claimed, "the record was moved, not dropped")

		b.claimEveryPath(t, b.store, "after")
		for _, k := range []string{"after-tx", "after-pgx", "after-lease"} {
			require.Contains(t, b.partitionOf(t, "c", k), l.Name(b.today(t)), k)
		}
	})
}

// claimEveryPath claims a new key through every kind of claim with store:
// none may fail, each is claimed once and recorded once.
func (b bundle) claimEveryPath(t *testing.T, store *inboxdb.Store, prefix string) {
	t.Helper()
	k := func(path string) string { return prefix + "-" + path }

	tx := b.begin(t)
	res, err := store.ClaimTx(b.ctx, tx, "c", k("tx"))
	require.NoError(t, err, "ClaimTx")
	require.True(t, res.Claimed)
	require.NoError(t, tx.Commit())

	tx = b.begin(t)
	results, errs, err := store.ClaimBatchTx(b.ctx, tx, "c", []string{k("batch"), k("batch2")})
	require.NoError(t, err, "ClaimBatchTx")
	require.NoError(t, errors.Join(errs...))
	require.True(t, results[0].Claimed)
	require.NoError(t, tx.Commit())

	conn, err := testenv.Pool(t).Acquire(b.ctx)
	require.NoError(t, err)
	defer conn.Release()
	ptx, res, err := store.BeginClaimPgx(b.ctx, conn.Conn(), "c", k("pgx"))
	require.NoError(t, err, "BeginClaimPgx")
	require.True(t, res.Claimed)
	require.NoError(t, ptx.Commit(b.ctx))

	lc, err := store.ClaimLease(b.ctx, b.db, "c", k("lease"), inboxdb.LeaseOptions{Lease: time.Hour})
	require.NoError(t, err, "ClaimLease")
	require.Equal(t, inboxdb.LeaseAcquired, lc.Outcome)

	require.NoError(t, store.Park(b.ctx, b.db, "c", k("park"), "permanent", nil), "Park")

	for _, path := range []string{"tx", "batch", "batch2", "pgx", "lease", "park"} {
		require.Equal(t, int64(1), b.count(t, "message_key = $1", k(path)), "one record of %q", k(path))
	}
}

// A store whose knowledge of the partitions is wrong (it believes a
// partition covers now, as after an operator dropped partitions by hand)
// meets a claim with no partition for its row (SQLSTATE 23514). The claims
// in a transaction of the store's own (BeginClaimPgx, ClaimLease, Park)
// refresh it and retry; the claims in the caller's transaction (ClaimTx,
// ClaimBatchTx) fail with an error wrapping ErrPartitionsChanged, which the
// middleware retries in a new transaction, and the next claim succeeds.
func TestPartitionedClaimRetriesWhenNoPartitionTakesTheRow(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		old := b.fallBehind(t, 2)
		far := b.today(t).AddDate(0, 0, 30)
		for i, path := range []string{"ClaimTx", "ClaimBatchTx"} {
			b.store.PretendPartitionsEnd(far)
			tx := b.begin(t)
			key := fmt.Sprintf("caller-%d", i)
			var err error
			if path == "ClaimTx" {
				_, err = b.store.ClaimTx(b.ctx, tx, "c", key)
			} else {
				_, _, err = b.store.ClaimBatchTx(b.ctx, tx, "c", []string{key})
			}
			require.ErrorIs(t, err, inboxdb.ErrPartitionsChanged, path)
			require.ErrorContains(t, err, "SQLSTATE 23514", path)
			require.NoError(t, tx.Rollback())
			require.True(t, b.claim(t, "c", key).Claimed, "%s: the claim in a new transaction", path)
			require.Contains(t, b.partitionOf(t, "c", key), b.layout().Name(old))
		}

		b.store.PretendPartitionsEnd(far)
		conn, err := testenv.Pool(t).Acquire(b.ctx)
		require.NoError(t, err)
		defer conn.Release()
		ptx, res, err := b.store.BeginClaimPgx(b.ctx, conn.Conn(), "c", "pgx")
		require.NoError(t, err, "BeginClaimPgx")
		require.True(t, res.Claimed)
		require.NoError(t, ptx.Commit(b.ctx))

		b.store.PretendPartitionsEnd(far)
		lc, err := b.store.ClaimLease(b.ctx, b.db, "c", "lease", inboxdb.LeaseOptions{Lease: time.Hour})
		require.NoError(t, err, "ClaimLease")
		require.Equal(t, inboxdb.LeaseAcquired, lc.Outcome)

		b.store.PretendPartitionsEnd(far)
		require.NoError(t, b.store.Park(b.ctx, b.db, "c", "park", "permanent", nil), "Park")

		for _, k := range []string{"pgx", "lease", "park"} {
			require.Contains(t, b.partitionOf(t, "c", k), b.layout().Name(old), k)
		}
	})
}

// A lease-mode attempt whose lease expired is still running when a purge
// moves its record out of a partition past retention; its completion (or
// an extension in its transaction) meets the move. PostgreSQL cannot
// follow a row that an UPDATE moved to another partition: a statement
// that waited for the move fails with a serialization failure ("tuple to
// be locked was already moved to another partition due to concurrent
// update", SQLSTATE 40001), which fails the completion after the handler
// ran, and the attempt runs again. The completion and the extension take
// the key's lock first, as the move does, and then find the record where
// it went. The race is made deterministic: another transaction holds the
// row lock of a second record the same move batch takes, so the move
// holds the first record's row lock (and its key's lock) while the
// completion starts.
func TestPartitionedLeaseCompletionRacingTheMove(t *testing.T) {
	t.Parallel()
	for _, step := range []string{"CompleteTx", "ExtendLease"} {
		t.Run(step, func(t *testing.T) {
			t.Parallel()
			eachDriverPartitioned(t, func(t *testing.T, b bundle) {
				table := b.store.Table()
				l := b.layout()
				p := b.addPastPartition(t, 3)
				const token = "6f1c3c52-8f7a-4d3e-9a51-3a0c2f0e9b11"
				b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, first_seen_at, partition_at, lease_until, lease_token)
VALUES ('c', 'a', 'processing', $1, $1, now() - interval '1 minute', $2)`, p.Add(time.Hour), token)
				b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, first_seen_at, processed_at, partition_at, parked_by_transaction)
VALUES ('c', 'b', 'parked', $1, $1, $1, true)`, p.Add(time.Hour))

				holder := b.begin(t)
				require.Len(t, b.strings(t, "SELECT 'locked'"), 1)
				var one int
				require.NoError(t, seam.QueryRow(b.ctx, holder, "SELECT 1 FROM "+table+" WHERE consumer = 'c' AND message_key = 'b' FOR UPDATE", nil, &one))
				purged := b.purgeAsync(b.store, inboxdb.PurgeOptions{OlderThan: time.Hour})
				b.awaitBlocked(t, b.backendPID(t, holder), "the move waits for b's row lock")
				probe := b.begin(t)
				err := seam.QueryRow(b.ctx, probe, "SELECT 1 FROM "+table+" WHERE consumer = 'c' AND message_key = 'a' FOR UPDATE NOWAIT", nil, &one)
				require.ErrorContains(t, err, "55P03", "the move holds a's row lock")
				require.NoError(t, probe.Rollback())

				completion := b.begin(t)
				pid := b.backendPID(t, completion)
				done := make(chan error, 1)
				go func() {
					if step == "CompleteTx" {
						done <- b.store.CompleteTx(b.ctx, completion, "c", "a", token)
					} else {
						_, err := b.store.ExtendLease(b.ctx, completion, "c", "a", token, time.Hour)
						done <- err
					}
				}()
				testenv.Eventually(t, 10*time.Second, func() bool {
					var n int
					err := seam.QueryRow(b.ctx, b.db, "SELECT cardinality(pg_blocking_pids($1))", []any{pid}, &n)
					return err == nil && n > 0
				}, "the %s waits for the move", step)
				require.NoError(t, holder.Rollback())
				require.NoError(t, <-done, "the %s met the move of its record", step)
				require.NoError(t, completion.Commit())
				r := <-purged
				require.NoError(t, r.err)

				rec, err := b.store.Lookup(b.ctx, b.db, "c", "a")
				require.NoError(t, err)
				if step == "CompleteTx" {
					require.Equal(t, inboxdb.StatusDone, rec.Status)
				} else {
					require.Equal(t, inboxdb.StatusProcessing, rec.Status)
					require.True(t, rec.LeaseUntil.After(time.Now().Add(30*time.Minute)), "extended")
				}
				require.Contains(t, b.partitionOf(t, "c", "a"), l.Name(b.today(t)), "moved")
				require.Contains(t, b.partitionOf(t, "c", "b"), l.Name(b.today(t)), "moved")
				if step == "CompleteTx" {
					require.Equal(t, int64(0), r.n)
					parts, err := l.List(b.ctx, b.db)
					require.NoError(t, err)
					for _, q := range parts {
						require.NotEqual(t, l.Name(p), q.Name, "dropped once its records were moved")
					}
				}
			})
		})
	}
}
