package middleware_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

func TestLeaseMode(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			tables := testenv.Schema(t)
			store, err := inbox.NewStore(inbox.Config{Tables: tables})
			require.NoError(t, err)
			newMW := func(policy middleware.ExpiredPolicy, counters *middleware.Counters) *middleware.Middleware {
				eo, err := middleware.New(middleware.Config{
					DB: d.DB, Tables: tables, Mode: middleware.Lease, Consumer: "sms", PublishTopic: "sent",
					Lease: 5 * time.Second, OnExpired: policy, NackDelay: -1, OnEvent: counters.Observe,
				})
				require.NoError(t, err)
				return eo
			}
			var counters middleware.Counters
			eo := newMW(middleware.RetryExpired, &counters)

			var infos []middleware.LeaseInfo
			var result error
			h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				info, ok := middleware.LeaseFromContext(msg.Context())
				require.True(t, ok)
				_, hasTx := middleware.TxFromContext(msg.Context())
				require.True(t, hasTx, "the completion transaction is in the context")
				infos = append(infos, info)
				if result != nil {
					return nil, result
				}
				return []*message.Message{message.NewMessage("sent-"+msg.UUID, nil)}, nil
			})
			expire := func(key string) {
				_, err := d.DB.ExecContext(ctx, "UPDATE "+tables.Inbox()+" SET lease_until = now() - interval '1 second' WHERE message_key = $1", key)
				require.NoError(t, err)
			}

			// Success, then a duplicate.
			_, err = h(message.NewMessage("k1", nil))
			require.NoError(t, err)
			_, err = h(message.NewMessage("k1", nil))
			require.NoError(t, err)
			require.Len(t, infos, 1)
			require.Equal(t, middleware.LeaseInfo{IdempotencyKey: "sms:k1", Attempt: 1, LeaseUntil: infos[0].LeaseUntil}, infos[0])
			require.Equal(t, int64(1), counters.Processed.Load())
			require.Equal(t, int64(1), counters.Duplicates.Load())
			p, err := outbox.PendingStats(ctx, d.DB, tables)
			require.NoError(t, err)
			require.Equal(t, int64(1), p.Count, "output written once, with the completion")

			// A retryable error: recorded failed, the next delivery runs attempt 2.
			infos = nil
			result = errors.New("provider said 500")
			_, err = h(message.NewMessage("k2", nil))
			require.ErrorContains(t, err, "provider said 500")
			rec, err := store.Lookup(ctx, d.DB, "sms", "k2")
			require.NoError(t, err)
			require.Equal(t, inbox.StatusFailed, rec.Status)
			require.Equal(t, "provider said 500", rec.LastError)
			result = nil
			_, err = h(message.NewMessage("k2", nil))
			require.NoError(t, err)
			require.Len(t, infos, 2)
			require.Equal(t, 2, infos[1].Attempt)
			require.Equal(t, infos[0].IdempotencyKey, infos[1].IdempotencyKey, "same idempotency key on retry")
			require.False(t, infos[1].Interrupted)

			// A permanent error: parked and acked; not run again until released.
			infos = nil
			result = middleware.Permanent(errors.New("invalid phone number"))
			_, err = h(message.NewMessage("k3", nil))
			require.NoError(t, err, "a permanent failure is acked")
			result = nil
			_, err = h(message.NewMessage("k3", nil))
			require.NoError(t, err)
			require.Len(t, infos, 1, "a parked key does not run")
			parked, err := store.ListParked(ctx, d.DB, "sms", 10)
			require.NoError(t, err)
			require.Len(t, parked, 1)
			require.Equal(t, "k3", parked[0].Key)
			require.Contains(t, parked[0].LastError, "invalid phone number")
			released, err := store.Release(ctx, d.DB, "sms", "k3")
			require.NoError(t, err)
			require.True(t, released)
			_, err = h(message.NewMessage("k3", nil))
			require.NoError(t, err)
			require.Len(t, infos, 2)
			require.Equal(t, 2, infos[1].Attempt)

			// Another worker holds a live lease: nack, never ack, handler not run.
			infos = nil
			other, err := store.ClaimLease(ctx, d.DB, "sms", "k4", inbox.LeaseOptions{Lease: time.Minute})
			require.NoError(t, err)
			require.Equal(t, inbox.LeaseAcquired, other.Outcome)
			_, err = h(message.NewMessage("k4", nil))
			require.ErrorIs(t, err, middleware.ErrLeaseHeld)
			require.Empty(t, infos)
			require.Equal(t, int64(1), counters.Busy.Load())

			// The holder died: after expiry, Retry runs attempt 2, interrupted.
			expire("k4")
			_, err = h(message.NewMessage("k4", nil))
			require.NoError(t, err)
			require.Len(t, infos, 1)
			require.Equal(t, 2, infos[0].Attempt)
			require.True(t, infos[0].Interrupted)
			require.Equal(t, "sms:k4", infos[0].IdempotencyKey)
			// The dead holder's completion is refused.
			require.ErrorIs(t, store.CompleteTx(ctx, d.DB, "sms", "k4", other.Token), inbox.ErrLeaseLost)

			// Park policy: an expired lease parks the key and acks.
			var parkCounters middleware.Counters
			parker := newMW(middleware.ParkExpired, &parkCounters).Middleware(func(*message.Message) ([]*message.Message, error) {
				t.Error("handler must not run for a parked key")
				return nil, nil
			})
			_, err = store.ClaimLease(ctx, d.DB, "sms", "k5", inbox.LeaseOptions{Lease: time.Minute, OnExpired: inbox.ParkExpired})
			require.NoError(t, err)
			expire("k5")
			_, err = parker(message.NewMessage("k5", nil))
			require.NoError(t, err)
			require.Equal(t, int64(1), parkCounters.Parked.Load())
			rec, err = store.Lookup(ctx, d.DB, "sms", "k5")
			require.NoError(t, err)
			require.Equal(t, inbox.StatusParked, rec.Status)
			require.Contains(t, rec.LastError, "lease expired during attempt 1")
		})
	}
}

func TestExtendLease(t *testing.T) {
	t.Parallel()
	d := testenv.Drivers(t)[0]
	tables := testenv.Schema(t)
	store, err := inbox.NewStore(inbox.Config{Tables: tables})
	require.NoError(t, err)
	eo, err := middleware.New(middleware.Config{DB: d.DB, Tables: tables, Mode: middleware.Lease, Consumer: "c", Lease: 2 * time.Second})
	require.NoError(t, err)
	_, err = eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		before, _ := middleware.LeaseFromContext(ctx)
		require.NoError(t, middleware.ExtendLease(ctx, time.Hour))
		rec, err := store.Lookup(ctx, d.DB, "c", "k")
		require.NoError(t, err)
		require.True(t, rec.LeaseUntil.After(before.LeaseUntil.Add(50*time.Minute)), "lease extended to about an hour")

		// Someone takes the key over: extension and completion are refused.
		_, err = d.DB.ExecContext(ctx, "UPDATE "+tables.Inbox()+" SET lease_until = now() - interval '1 second'")
		require.NoError(t, err)
		taken, err := store.ClaimLease(ctx, d.DB, "c", "k", inbox.LeaseOptions{Lease: time.Minute})
		require.NoError(t, err)
		require.Equal(t, inbox.LeaseAcquired, taken.Outcome)
		require.ErrorIs(t, middleware.ExtendLease(ctx, 0), middleware.ErrLeaseLost)
		return nil, nil
	})(message.NewMessage("k", nil))
	require.ErrorIs(t, err, middleware.ErrLeaseLost, "the completion of a taken-over attempt is refused")
	require.Error(t, middleware.ExtendLease(context.Background(), time.Second), "outside a lease-mode handler")
}
