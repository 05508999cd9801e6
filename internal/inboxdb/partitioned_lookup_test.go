package inboxdb_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"
)

// heldLookups is a transaction whose look-ups of the catalog (the store's
// reads of the partitions and of its claim functions) wait until release
// is closed: a transaction whose connection is slow to answer, or, behind
// PgBouncer, a statement waiting for a server connection.
type heldLookups struct {
	wsql.ContextExecutor
	entered chan struct{}
	once    sync.Once
	release chan struct{}
}

func (h *heldLookups) QueryContext(ctx context.Context, query string, args ...any) (wsql.Rows, error) {
	if strings.Contains(query, "pg_inherits") || strings.Contains(query, "to_regprocedure") {
		h.once.Do(func() { close(h.entered) })
		select {
		case <-h.release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return h.ContextExecutor.QueryContext(ctx, query, args...)
}

// A claim whose transaction is slow to answer the store's look-up of the
// partitions (or of its claim functions) holds up no other claim of that
// store: the store does not hold its lock across a round trip. Behind
// PgBouncer it did, and a look-up waiting for a server connection, while
// the transactions holding every server connection waited for the store's
// lock, was a deadlock. Each of the claim paths is the one that looks up
// first (a new store looks up at its first claim).
func TestPartitionedLookupHoldsUpNoOtherClaim(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		for _, funcs := range []bool{true, false} {
			store := b.storeFor(t, claimPath{funcs: funcs})
			slowTx, err := b.db.BeginTx(b.ctx, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = slowTx.Rollback() })
			slow := &heldLookups{ContextExecutor: slowTx, entered: make(chan struct{}), release: make(chan struct{})}
			released := sync.OnceFunc(func() { close(slow.release) })
			t.Cleanup(released)
			slowDone := make(chan error, 1)
			go func() {
				_, err := store.ClaimTx(b.ctx, slow, "c", "slow")
				slowDone <- err
			}()
			<-slow.entered

			otherDone := make(chan error, 1)
			go func() {
				tx, err := b.db.BeginTx(b.ctx, nil)
				if err != nil {
					otherDone <- err
					return
				}
				res, err := store.ClaimTx(b.ctx, tx, "c", "other")
				if err == nil && !res.Claimed {
					err = context.Canceled
				}
				if err != nil {
					_ = tx.Rollback()
					otherDone <- err
					return
				}
				otherDone <- tx.Commit()
			}()
			// A liveness check, not a timing figure: the other claim either
			// ends or waits for the held look-up forever.
			select {
			case err := <-otherDone:
				require.NoError(t, err, "funcs %v", funcs)
			case <-time.After(30 * time.Second):
				released()
				t.Fatalf("funcs %v: a claim waited for another transaction's look-up of the partitions", funcs)
			}
			released()
			require.NoError(t, <-slowDone)
			require.NoError(t, slowTx.Commit())
			require.Equal(t, int64(1), b.count(t, "message_key = $1", "slow"))
			require.Equal(t, int64(1), b.count(t, "message_key = $1", "other"))
			b.exec(t, "DELETE FROM "+store.Table())
		}
	})
}
