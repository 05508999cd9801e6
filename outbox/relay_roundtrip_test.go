package outbox_test

import (
	"context"
	stdsql "database/sql"
	"sync"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// countingBeginner counts the statements of the transactions it begins.
type countingBeginner struct {
	wsql.Beginner
	mu    sync.Mutex
	stmts int
}

func (c *countingBeginner) BeginTx(ctx context.Context, opts *stdsql.TxOptions) (wsql.Tx, error) {
	tx, err := c.Beginner.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &countingTx{Tx: tx, c: c}, nil
}

func (c *countingBeginner) take() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.stmts
	c.stmts = 0
	return n
}

type countingTx struct {
	wsql.Tx
	c *countingBeginner
}

func (t *countingTx) count() {
	t.c.mu.Lock()
	t.c.stmts++
	t.c.mu.Unlock()
}

func (t *countingTx) ExecContext(ctx context.Context, q string, args ...any) (wsql.Result, error) {
	t.count()
	return t.Tx.ExecContext(ctx, q, args...)
}

func (t *countingTx) QueryContext(ctx context.Context, q string, args ...any) (wsql.Rows, error) {
	t.count()
	return t.Tx.QueryContext(ctx, q, args...)
}

// The round trips of a relay batch, besides BEGIN and COMMIT: the probe,
// the batch's statement, the DELETE of the rows published, and the
// failures' UPDATE when a row failed; an empty poll is the probe and the
// batch's statement. With keyed rows or without, whatever the batch's
// size.
func TestRelayBatchRoundTrips(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		counting := &countingBeginner{Beginner: b.db}
		db := b.schema()
		db.Conn = counting
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: rec, BatchSize: 50, NoListen: true})
		require.NoError(t, err)

		n, err := relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		require.Equal(t, 2, counting.take(), "an empty poll: the probe and the batch")

		var msgs []*message.Message
		for i := range 30 {
			m := message.NewMessage("plain-"+string(rune('a'+i%26))+string(rune('0'+i/26)), nil)
			msgs = append(msgs, m)
		}
		b.publish(t, "t", msgs...)
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 30, n)
		require.Equal(t, 3, counting.take(), "a batch without keys: probe, batch, delete")

		msgs = nil
		for i := range 40 {
			m := message.NewMessage("keyed-"+string(rune('a'+i%26))+string(rune('0'+i/26)), nil)
			msgid.SetOrderingKey(m, string(rune('A'+i%4)))
			msgs = append(msgs, m)
		}
		b.publish(t, "t", msgs...)
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 40, n)
		require.Equal(t, 3, counting.take(), "a batch with keys: probe, batch, delete")

		rec.failUUID = "bad"
		b.publish(t, "t", message.NewMessage("good", nil), message.NewMessage("bad", nil))
		_, err = relay.Flush(b.ctx)
		require.Error(t, err)
		require.Equal(t, 4, counting.take(), "a batch with a failure: probe, batch, delete, failures")
	})
}
