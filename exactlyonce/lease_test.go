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

func TestLeaseMode(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		ctx := context.Background()
		d, tables := b.Driver, b.DB
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		// maxInterrupted 0 keeps the default (retry an expired lease up
		// to 3 times); 1 parks a key at its first interruption.
		newMW := func(maxInterrupted int, counters *testenv.Counters) *exactlyonce.Guard {
			eo, err := exactlyonce.New(exactlyonce.Config{
				DB: tables, Consumer: "sms", PublishTopic: "sent",
				Lease:     &exactlyonce.LeaseConfig{Duration: 5 * time.Second, MaxInterruptedAttempts: maxInterrupted},
				NackDelay: -1, OnEvent: counters.Observe, Logger: testenv.Logger(t),
			})
			require.NoError(t, err)
			return eo
		}
		var counters testenv.Counters
		eo := newMW(0, &counters)

		var infos []exactlyonce.Info
		var result error
		h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			info, err := exactlyonce.InfoFromContext(msg.Context())
			require.NoError(t, err)
			require.NoError(t, handlerTx(msg.Context()), "the completion transaction is in the context")
			infos = append(infos, info)
			if result != nil {
				return nil, result
			}
			return []*message.Message{message.NewMessage("sent-"+msg.UUID, nil)}, nil
		})
		expire := func(key string) {
			_, err := d.DB.ExecContext(ctx, "UPDATE "+tables.Inbox()+b.SQL(" SET lease_until = now() - interval '1 second' WHERE message_key = $1",
				" SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE message_key = ?"), key)
			require.NoError(t, err)
		}

		// Success, then a duplicate.
		_, err = h(message.NewMessage("k1", nil))
		require.NoError(t, err)
		_, err = h(message.NewMessage("k1", nil))
		require.NoError(t, err)
		require.Len(t, infos, 1)
		require.Equal(t, exactlyonce.Info{Consumer: "sms", Key: "k1", IdempotencyKey: "sms:k1", Attempt: 1,
			LeaseUntil: infos[0].LeaseUntil}, infos[0])
		require.False(t, infos[0].LeaseUntil.IsZero())
		require.Equal(t, int64(1), counters.Processed.Load())
		require.Equal(t, int64(1), counters.Duplicates.Load())
		require.Equal(t, int64(1), b.Count(t, "SELECT count(*) FROM "+tables.Outbox()), "output written once, with the completion")

		// A retryable error: recorded failed, the next delivery runs attempt 2.
		infos = nil
		result = errors.New("provider said 500")
		_, err = h(message.NewMessage("k2", nil))
		require.ErrorContains(t, err, "provider said 500")
		rec, err := store.Lookup(ctx, d.DB, "sms", "k2")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusFailed, rec.Status)
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
		result = exactlyonce.Permanent(errors.New("invalid phone number"))
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
		other, err := store.ClaimLease(ctx, d.DB, "sms", "k4", inboxdb.LeaseOptions{Lease: time.Minute})
		require.NoError(t, err)
		require.Equal(t, inboxdb.LeaseAcquired, other.Outcome)
		_, err = h(message.NewMessage("k4", nil))
		require.ErrorIs(t, err, exactlyonce.ErrLeaseHeld)
		require.Empty(t, infos)
		require.Equal(t, int64(1), counters.Busy.Load())

		// The holder died: after expiry, the retry runs attempt 2, interrupted.
		expire("k4")
		_, err = h(message.NewMessage("k4", nil))
		require.NoError(t, err)
		require.Len(t, infos, 1)
		require.Equal(t, 2, infos[0].Attempt)
		require.True(t, infos[0].Interrupted)
		require.Equal(t, "sms:k4", infos[0].IdempotencyKey)
		// The dead holder's completion is refused.
		require.ErrorIs(t, store.CompleteTx(ctx, d.DB, "sms", "k4", other.Token), inboxdb.ErrLeaseLost)

		// MaxInterruptedAttempts 1 (the old ParkExpired): an expired
		// lease parks the key and acks.
		var parkCounters testenv.Counters
		parker := newMW(1, &parkCounters).Middleware(func(*message.Message) ([]*message.Message, error) {
			t.Error("handler must not run for a parked key")
			return nil, nil
		})
		_, err = store.ClaimLease(ctx, d.DB, "sms", "k5", inboxdb.LeaseOptions{Lease: time.Minute, MaxInterrupted: 1})
		require.NoError(t, err)
		expire("k5")
		_, err = parker(message.NewMessage("k5", nil))
		require.NoError(t, err)
		require.Equal(t, int64(1), parkCounters.Parked.Load())
		rec, err = store.Lookup(ctx, d.DB, "sms", "k5")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusParked, rec.Status)
		require.Contains(t, rec.LastError, "lease expired during attempt 1")
	})
}

func TestExtendLease(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		d, tables := b.Driver, b.DB
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, Consumer: "c",
			Lease: &exactlyonce.LeaseConfig{Duration: 2 * time.Second}, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		_, err = eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			before, err := exactlyonce.InfoFromContext(ctx)
			require.NoError(t, err)
			require.NoError(t, exactlyonce.ExtendLease(ctx, time.Hour))
			rec, err := store.Lookup(ctx, d.DB, "c", "k")
			require.NoError(t, err)
			require.True(t, rec.LeaseUntil.After(before.LeaseUntil.Add(50*time.Minute)), "lease extended to about an hour")

			// Someone takes the key over: extension and completion are refused.
			_, err = d.DB.ExecContext(ctx, "UPDATE "+tables.Inbox()+b.SQL(" SET lease_until = now() - interval '1 second'",
				" SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND"))
			require.NoError(t, err)
			taken, err := store.ClaimLease(ctx, d.DB, "c", "k", inboxdb.LeaseOptions{Lease: time.Minute})
			require.NoError(t, err)
			require.Equal(t, inboxdb.LeaseAcquired, taken.Outcome)
			require.ErrorIs(t, exactlyonce.ExtendLease(ctx, 0), exactlyonce.ErrLeaseLost)
			return nil, nil
		})(message.NewMessage("k", nil))
		require.ErrorIs(t, err, exactlyonce.ErrLeaseLost, "the completion of a taken-over attempt is refused")
		require.Error(t, exactlyonce.ExtendLease(context.Background(), time.Second), "outside a lease-mode handler")
	})
}
