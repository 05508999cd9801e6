package exactlyonce_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestRetentionAgesFromFinish: a lease-mode key first seen days ago, parked
// for an operator, released and completed just now, must survive a purge of
// records older than a day: retention ages a record from when it last
// finished, not from when it was first seen. Otherwise the purge deletes the
// fresh done record and the next redelivery runs the handler (the SMS) again.
func TestRetentionAgesFromFinish(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			e := newLeaseEnv(t, d)
			fail := true
			h := e.middleware(t, exactlyonce.Config{}).Middleware(func(*message.Message) ([]*message.Message, error) {
				e.calls.Add(1)
				if fail {
					return nil, exactlyonce.Permanent(errors.New("provider rejected the number"))
				}
				return nil, nil
			})
			_, err := h(message.NewMessage("k", nil))
			require.NoError(t, err)
			require.Equal(t, inboxdb.StatusParked, e.record(t, "k").Status)

			// Parked for three days.
			_, err = d.DB.ExecContext(ctx, "UPDATE "+e.tables.Inbox()+
				" SET first_seen_at = first_seen_at - interval '3 days', processed_at = processed_at - interval '3 days'")
			require.NoError(t, err)
			released, err := e.store.Release(ctx, d.DB, "sms", "k")
			require.NoError(t, err)
			require.True(t, released)
			fail = false
			_, err = h(message.NewMessage("k", nil))
			require.NoError(t, err)
			require.Equal(t, inboxdb.StatusDone, e.record(t, "k").Status)

			n, err := e.store.Purge(ctx, d.DB, inboxdb.PurgeOptions{OlderThan: 24 * time.Hour})
			require.NoError(t, err)
			require.Zero(t, n, "the record finished moments ago")
			_, err = h(message.NewMessage("k", nil))
			require.NoError(t, err)
			require.Equal(t, int64(2), e.calls.Load(), "the redelivery is a duplicate")

			// A record that finished long ago is purged.
			_, err = d.DB.ExecContext(ctx, "UPDATE "+e.tables.Inbox()+" SET processed_at = now() - interval '2 days'")
			require.NoError(t, err)
			n, err = e.store.Purge(ctx, d.DB, inboxdb.PurgeOptions{OlderThan: 24 * time.Hour})
			require.NoError(t, err)
			require.Equal(t, int64(1), n)
		})
	}
}
