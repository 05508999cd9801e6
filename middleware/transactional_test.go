package middleware_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// writeEffect inserts one row into the test's effects table through the
// handler's transaction, whichever driver it is.
func writeEffect(ctx context.Context, tables sqlschema.Config, id string) error {
	q := "INSERT INTO " + pgx.Identifier{tables.Schema, "effects"}.Sanitize() + " (id) VALUES ($1)"
	if tx, ok := middleware.PgxTxFromContext(ctx); ok {
		_, err := tx.Exec(ctx, q, id)
		return err
	}
	if tx, ok := middleware.StdTxFromContext(ctx); ok {
		_, err := tx.ExecContext(ctx, q, id)
		return err
	}
	return errors.New("no transaction in the handler's context")
}

func count(t *testing.T, d testenv.Driver, q string) int64 {
	t.Helper()
	var n int64
	require.NoError(t, seam.QueryRow(context.Background(), d.DB, q, nil, &n))
	return n
}

func TestTransactional(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			tables := testenv.Schema(t)
			ctx := context.Background()
			_, err := d.DB.ExecContext(ctx, "CREATE TABLE "+pgx.Identifier{tables.Schema, "effects"}.Sanitize()+" (id text)")
			require.NoError(t, err)
			effects := "SELECT count(*) FROM " + pgx.Identifier{tables.Schema, "effects"}.Sanitize()

			var counters middleware.Counters
			eo, err := middleware.New(middleware.Config{
				DB: d.DB, Tables: tables, Consumer: "c1", PublishTopic: "out", OnEvent: counters.Observe,
			})
			require.NoError(t, err)

			calls := 0
			h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				calls++
				if err := writeEffect(msg.Context(), tables, msg.UUID); err != nil {
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
			require.ErrorIs(t, err, middleware.ErrHandlerPanic)
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

			store, err := inbox.NewStore(inbox.Config{Tables: tables})
			require.NoError(t, err)
			rec, err := store.Lookup(ctx, d.DB, "c1", "m-1")
			require.NoError(t, err)
			require.Equal(t, inbox.StatusDone, rec.Status)
			require.Equal(t, int64(3), rec.Duplicates)

			p, err := outbox.PendingStats(ctx, d.DB, tables)
			require.NoError(t, err)
			require.Equal(t, int64(1), p.Count)

			_, err = h(message.NewMessage("", nil))
			require.ErrorIs(t, err, middleware.ErrEmptyKey)
		})
	}
}
