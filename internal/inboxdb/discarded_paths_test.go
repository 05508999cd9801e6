package inboxdb_test

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// A discarded key (an operator discarded its parked message and kept the
// key) is settled on every claim path, on both layouts (the partitioned
// one's claim functions included): no path runs it, each counts the copy
// as a duplicate, and none changes its status; a Park leaves it alone.
func TestDiscardedKeyOnEveryClaimPath(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		before := b.insertRecord(t, "c", "k", inboxdb.StatusDiscarded, 1, "declined")

		tx := b.begin(t)
		res, err := b.store.ClaimTx(b.ctx, tx, "c", "k")
		require.NoError(t, err, "ClaimTx")
		require.False(t, res.Claimed)
		require.Equal(t, inboxdb.StatusDiscarded, res.Existing.Status)
		require.NoError(t, tx.Commit())

		tx = b.begin(t)
		results, errs, err := b.store.ClaimBatchCopiesTx(b.ctx, tx, "c", []string{"k"}, []int{2})
		require.NoError(t, err, "ClaimBatchCopiesTx")
		require.NoError(t, errors.Join(errs...))
		require.False(t, results[0].Claimed)
		require.NoError(t, tx.Commit())

		conn, err := testenv.Pool(t).Acquire(b.ctx)
		require.NoError(t, err)
		ptx, res, err := b.store.BeginClaimPgx(b.ctx, conn.Conn(), "c", "k")
		require.NoError(t, err, "BeginClaimPgx")
		require.False(t, res.Claimed)
		require.Nil(t, ptx)
		conn.Release()

		lc, err := b.store.ClaimLease(b.ctx, b.db, "c", "k", inboxdb.LeaseOptions{Lease: time.Hour})
		require.NoError(t, err, "ClaimLease")
		require.Equal(t, inboxdb.LeaseDuplicate, lc.Outcome)

		require.NoError(t, b.store.Park(b.ctx, b.db, "c", "k", "permanent again", nil), "Park")

		rec, err := b.store.Lookup(b.ctx, b.db, "c", "k")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDiscarded, rec.Status)
		require.Equal(t, before.Attempts, rec.Attempts)
		require.Equal(t, int64(5), rec.Duplicates, "1 + 2 copies + 1 + 1 counted")
		require.True(t, before.ProcessedAt.Equal(*rec.ProcessedAt))
	})
}
