package outbox_test

import (
	"encoding/json"
	"fmt"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestPublisherWritesRowsExactly(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		m1 := message.NewMessage("0f8fad5b-d9cb-469f-a165-70867728950e", []byte(`{"order":42}`))
		m1.Metadata.Set("tenant", "acme")
		m1.Metadata.Set("trace", `quote " and ünïcode ✓`)
		m2 := message.NewMessage("order-42-binary", []byte{0x00, 0xff, 0x10, '\'', 0x00})
		m2.Metadata = nil
		m3 := message.NewMessage("order-42-empty", nil)

		tx := b.begin(t)
		pub, err := outbox.NewPublisher(tx, b.tables)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders.confirmed", m1, m2))
		require.NoError(t, pub.Publish("audit", m3))
		require.Equal(t, int64(3), b.pending(t, tx), "the transaction sees its own rows")
		require.Zero(t, b.pending(t, b.db), "nothing is visible before commit")
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
		require.Equal(t, []byte{0x00, 0xff, 0x10, '\'', 0x00}, rows[1].Payload, "bytea keeps binary payloads")
		require.JSONEq(t, `{}`, rows[1].Metadata, "nil metadata is stored as an empty object")

		require.Equal(t, "audit", rows[2].Topic)
		require.Equal(t, "order-42-empty", rows[2].UUID)
		require.Empty(t, rows[2].Payload)
		require.JSONEq(t, `{}`, rows[2].Metadata)
	})
}

func TestPublisherRollback(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		tx := b.begin(t)
		pub, err := outbox.NewPublisher(tx, b.tables)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("t", message.NewMessage("a", []byte("1")), message.NewMessage("b", []byte("2"))))
		require.Equal(t, int64(2), b.pending(t, tx))
		require.NoError(t, tx.Rollback())
		require.Zero(t, b.pending(t, b.db), "a rolled-back transaction leaves no outbox row")
		require.Empty(t, b.rows(t))
	})
}

func TestPublisherErrors(t *testing.T) {
	t.Parallel()

	_, err := outbox.NewPublisher(nil, sqlschema.DB{})
	require.Error(t, err)
	require.Contains(t, err.Error(), "tx is nil")

	eachDriver(t, func(t *testing.T, b bundle) {
		_, err := outbox.NewPublisher(b.db, sqlschema.DB{OutboxTable: `x"; DROP TABLE y; --`})
		require.ErrorContains(t, err, "invalid SQL identifier")
		require.Contains(t, err.Error(), "outbox: NewPublisher")
		require.Contains(t, err.Error(), "DB.OutboxTable")

		tx := b.begin(t)
		pub, err := outbox.NewPublisher(tx, b.tables)
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
		pub, err = outbox.NewPublisher(tx, b.tables)
		require.NoError(t, err)
		require.NoError(t, pub.Close())
		require.ErrorIs(t, pub.Publish("t", message.NewMessage("closed", nil)), wsql.ErrPublisherClosed)
		require.NoError(t, tx.Commit(), "Close does not touch the transaction")
		require.Equal(t, int64(2), b.pending(t, b.db))
	})
}

func TestPublisherChunksLargeBatches(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
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
		pub, err := outbox.NewPublisher(tx, b.tables)
		require.NoError(t, err)
		msgs[1500] = message.NewMessage("", nil)
		require.ErrorContains(t, pub.Publish("bulk", msgs...), "message 1500 has an empty UUID")
		require.NoError(t, tx.Commit())
		require.Equal(t, int64(n), b.pending(t, b.db), "nothing of the failed call was written")
	})
}
