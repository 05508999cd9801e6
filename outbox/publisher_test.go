package outbox_test

import (
	"context"
	stdsql "database/sql"
	"encoding/json"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestPublisherWritesRowsExactly(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		m1 := message.NewMessage("0f8fad5b-d9cb-469f-a165-70867728950e", []byte(`{"order":42}`))
		m1.Metadata.Set("tenant", "acme")
		m1.Metadata.Set("trace", `quote " and ünïcode ✓`)
		m2 := message.NewMessage("order-42-binary", []byte{0x00, 0xff, 0x10, '\'', 0x00})
		m2.Metadata = nil
		m3 := message.NewMessage("order-42-empty", nil)

		tx := b.begin(t)
		pub, err := b.w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders.confirmed", m1, m2))
		require.NoError(t, pub.Publish("audit", m3))
		require.Equal(t, int64(3), b.count(t, tx), "the transaction sees its own rows")
		require.Zero(t, b.count(t, b.db), "nothing is visible before commit")
		require.NoError(t, tx.Commit())

		rows := b.rows(t)
		require.Len(t, rows, 3)
		require.Less(t, rows[0].ID, rows[1].ID)
		require.Less(t, rows[1].ID, rows[2].ID)

		require.Equal(t, "orders.confirmed", rows[0].Topic)
		require.Equal(t, m1.UUID, rows[0].UUID)
		require.Equal(t, []byte(`{"order":42}`), rows[0].Payload)
		var meta map[string]string
		require.NoError(t, json.Unmarshal([]byte(rows[0].Metadata), &meta))
		require.Equal(t, map[string]string{"tenant": "acme", "trace": `quote " and ünïcode ✓`}, meta)

		require.Equal(t, "orders.confirmed", rows[1].Topic)
		require.Equal(t, "order-42-binary", rows[1].UUID)
		require.Equal(t, []byte{0x00, 0xff, 0x10, '\'', 0x00}, rows[1].Payload, "bytea (LONGBLOB) keeps binary payloads")
		require.JSONEq(t, `{}`, rows[1].Metadata, "nil metadata is stored as an empty object")

		require.Equal(t, "audit", rows[2].Topic)
		require.Equal(t, "order-42-empty", rows[2].UUID)
		require.Empty(t, rows[2].Payload)
		require.JSONEq(t, `{}`, rows[2].Metadata)
	})
}

func TestPublisherRollback(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		tx := b.begin(t)
		pub, err := b.w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("t", message.NewMessage("a", []byte("1")), message.NewMessage("b", []byte("2"))))
		require.Equal(t, int64(2), b.count(t, tx))
		require.NoError(t, tx.Rollback())
		require.Zero(t, b.count(t, b.db), "a rolled-back transaction leaves no outbox row")
		require.Empty(t, b.rows(t))
	})
}

func TestPublisherErrors(t *testing.T) {
	t.Parallel()

	w, err := outbox.NewWriter(sqlschema.DB{})
	require.NoError(t, err)
	_, err = w.Publisher(nil)
	require.Error(t, err)
	require.Contains(t, err.Error(), "tx is nil")

	_, err = outbox.NewWriter(sqlschema.DB{OutboxTable: `x"; DROP TABLE y; --`})
	require.ErrorContains(t, err, "invalid SQL identifier")
	require.Contains(t, err.Error(), "outbox: NewWriter")
	require.Contains(t, err.Error(), "DB.OutboxTable")

	eachEngine(t, func(t *testing.T, b bundle) {

		tx := b.begin(t)
		pub, err := b.w.Publisher(tx)
		require.NoError(t, err)

		err = pub.Publish("", message.NewMessage("u-1", nil))
		require.Error(t, err)
		require.Contains(t, err.Error(), "topic")

		// The topic is a column, not a table name: watermill-sql's
		// table-name rule does not apply, text rules do.
		err = pub.Publish("bad \xff topic", message.NewMessage("u-1", nil))
		require.ErrorIs(t, err, pgtext.ErrNotUTF8)
		err = pub.Publish("nul\x00topic", message.NewMessage("u-1", nil))
		require.ErrorIs(t, err, pgtext.ErrNUL)

		err = pub.Publish("t", message.NewMessage("", []byte("no uuid")))
		require.Error(t, err)
		require.Contains(t, err.Error(), "empty UUID")

		// One bad message fails the whole call: the good one before it is
		// not written either.
		err = pub.Publish("t", message.NewMessage("good", nil), message.NewMessage("", nil))
		require.Error(t, err)
		require.Contains(t, err.Error(), "message 1")
		err = pub.Publish("t", message.NewMessage("good", nil), nil)
		require.Error(t, err)

		// The transaction is still usable: the errors were caught before SQL.
		require.NoError(t, pub.Publish("t", message.NewMessage("after", nil)))
		require.NoError(t, pub.Publish("t"), "publishing nothing is a no-op")
		require.NoError(t, pub.Publish("sms/sent v2.0 é", message.NewMessage("odd-topic", nil)), "any text is a topic")
		require.NoError(t, tx.Commit())
		rows := b.rows(t)
		require.Len(t, rows, 2)
		require.Equal(t, "after", rows[0].UUID)
		require.Equal(t, "sms/sent v2.0 é", rows[1].Topic)

		tx = b.begin(t)
		pub, err = b.w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, pub.Close())
		require.ErrorIs(t, pub.Publish("t", message.NewMessage("closed", nil)), wsql.ErrPublisherClosed)
		require.NoError(t, tx.Commit(), "Close does not touch the transaction")
		require.Equal(t, int64(2), b.count(t, b.db))
	})
}

func TestPublisherChunksLargeBatches(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const n = 2500 // more than the 1000 messages one INSERT takes
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = message.NewMessage(fmt.Sprintf("m-%05d", i), []byte(fmt.Sprintf(`{"i":%d}`, i)))
			msgs[i].Metadata.Set("i", fmt.Sprint(i))
		}
		b.publish(t, "bulk", msgs...)

		rows := b.rows(t)
		require.Len(t, rows, n)
		for i, r := range rows {
			require.Equal(t, fmt.Sprintf("m-%05d", i), r.UUID, "rows keep the order of the call")
			require.Equal(t, "bulk", r.Topic)
			require.Equal(t, fmt.Sprintf(`{"i":%d}`, i), string(r.Payload))
			require.JSONEq(t, fmt.Sprintf(`{"i":%q}`, fmt.Sprint(i)), r.Metadata)
		}

		// A bad message anywhere fails the call before any chunk is
		// written, even if the caller then commits.
		tx := b.begin(t)
		pub, err := b.w.Publisher(tx)
		require.NoError(t, err)
		msgs[1500] = message.NewMessage("", nil)
		require.ErrorContains(t, pub.Publish("bulk", msgs...), "message 1500 has an empty UUID")
		require.NoError(t, tx.Commit())
		require.Equal(t, int64(n), b.count(t, b.db), "nothing of the failed call was written")
	})
}

// A Publish outside a transaction (the Publisher bound to a pool or a
// *sql.DB) is one transaction of its own however many messages it writes:
// when its last INSERT (the outbox takes 1,000 messages per statement)
// fails, none of the call's rows is committed. Inside the caller's
// transaction, Publish starts none of its own: the rows appear at the
// caller's commit.
func TestPublisherOutsideTransactionIsOneTransaction(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		// A row the table refuses, written only by the third statement.
		b.exec(t, `ALTER TABLE `+b.tables.Outbox()+` ADD CONSTRAINT refuses_poison CHECK (uuid <> 'poison')`)
		const n = 2500
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = msgid.SetOrderingKey(message.NewMessage(fmt.Sprintf("m-%05d", i), []byte("{}")), fmt.Sprintf("k%d", i%7))
		}
		msgs[n-1] = message.NewMessage("poison", nil)

		pub, err := b.w.Publisher(b.db)
		require.NoError(t, err)
		require.ErrorContains(t, pub.Publish("bulk", msgs...), "refuses_poison")
		require.Zero(t, b.count(t, b.db), "the failed Publish left none of its 2,500 rows, although its first two INSERTs succeeded")

		msgs = msgs[:n-1]
		require.NoError(t, pub.Publish("bulk", msgs...))
		rows := b.rows(t)
		require.Len(t, rows, n-1)
		for i, r := range rows {
			require.Equal(t, fmt.Sprintf("m-%05d", i), r.UUID, "rows keep the order of the call")
		}

		// In the caller's transaction: nothing committed before the
		// caller's commit, and a failure is the caller's to roll back.
		b.exec(t, `DELETE FROM `+b.tables.Outbox())
		tx := b.begin(t)
		pub, err = b.w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("bulk", msgs...))
		require.Equal(t, int64(n-1), b.count(t, tx), "the transaction sees its rows")
		require.Zero(t, b.count(t, b.db), "Publish in the caller's transaction commits nothing of its own")
		require.NoError(t, tx.Commit())
		require.Equal(t, int64(n-1), b.count(t, b.db))
	})
}

// A Publish outside a transaction holds its keys' locks until all its rows
// are committed: a second writer of a key cannot commit between its
// INSERTs (1,000 messages each), so its row's id comes after every row of
// the large Publish, and the key's order is the commits'. The large
// Publish's driver stops before its second INSERT until the second writer
// waits for the key's lock, or has committed (which it must not).
func TestPublisherOutsideTransactionHoldsKeysToCommit(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const n = 2000
		big := make([]*message.Message, n)
		for i := range big {
			big[i] = msgid.SetOrderingKey(message.NewMessage(fmt.Sprintf("K-%04d", i), nil), "K")
		}
		// Stop before the second INSERT: on MySQL the second statement of
		// each INSERT's pair (key locks, INSERT).
		gate := &pausingBeginner{Beginner: b.db, at: 2, reached: make(chan struct{}), release: make(chan struct{})}
		if b.mysql() {
			gate.at = 3
		}
		bigDone := make(chan error, 1)
		go func() {
			pub, err := b.w.Publisher(gate)
			if err == nil {
				err = pub.Publish("orders", big...)
			}
			bigDone <- err
		}()
		select {
		case <-gate.reached:
		case err := <-bigDone:
			t.Fatalf("the large Publish ended before its second INSERT: %v", err)
		}

		secondDone := make(chan error, 1)
		go func() {
			pub, err := b.w.Publisher(b.db)
			if err == nil {
				err = pub.Publish("orders", msgid.SetOrderingKey(message.NewMessage("second", nil), "K"))
			}
			secondDone <- err
		}()
		// Either the second writer waits for a key lock of this table (as
		// it must), or it got in and committed (the bug).
		waiting := func() bool { return waitingForKey(t, b) > 0 }
		testenv.Eventually(t, 20*time.Second, func() bool { return len(secondDone) > 0 || waiting() },
			"the second writer of K either waits for the large Publish or is done")
		close(gate.release)
		require.NoError(t, <-bigDone)
		require.NoError(t, <-secondDone)

		rows := b.rows(t)
		require.Len(t, rows, n+1)
		require.Equal(t, "second", rows[n].UUID,
			"the second writer of K committed after the large Publish of K, so its row comes after all of them (it is at %d)",
			slices.IndexFunc(rows, func(r row) bool { return r.UUID == "second" }))
	})
}

// pausingBeginner is a driver whose statement number at (counted over
// ExecContext calls on it and on the transactions it began) waits until
// release is closed; reached is closed when it starts waiting.
type pausingBeginner struct {
	wsql.Beginner
	at      int32
	execs   atomic.Int32
	reached chan struct{}
	release chan struct{}
}

func (p *pausingBeginner) pause() {
	if p.execs.Add(1) == p.at {
		close(p.reached)
		<-p.release
	}
}

func (p *pausingBeginner) ExecContext(ctx context.Context, query string, args ...any) (wsql.Result, error) {
	p.pause()
	return p.Beginner.ExecContext(ctx, query, args...)
}

func (p *pausingBeginner) BeginTx(ctx context.Context, opts *stdsql.TxOptions) (wsql.Tx, error) {
	tx, err := p.Beginner.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return pausingTx{Tx: tx, p: p}, nil
}

type pausingTx struct {
	wsql.Tx
	p *pausingBeginner
}

func (t pausingTx) ExecContext(ctx context.Context, query string, args ...any) (wsql.Result, error) {
	t.p.pause()
	return t.Tx.ExecContext(ctx, query, args...)
}
