package exactlyonce_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// writeEffect inserts one row into the test's effects table (b.Table
// "effects") through the handler's transaction, whichever driver it is.
func writeEffect(ctx context.Context, b *testenv.Bundle, id string) error {
	return testenv.Exec(ctx, b.Q("INSERT INTO "+b.Table("effects")+" (id) VALUES ($1)"), id)
}

func count(t *testing.T, d testenv.Driver, q string) int64 {
	t.Helper()
	var n int64
	require.NoError(t, seam.QueryRow(context.Background(), d.DB, q, nil, &n))
	return n
}

// requirePanic asserts that err carries Watermill's RecoveredPanicError
// with the panic value v.
func requirePanic(t *testing.T, err error, v any) {
	t.Helper()
	var pe middleware.RecoveredPanicError
	require.ErrorAs(t, err, &pe, "a handler panic is returned as middleware.RecoveredPanicError")
	require.Equal(t, v, pe.V)
	require.NotEmpty(t, pe.Stacktrace)
}

func TestTransactional(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		tables, d, ctx := b.DB, b.Driver, b.Ctx
		b.Exec(t, "CREATE TABLE "+b.Table("effects")+" (id text)")
		effects := "SELECT count(*) FROM " + b.Table("effects")

		var counters testenv.Counters
		eo, err := exactlyonce.New(exactlyonce.Config{
			DB: tables, Consumer: "c1", PublishTopic: "out", OnEvent: counters.Observe,
			Logger: testenv.Logger(t),
		})
		require.NoError(t, err)

		calls := 0
		h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			calls++
			if err := writeEffect(msg.Context(), b, msg.UUID); err != nil {
				return nil, err
			}
			if calls == 1 {
				return nil, errors.New("first attempt fails after writing")
			}
			if calls == 2 {
				panic("second attempt panics")
			}
			return []*message.Message{message.NewMessage("out-"+msg.UUID, []byte(`{"ok":true}`))}, nil
		})

		msg := message.NewMessage("m-1", []byte("{}"))
		_, err = h(msg)
		require.Error(t, err)
		_, err = h(msg)
		requirePanic(t, err, "second attempt panics")
		require.Equal(t, int64(0), count(t, d, effects), "failed attempts must leave nothing")

		for range 4 {
			out, err := h(msg)
			require.NoError(t, err)
			require.Empty(t, out, "outputs go to the outbox, not the router")
		}
		require.Equal(t, 3, calls)
		require.Equal(t, int64(1), count(t, d, effects))
		require.Equal(t, int64(1), counters.Processed.Load())
		require.Equal(t, int64(3), counters.Duplicates.Load())

		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		rec, err := store.Lookup(ctx, d.DB, "c1", "m-1")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, int64(3), rec.Duplicates)

		p, err := testenv.OutboxStore(t, tables).Pending(ctx)
		require.NoError(t, err)
		require.Equal(t, int64(1), p.Count)

		_, err = h(message.NewMessage("", nil))
		require.ErrorIs(t, err, inboxdb.ErrEmptyKey)
		require.ErrorIs(t, err, exactlyonce.ErrInvalidKey)
	})
}

// TestTransactionalBackToBack: deliveries one right after the other, in
// both SQL modes, are each processed, while something else on the server
// reads information_schema.innodb_trx every 20ms (a monitoring agent, or
// other workers). On MySQL the check before COMMIT (Store.CheckOpen) once
// asked innodb_trx, which InnoDB serves from a cache refreshed only when
// 0.1s passed since its last read: a transaction begun a moment ago was not
// in it, and every commit was refused as rolled back.
func TestTransactionalBackToBack(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		if b.MySQL() {
			stop := make(chan struct{})
			done := make(chan struct{})
			go func() {
				defer close(done)
				for {
					select {
					case <-stop:
						return
					case <-time.After(20 * time.Millisecond):
						var n int64
						_ = seam.QueryRow(b.Ctx, b.Driver.DB, "SELECT count(*) FROM information_schema.innodb_trx", nil, &n)
					}
				}
			}()
			t.Cleanup(func() { close(stop); <-done })
		}
		for _, batch := range []*exactlyonce.BatchConfig{nil, {MaxSize: 1}} {
			var ev testenv.Counters
			consumer := "c"
			if batch != nil {
				consumer = "c-batch"
			}
			eo, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Consumer: consumer, Batch: batch, NackDelay: -1,
				OnEvent: ev.Observe, Logger: testenv.Logger(t)})
			require.NoError(t, err)
			h := eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			for i := range 20 {
				_, err := h(message.NewMessage(fmt.Sprintf("k-%d", i), nil))
				require.NoError(t, err, "%s: delivery %d", consumer, i)
			}
			require.Equal(t, int64(20), ev.Processed.Load(), consumer)
		}
	})
}
