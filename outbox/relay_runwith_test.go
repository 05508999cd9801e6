package outbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// returned waits for RunWith's result.
func returned(t *testing.T, done <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		t.Fatalf("RunWith did not return after %s", what)
		return nil
	}
}

// TestRelayRunWith: the relay and a Watermill router run together (a row
// the relay publishes reaches the router's handler); the router stopping
// by itself, with no error, stops the relay and RunWith returns nil; an
// error of one function stops the others and is returned; ctx done stops
// them all; a nil function is refused before anything runs.
func TestRelayRunWith(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10}, watermill.NopLogger{})
	defer func() { _ = broker.Close() }()
	newRelay := func(t *testing.T) *outbox.Relay {
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: broker, Logger: testenv.Logger(t), PollInterval: 50 * time.Millisecond})
		require.NoError(t, err)
		return relay
	}
	// stopped: the relay's Run returned (a Run still under way refuses a second).
	stopped := func(t *testing.T, relay *outbox.Relay) {
		t.Helper()
		over, stop := context.WithCancel(ctx)
		stop()
		require.NoError(t, relay.Run(over), "the relay's Run returned")
	}

	t.Run("the router stops by itself", func(t *testing.T) {
		relay := newRelay(t)
		router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		require.NoError(t, err)
		got := make(chan string, 1)
		router.AddConsumerHandler("consume", "runwith.in", broker, func(msg *message.Message) error {
			got <- msg.UUID
			return nil
		})
		done := make(chan error, 1)
		go func() { done <- relay.RunWith(ctx, router.Run) }()
		<-router.Running()
		<-relay.Running()

		w, err := outbox.NewWriter(db)
		require.NoError(t, err)
		tx, err := db.Conn.BeginTx(ctx, nil)
		require.NoError(t, err)
		pub, err := w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("runwith.in", message.NewMessage("rw-1", []byte("{}"))))
		require.NoError(t, tx.Commit())
		select {
		case uuid := <-got:
			require.Equal(t, "rw-1", uuid, "relayed, then consumed by the router's handler")
		case <-time.After(30 * time.Second):
			t.Fatal("the row was not relayed to the router's handler")
		}

		require.NoError(t, router.Close()) // the router's Run returns nil
		require.NoError(t, returned(t, done, "the router closed"), "no function returned an error")
		stopped(t, relay)
		p, err := testenv.OutboxStore(t, db).Pending(ctx)
		require.NoError(t, err)
		require.Zero(t, p.Count, "the relay deleted the row it published")
	})

	t.Run("an error stops the others", func(t *testing.T) {
		relay := newRelay(t)
		boom := errors.New("server failed (test)")
		otherStopped := make(chan error, 1)
		done := make(chan error, 1)
		go func() {
			done <- relay.RunWith(ctx,
				func(ctx context.Context) error { <-ctx.Done(); otherStopped <- ctx.Err(); return nil },
				func(context.Context) error { <-relay.Running(); return boom })
		}()
		require.ErrorIs(t, returned(t, done, "a function failed"), boom)
		require.ErrorIs(t, <-otherStopped, context.Canceled, "the other function's context was cancelled")
		stopped(t, relay)
	})

	t.Run("ctx done stops them all", func(t *testing.T) {
		relay := newRelay(t)
		runCtx, stop := context.WithCancel(ctx)
		otherStopped := make(chan struct{})
		done := make(chan error, 1)
		go func() {
			done <- relay.RunWith(runCtx, func(ctx context.Context) error { <-ctx.Done(); close(otherStopped); return nil })
		}()
		<-relay.Running()
		stop()
		require.NoError(t, returned(t, done, "ctx was cancelled"))
		<-otherStopped
		stopped(t, relay)
	})

	t.Run("a nil function", func(t *testing.T) {
		relay := newRelay(t)
		err := relay.RunWith(ctx, func(context.Context) error { return nil }, nil)
		require.ErrorContains(t, err, "function 1 of others is nil")
	})
}
