package inboxdb_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
)

// keyFormat is the record's idempotency_key_format ("" for NULL).
func keyFormat(t *testing.T, b bundle, consumer, key string) string {
	t.Helper()
	got := b.strings(t, "SELECT coalesce(idempotency_key_format::text, '') FROM "+b.store.Table()+" WHERE consumer = $1 AND message_key = $2", consumer, key)
	require.Len(t, got, 1)
	return got[0]
}

// unmark makes a record look created by a version before the key format.
func unmark(t *testing.T, b bundle, consumer, key string) {
	t.Helper()
	require.Equal(t, int64(1), b.exec(t, "UPDATE "+b.store.Table()+" SET idempotency_key_format = NULL WHERE consumer = $1 AND message_key = $2", consumer, key))
}

// The records that outlive an attempt carry the idempotency key format
// they were created with, and the claims that run them again report it: a
// lease claim (new record, failed, expired) and a transactional claim of a
// released parked record (ClaimTx, ClaimBatchTx). The transactional claim
// of a new key writes none.
func TestKeyFormat(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		want := string(rune('0' + inboxdb.KeyFormat))

		// Lease mode.
		lc := leaseAcquire(t, b, "l", "k", time.Minute, retryExpired)
		require.False(t, lc.FormerKeyFormat)
		require.Equal(t, want, keyFormat(t, b, "l", "k"))
		require.NoError(t, b.store.Fail(b.ctx, b.db, "l", "k", lc.Token, "503", false, nil))
		lc = leaseAcquire(t, b, "l", "k", time.Minute, retryExpired)
		require.False(t, lc.FormerKeyFormat, "failed, claimed again")
		unmark(t, b, "l", "k")
		leaseExpire(t, b, "l", "k")
		lc = leaseAcquire(t, b, "l", "k", time.Minute, retryExpired)
		require.True(t, lc.Interrupted)
		require.True(t, lc.FormerKeyFormat, "created by an earlier version, interrupted")
		require.NoError(t, b.store.Fail(b.ctx, b.db, "l", "k", lc.Token, "503", false, nil))
		lc = leaseAcquire(t, b, "l", "k", time.Minute, retryExpired)
		require.True(t, lc.FormerKeyFormat, "created by an earlier version, failed")
		require.Equal(t, "", keyFormat(t, b, "l", "k"), "a claim never changes a record's format")

		// Transactional mode: a new key is claimed without a format.
		require.True(t, b.claim(t, "t", "plain").Claimed)
		require.Equal(t, "", keyFormat(t, b, "t", "plain"))

		// Parked by this version or an earlier one, released, claimed.
		for _, key := range []string{"new", "old", "new-batch", "old-batch"} {
			require.NoError(t, b.store.Park(b.ctx, b.db, "t", key, "invalid phone number", nil))
			require.Equal(t, want, keyFormat(t, b, "t", key))
			former := key == "old" || key == "old-batch"
			if former {
				unmark(t, b, "t", key)
			}
			ok, err := b.store.Release(b.ctx, b.db, "t", key)
			require.NoError(t, err)
			require.True(t, ok)
			var res inboxdb.ClaimResult
			tx := b.begin(t)
			if key == "new" || key == "old" {
				res, err = b.store.ClaimTx(b.ctx, tx, "t", key)
				require.NoError(t, err)
			} else {
				results, errs, err := b.store.ClaimBatchTx(b.ctx, tx, "t", []string{key, key + "-other"})
				require.NoError(t, err)
				require.NoError(t, errs[0])
				res = results[0]
				require.True(t, results[1].Claimed)
				require.False(t, results[1].FormerKeyFormat, "inserted")
			}
			require.NoError(t, tx.Commit())
			require.True(t, res.Claimed, key)
			require.Equal(t, former, res.FormerKeyFormat, key)
		}
	})
}
