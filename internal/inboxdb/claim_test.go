package inboxdb_test

import (
	"database/sql"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
)

func TestClaimTx(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		// A claim is visible inside its transaction only.
		tx := b.begin(t)
		res, err := b.store.ClaimTx(b.ctx, tx, "c1", "m-1")
		require.NoError(t, err)
		require.True(t, res.Claimed)
		require.Zero(t, res.Existing)
		rec, err := b.store.Lookup(b.ctx, tx, "c1", "m-1")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		_, err = b.store.Lookup(b.ctx, b.db, "c1", "m-1")
		require.ErrorIs(t, err, inboxdb.ErrNotFound, "an uncommitted claim is invisible to others")

		// Rolled back: no row, so the redelivery claims again.
		require.NoError(t, tx.Rollback())
		_, err = b.store.Lookup(b.ctx, b.db, "c1", "m-1")
		require.ErrorIs(t, err, inboxdb.ErrNotFound)
		require.Zero(t, b.count(t, ""))

		res = b.claim(t, "c1", "m-1")
		require.True(t, res.Claimed, "after a rollback the key is free again")
		rec, err = b.store.Lookup(b.ctx, b.db, "c1", "m-1")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 1, rec.Attempts)
		require.Zero(t, rec.Duplicates)
		require.NotNil(t, rec.ProcessedAt)
		first := rec.FirstSeenAt

		// Committed: every later claim is a duplicate carrying the record.
		for i := int64(1); i <= 3; i++ {
			res = b.claim(t, "c1", "m-1")
			require.False(t, res.Claimed)
			require.Equal(t, inboxdb.StatusDone, res.Existing.Status)
			require.Equal(t, "c1", res.Existing.Consumer)
			require.Equal(t, "m-1", res.Existing.Key)
			require.Equal(t, i, res.Existing.Duplicates, "the duplicate counter includes this delivery")
			require.True(t, first.Equal(res.Existing.FirstSeenAt), "first_seen_at is kept")
		}

		// A duplicate seen by a transaction that rolls back is not counted.
		tx = b.begin(t)
		res, err = b.store.ClaimTx(b.ctx, tx, "c1", "m-1")
		require.NoError(t, err)
		require.False(t, res.Claimed)
		require.NoError(t, tx.Rollback())
		rec, err = b.store.Lookup(b.ctx, b.db, "c1", "m-1")
		require.NoError(t, err)
		require.Equal(t, int64(3), rec.Duplicates)

		// Keys are per consumer; the same consumer with another key is new.
		require.True(t, b.claim(t, "c2", "m-1").Claimed)
		require.True(t, b.claim(t, "c1", "m-2").Claimed)
		require.Equal(t, int64(3), b.count(t, ""))
	})
}

// TestClaimTxConcurrent races two claims of one key on two connections:
// the second waits for the first's transaction, and then sees a duplicate
// when it committed, or claims the key when it rolled back. On MySQL under
// both REPEATABLE READ (its default: the locking read sees the committed
// row, no serialization failure) and READ COMMITTED; on PostgreSQL under
// its default, READ COMMITTED (REPEATABLE READ fails the loser with 40001:
// TestClaimTxRepeatableRead).
func TestClaimTxConcurrent(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		type outcome struct {
			res inboxdb.ClaimResult
			err error
		}
		levels := []sql.IsolationLevel{sql.LevelDefault}
		if b.mysql() {
			levels = []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelReadCommitted}
		}
		for _, level := range levels {
			begin := func(t *testing.T) wsql.Tx {
				var opts *sql.TxOptions // PostgreSQL: the default (wsql's pgx adapter maps a LevelDefault option to SERIALIZABLE)
				if level != sql.LevelDefault {
					opts = &sql.TxOptions{Isolation: level}
				}
				tx, err := b.db.BeginTx(b.ctx, opts)
				require.NoError(t, err)
				t.Cleanup(func() { _ = tx.Rollback() })
				return tx
			}
			// race holds an uncommitted claim in tx1, starts a second claim
			// of the same key in tx2, waits until the database shows tx2
			// blocked by tx1, ends tx1 with end, and returns what the
			// second claim saw.
			race := func(t *testing.T, key string, end func(tx1 wsql.Tx) error) inboxdb.ClaimResult {
				tx1 := begin(t)
				res, err := b.store.ClaimTx(b.ctx, tx1, "c", key)
				require.NoError(t, err)
				require.True(t, res.Claimed)
				tx2 := begin(t)
				id2 := b.backendPID(t, tx2)
				// Under REPEATABLE READ the snapshot is taken at tx2's
				// first read: before tx1 commits.
				_, err = b.store.Lookup(b.ctx, tx2, "c", "other")
				require.ErrorIs(t, err, inboxdb.ErrNotFound)
				done := make(chan outcome, 1)
				go func() {
					res, err := b.store.ClaimTx(b.ctx, tx2, "c", key)
					done <- outcome{res, err}
				}()
				b.awaitWaiting(t, id2, "the second claim should wait for the first transaction")
				select {
				case o := <-done:
					t.Fatalf("the second claim returned while the first was open: %+v, %v", o.res, o.err)
				default:
				}

				require.NoError(t, end(tx1))
				var o outcome
				select {
				case o = <-done:
				case <-time.After(10 * time.Second):
					t.Fatal("the second claim did not return within 10s after the first transaction ended")
				}
				require.NoError(t, o.err)
				require.NoError(t, tx2.Commit())
				return o.res
			}

			t.Run(level.String()+"/first commits", func(t *testing.T) {
				key := "k-commit-" + level.String()
				res := race(t, key, func(tx1 wsql.Tx) error { return tx1.Commit() })
				require.False(t, res.Claimed, "the loser sees the winner's row: a duplicate")
				require.Equal(t, inboxdb.StatusDone, res.Existing.Status)
				require.Equal(t, int64(1), res.Existing.Duplicates)
				rec, err := b.store.Lookup(b.ctx, b.db, "c", key)
				require.NoError(t, err)
				require.Equal(t, int64(1), rec.Duplicates)
			})
			t.Run(level.String()+"/first rolls back", func(t *testing.T) {
				key := "k-rollback-" + level.String()
				res := race(t, key, func(tx1 wsql.Tx) error { return tx1.Rollback() })
				require.True(t, res.Claimed, "the key is free again once the first transaction rolled back")
				rec, err := b.store.Lookup(b.ctx, b.db, "c", key)
				require.NoError(t, err)
				require.Equal(t, inboxdb.StatusDone, rec.Status)
				require.Zero(t, rec.Duplicates)
			})
		}
	})
}

// A record in the middle of a lease-mode attempt (processing) is neither a
// duplicate nor claimable: transactional and lease mode share a consumer
// name. (Parked and failed records have claim semantics of their own: see
// TestClaimTxParked and TestClaimTxReclaimsFailed.)
func TestClaimTxNotDone(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		for _, status := range []string{inboxdb.StatusProcessing} {
			key := "lease-" + status
			b.exec(t, "INSERT INTO "+b.store.Table()+b.sql(" (consumer, message_key, status, attempts, last_error) VALUES ($1, $2, $3, 2, 'boom')",
				" (consumer, message_key, status, attempts, last_error, first_seen_at) VALUES (?, ?, ?, 2, 'boom', UTC_TIMESTAMP(6))"),
				"c", key, status)

			tx := b.begin(t)
			res, err := b.store.ClaimTx(b.ctx, tx, "c", key)
			require.ErrorIs(t, err, inboxdb.ErrNotDone, "status %s", status)
			require.Contains(t, err.Error(), status)
			require.False(t, res.Claimed)
			require.Equal(t, status, res.Existing.Status)
			require.Equal(t, 2, res.Existing.Attempts)
			require.Equal(t, "boom", res.Existing.LastError)
			require.NoError(t, tx.Rollback())

			rec, err := b.store.Lookup(b.ctx, b.db, "c", key)
			require.NoError(t, err)
			require.Equal(t, status, rec.Status, "the record is left as it was")
		}
	})
}
