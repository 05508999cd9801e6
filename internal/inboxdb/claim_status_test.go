package inboxdb_test

// Transactional claims of parked and failed records, and Store.Park: a key
// parked by a Permanent handler error is acked without running again; a key
// an operator released (failed) is claimed again, in the caller's
// transaction.

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// insertRecord writes a record in status with attempts and lastError, as a
// previous run left it.
func (b bundle) insertRecord(t *testing.T, consumer, key, status string, attempts int, lastError string) inboxdb.Record {
	t.Helper()
	// A failed record here is one a transactional consumer parked and an
	// operator released (parked_by_transaction); lease mode's own failed
	// records are TestClaimsRefuseLeaseFailed's.
	if b.mysql() {
		b.exec(t, "INSERT INTO "+b.store.Table()+` (consumer, message_key, status, attempts, processed_at, last_error, parked_by_transaction, first_seen_at)
VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, ?, ?, UTC_TIMESTAMP(6) - INTERVAL 2 HOUR)`, consumer, key, status, attempts, lastError, status == inboxdb.StatusFailed)
	} else {
		b.exec(t, "INSERT INTO "+b.store.Table()+` (consumer, message_key, status, attempts, processed_at, last_error, parked_by_transaction)
VALUES ($1, $2, $3, $4, now() - interval '1 hour', $5, $3 = 'failed')`, consumer, key, status, attempts, lastError)
	}
	rec, err := b.store.Lookup(b.ctx, b.db, consumer, key)
	require.NoError(t, err)
	return rec
}

func TestClaimTxParked(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		before := b.insertRecord(t, "c", "k", inboxdb.StatusParked, 1, "400 invalid phone number")

		for i := int64(1); i <= 2; i++ {
			tx := b.begin(t)
			res, err := b.store.ClaimTx(b.ctx, tx, "c", "k")
			require.NoError(t, err, "a parked key is not an error")
			require.False(t, res.Claimed, "a parked key is not run again")
			require.Equal(t, inboxdb.StatusParked, res.Existing.Status)
			require.Equal(t, "c", res.Existing.Consumer)
			require.Equal(t, "k", res.Existing.Key)
			require.Equal(t, 1, res.Existing.Attempts)
			require.Equal(t, "400 invalid phone number", res.Existing.LastError)
			require.Equal(t, i, res.Existing.Duplicates, "the duplicate counter includes this delivery")
			require.NoError(t, tx.Commit())
		}

		// A duplicate seen by a transaction that rolls back is not counted.
		tx := b.begin(t)
		res, err := b.store.ClaimTx(b.ctx, tx, "c", "k")
		require.NoError(t, err)
		require.False(t, res.Claimed)
		require.NoError(t, tx.Rollback())

		rec, err := b.store.Lookup(b.ctx, b.db, "c", "k")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusParked, rec.Status, "still parked, for an operator")
		require.Equal(t, int64(2), rec.Duplicates)
		require.Equal(t, before.Attempts, rec.Attempts)
		require.Equal(t, before.LastError, rec.LastError)
		require.True(t, before.ProcessedAt.Equal(*rec.ProcessedAt), "a duplicate does not finish the record again")
	})
}

func TestClaimTxReclaimsFailed(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		before := b.insertRecord(t, "c", "k", inboxdb.StatusFailed, 2, "released by an operator")

		// Claimed inside the transaction; a rollback restores the record.
		tx := b.begin(t)
		res, err := b.store.ClaimTx(b.ctx, tx, "c", "k")
		require.NoError(t, err)
		require.True(t, res.Claimed, "a released key runs again")
		require.Zero(t, res.Existing)
		inside, err := b.store.Lookup(b.ctx, tx, "c", "k")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, inside.Status)
		require.Equal(t, 3, inside.Attempts)
		require.Empty(t, inside.LastError)
		require.Zero(t, inside.Duplicates)
		require.True(t, inside.ProcessedAt.After(*before.ProcessedAt))
		outside, err := b.store.Lookup(b.ctx, b.db, "c", "k")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusFailed, outside.Status, "invisible to others before commit")
		require.NoError(t, tx.Rollback())

		rec, err := b.store.Lookup(b.ctx, b.db, "c", "k")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusFailed, rec.Status, "the rollback restores the failed record")
		require.Equal(t, 2, rec.Attempts)
		require.Equal(t, "released by an operator", rec.LastError)
		require.True(t, before.ProcessedAt.Equal(*rec.ProcessedAt))

		// Claimed and committed: done, and the next delivery a duplicate.
		res = b.claim(t, "c", "k")
		require.True(t, res.Claimed)
		rec, err = b.store.Lookup(b.ctx, b.db, "c", "k")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 3, rec.Attempts)
		require.Empty(t, rec.LastError)
		res = b.claim(t, "c", "k")
		require.False(t, res.Claimed)
		require.Equal(t, inboxdb.StatusDone, res.Existing.Status)
		require.Equal(t, int64(1), res.Existing.Duplicates)
	})
}

// Two transactions claim a released key at once: one runs it, the other
// waits for it and then sees a duplicate (or claims it, if the first rolled
// back), as with a new key.
func TestClaimTxReclaimsFailedOnce(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		for _, commit := range []bool{true, false} {
			key := "k-rollback"
			if commit {
				key = "k-commit"
			}
			b.insertRecord(t, "c", key, inboxdb.StatusFailed, 1, "boom")
			tx1 := b.begin(t)
			res, err := b.store.ClaimTx(b.ctx, tx1, "c", key)
			require.NoError(t, err)
			require.True(t, res.Claimed)

			tx2 := b.begin(t)
			type outcome struct {
				res inboxdb.ClaimResult
				err error
			}
			done := make(chan outcome, 1)
			go func() {
				res, err := b.store.ClaimTx(b.ctx, tx2, "c", key)
				done <- outcome{res, err}
			}()
			select {
			case o := <-done:
				t.Fatalf("the second claim returned while the first was open: %+v, %v", o.res, o.err)
			case <-time.After(200 * time.Millisecond):
			}
			if commit {
				require.NoError(t, tx1.Commit())
			} else {
				require.NoError(t, tx1.Rollback())
			}
			var o outcome
			select {
			case o = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("the second claim did not return within 10s after the first transaction ended")
			}
			require.NoError(t, o.err)
			require.NoError(t, tx2.Commit())
			rec, err := b.store.Lookup(b.ctx, b.db, "c", key)
			require.NoError(t, err)
			require.Equal(t, inboxdb.StatusDone, rec.Status)
			require.Equal(t, 2, rec.Attempts, "the key ran once more, not twice")
			if commit {
				require.False(t, o.res.Claimed, "the first claim committed: a duplicate")
				require.Equal(t, int64(1), rec.Duplicates)
			} else {
				require.True(t, o.res.Claimed, "the first claim rolled back: the second runs it")
				require.Zero(t, rec.Duplicates)
			}
		}
	})
}

func TestBeginClaimPgxParkedAndFailed(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, layout string) {
		tables := testenv.SchemaLayout(t, layout)
		pool := testenv.Pool(t)
		db := wsql.BeginnerFromPgx(pool)
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		b := bundle{db: db, tables: tables, store: store}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		b.ctx = ctx

		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		defer conn.Release()
		c := conn.Conn()
		idle := func() { require.Equal(t, byte('I'), c.PgConn().TxStatus(), "conn must be left outside a transaction") }

		// Parked: not claimed, no tx, the duplicate counted.
		b.insertRecord(t, "c", "parked", inboxdb.StatusParked, 1, "permanent")
		for i := int64(1); i <= 2; i++ {
			tx, res, err := store.BeginClaimPgx(ctx, c, "c", "parked")
			require.NoError(t, err)
			require.Nil(t, tx)
			require.False(t, res.Claimed)
			require.Equal(t, inboxdb.StatusParked, res.Existing.Status)
			require.Equal(t, "permanent", res.Existing.LastError)
			require.Equal(t, i, res.Existing.Duplicates)
			idle()
		}
		rec, err := store.Lookup(ctx, db, "c", "parked")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusParked, rec.Status)
		require.Equal(t, int64(2), rec.Duplicates)
		require.Equal(t, 1, rec.Attempts)

		// Failed (released): claimed in the returned tx; a rollback restores it.
		b.insertRecord(t, "c", "failed", inboxdb.StatusFailed, 2, "released")
		tx, res, err := store.BeginClaimPgx(ctx, c, "c", "failed")
		require.NoError(t, err)
		require.True(t, res.Claimed)
		require.NotNil(t, tx)
		inside, err := store.Lookup(ctx, wsql.TxFromPgx(tx), "c", "failed")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, inside.Status)
		require.Equal(t, 3, inside.Attempts)
		require.Empty(t, inside.LastError)
		require.NoError(t, tx.Rollback(ctx))
		idle()
		rec, err = store.Lookup(ctx, db, "c", "failed")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusFailed, rec.Status, "the rollback restores the failed record")
		require.Equal(t, 2, rec.Attempts)
		require.Equal(t, "released", rec.LastError)

		// Claimed and committed: done; the next delivery is a duplicate.
		tx, res, err = store.BeginClaimPgx(ctx, c, "c", "failed")
		require.NoError(t, err)
		require.True(t, res.Claimed)
		require.NoError(t, tx.Commit(ctx))
		idle()
		rec, err = store.Lookup(ctx, db, "c", "failed")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 3, rec.Attempts)
		tx, res, err = store.BeginClaimPgx(ctx, c, "c", "failed")
		require.NoError(t, err)
		require.Nil(t, tx)
		require.False(t, res.Claimed)
		require.Equal(t, inboxdb.StatusDone, res.Existing.Status)
		idle()
	})
}

// TestPark uses lease mode too: on PostgreSQL until lease mode's MySQL
// statements are merged (wt-lease).
func TestPark(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		lookup := func(key string) inboxdb.Record {
			t.Helper()
			rec, err := b.store.Lookup(b.ctx, b.db, "c", key)
			require.NoError(t, err)
			return rec
		}

		t.Run("new key", func(t *testing.T) {
			start := time.Now()
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "new", "400 invalid phone number", nil))
			rec := lookup("new")
			require.Equal(t, inboxdb.StatusParked, rec.Status)
			require.Equal(t, "400 invalid phone number", rec.LastError)
			require.Equal(t, 1, rec.Attempts)
			require.Zero(t, rec.Duplicates)
			require.Nil(t, rec.LeaseUntil)
			require.NotNil(t, rec.ProcessedAt, "parking finishes the record")
			require.WithinRange(t, *rec.ProcessedAt, start.Add(-time.Minute), time.Now().Add(time.Minute))

			// Parked for good: a later delivery is acked, not run.
			res := b.claim(t, "c", "new")
			require.False(t, res.Claimed)
			require.Equal(t, inboxdb.StatusParked, res.Existing.Status)
		})

		t.Run("done stays done", func(t *testing.T) {
			require.True(t, b.claim(t, "c", "done").Claimed)
			before := lookup("done")
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "done", "too late", nil))
			rec := lookup("done")
			require.Equal(t, inboxdb.StatusDone, rec.Status, "a key done in the meantime keeps its outcome")
			require.Empty(t, rec.LastError)
			require.Equal(t, before.Attempts, rec.Attempts)
			require.True(t, before.ProcessedAt.Equal(*rec.ProcessedAt))
		})

		t.Run("failed is parked again", func(t *testing.T) {
			b.insertRecord(t, "c", "failed", inboxdb.StatusFailed, 2, "released by an operator")
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "failed", "still invalid", nil))
			rec := lookup("failed")
			require.Equal(t, inboxdb.StatusParked, rec.Status)
			require.Equal(t, "still invalid", rec.LastError, "the new reason replaces the old one")
			require.Equal(t, 3, rec.Attempts, "the released attempt counts")
			require.WithinDuration(t, time.Now(), *rec.ProcessedAt, time.Minute, "finished now, not an hour ago")
		})

		t.Run("parked and processing are left alone", func(t *testing.T) {
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "parked", "first reason", nil))
			before := lookup("parked")
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "parked", "second reason", nil))
			rec := lookup("parked")
			require.Equal(t, inboxdb.StatusParked, rec.Status)
			require.Equal(t, "first reason", rec.LastError)
			require.Equal(t, before.Attempts, rec.Attempts)

			lc, err := b.store.ClaimLease(b.ctx, b.db, "c", "leased", inboxdb.LeaseOptions{Lease: time.Hour})
			require.NoError(t, err)
			require.Equal(t, inboxdb.LeaseAcquired, lc.Outcome)
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "leased", "not mine", nil))
			rec = lookup("leased")
			require.Equal(t, inboxdb.StatusProcessing, rec.Status, "a lease-mode attempt in flight is not disturbed")
			require.Empty(t, rec.LastError)
			ok, err := b.store.Owns(b.ctx, b.db, "c", "leased", lc.Token)
			require.NoError(t, err)
			require.True(t, ok)
		})

		t.Run("reason made storable", func(t *testing.T) {
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "bad-text", "bad \xff byte, nul \x00 here", nil))
			require.Equal(t, "bad \uFFFD byte, nul \uFFFD here", lookup("bad-text").LastError)
		})

		t.Run("in a transaction that rolls back", func(t *testing.T) {
			tx := b.begin(t)
			require.NoError(t, b.store.Park(b.ctx, tx, "c", "rolled-back", "x", nil))
			require.NoError(t, tx.Rollback())
			_, err := b.store.Lookup(b.ctx, b.db, "c", "rolled-back")
			require.ErrorIs(t, err, inboxdb.ErrNotFound)
		})

		t.Run("released, claimed again", func(t *testing.T) {
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "cycle", "permanent", nil))
			ok, err := b.store.Release(b.ctx, b.db, "c", "cycle")
			require.NoError(t, err)
			require.True(t, ok)
			res := b.claim(t, "c", "cycle")
			require.True(t, res.Claimed, "a released key runs again")
			rec := lookup("cycle")
			require.Equal(t, inboxdb.StatusDone, rec.Status)
			require.Equal(t, 2, rec.Attempts)
		})
	})
}

// TestClaimsRefuseLeaseFailed: a failed record written by lease mode (its
// handler failed; its next delivery retries) is never taken over by a
// transactional claim, on any path: ErrNotDone, and the record unchanged.
func TestClaimsRefuseLeaseFailed(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.exec(t, "INSERT INTO "+b.store.Table()+b.sql(` (consumer, message_key, status, attempts, processed_at, last_error)
VALUES ('c', 'lease-failed', 'failed', 1, now(), 'provider 500')`, ` (consumer, message_key, status, attempts, processed_at, last_error, first_seen_at)
VALUES ('c', 'lease-failed', 'failed', 1, UTC_TIMESTAMP(6), 'provider 500', UTC_TIMESTAMP(6))`))
		tx := b.begin(t)
		_, err := b.store.ClaimTx(b.ctx, tx, "c", "lease-failed")
		require.ErrorIs(t, err, inboxdb.ErrNotDone)
		_ = tx.Rollback()

		tx = b.begin(t)
		res, errs, err := b.store.ClaimBatchTx(b.ctx, tx, "c", []string{"lease-failed", "new"})
		require.NoError(t, err)
		require.ErrorIs(t, errs[0], inboxdb.ErrNotDone)
		require.False(t, res[0].Claimed)
		require.True(t, res[1].Claimed)
		_ = tx.Rollback()

		rec, err := b.store.Lookup(b.ctx, b.db, "c", "lease-failed")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusFailed, rec.Status)
		require.Equal(t, 1, rec.Attempts)
	})
}
