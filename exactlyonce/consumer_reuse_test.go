package exactlyonce_test

import (
	"errors"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestLeaseFailedNotTakenOverByTransactional: a lease-mode handler and a
// transactional one sharing a consumer name (a misconfiguration). The lease
// handler's ordinary failure (status failed, to be retried at its next
// delivery) must not be taken over by the transactional claim, which only
// takes over a failed record that a transactional consumer parked and an
// operator released. Before the fix (found in review) it was, and the lease
// handler's redelivery was acked as a duplicate: its effect never ran.
func TestLeaseFailedNotTakenOverByTransactional(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		var lev, tev testenv.Counters
		lease, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Consumer: "c", Lease: &exactlyonce.LeaseConfig{}, NackDelay: -1, OnEvent: lev.Observe, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		tx, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Consumer: "c", NackDelay: -1, OnEvent: tev.Observe, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		var smsSent, txRuns atomic.Int64
		fail := true
		lh := lease.Middleware(func(*message.Message) ([]*message.Message, error) {
			if fail {
				fail = false
				return nil, errors.New("provider 500")
			}
			smsSent.Add(1)
			return nil, nil
		})
		th := tx.Middleware(func(*message.Message) ([]*message.Message, error) { txRuns.Add(1); return nil, nil })
		_, err = lh(message.NewMessage("k", nil))
		require.Error(t, err, "first lease attempt fails: recorded failed, nacked")
		_, err = th(message.NewMessage("k", nil))
		require.ErrorIs(t, err, inboxdb.ErrNotDone, "the transactional claim refuses a lease-mode record")
		require.ErrorIs(t, err, exactlyonce.ErrClaimFailed)
		require.Zero(t, txRuns.Load())
		_, err = lh(message.NewMessage("k", nil))
		require.NoError(t, err)
		require.Equal(t, int64(1), smsSent.Load(), "the lease handler's effect must happen once")
		require.Zero(t, lev.Duplicates.Load())
	})
}
