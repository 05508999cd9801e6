package outbox_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// The free functions kept until the callers move to Store are the Store's
// methods: the same rows, counts and actions, FindRows paging by id.
func TestDeprecatedFunctionsAreTheStore(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		db := b.schema()
		ids := b.seed(t,
			seedRow{Topic: "t", UUID: "q1", State: outbox.StateQuarantined, LastError: "refused"},
			seedRow{Topic: "t", UUID: "q2", State: outbox.StateQuarantined, LastError: "refused"},
			seedRow{Topic: "t", UUID: "q3", State: outbox.StateQuarantined, LastError: "refused"})
		first, err := outbox.FindRows(b.ctx, db, outbox.RowFilter{}, outbox.Paging{Limit: 2})
		require.NoError(t, err)
		require.Equal(t, ids[:2], rowIDs(first.Rows))
		require.Equal(t, ids[1], first.Next)
		second, err := outbox.FindRows(b.ctx, db, outbox.RowFilter{}, outbox.Paging{After: first.Next, Limit: 2})
		require.NoError(t, err)
		require.Equal(t, ids[2:], rowIDs(second.Rows))
		require.Zero(t, second.Next)

		n, err := outbox.CountRows(b.ctx, db, outbox.RowFilter{})
		require.NoError(t, err)
		require.Equal(t, int64(3), n)
		c, err := outbox.CountRowsAsOf(b.ctx, db, outbox.RowFilter{})
		require.NoError(t, err)
		require.Equal(t, ids[2], c.MaxID)
		row, err := outbox.GetRow(b.ctx, db, ids[0])
		require.NoError(t, err)
		require.Equal(t, "q1", row.UUID)
		row, err = outbox.GetRowPrefix(b.ctx, db, ids[0], 0)
		require.NoError(t, err)
		require.Empty(t, row.Payload)

		require.NoError(t, outbox.Requeue(b.ctx, db, ids[0], outbox.Expect{Version: row.Version}))
		require.NoError(t, outbox.Discard(b.ctx, db, ids[1], outbox.Expect{}))
		p, err := outbox.PendingStats(b.ctx, db)
		require.NoError(t, err)
		require.Equal(t, int64(2), p.Count)
		require.Equal(t, int64(1), p.Quarantined)
		n, err = outbox.RequeueMatching(b.ctx, db, outbox.RowFilter{UUID: "q3"})
		require.NoError(t, err)
		require.Equal(t, int64(1), n)
		n, err = outbox.DiscardMatching(b.ctx, db, outbox.RowFilter{UUID: "q3"})
		require.NoError(t, err)
		require.Zero(t, n, "requeued: no longer quarantined")
		n, err = outbox.RequeueFailed(b.ctx, db)
		require.NoError(t, err)
		require.Zero(t, n)
	})
}
