package outbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// A handler writes its output message to the outbox in its own transaction
// (a Writer's Publisher); the relay (NewRelay, Flush) then moves it to the real
// publisher (here an in-memory gochannel; in production watermill-amqp with
// ConfirmDelivery), keeping its UUID and metadata. One sqlschema.DB names
// the database and the table for all of them.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.DatabaseURL())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: "example_outbox_" + hex.EncodeToString(suffix)}
	defer func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE")
	}()
	if err := sqlschema.Migrate(ctx, db); err != nil {
		fmt.Println(err)
		return
	}

	// Once, at start-up: the Writer of the outbox table.
	w, err := outbox.NewWriter(db)
	if err != nil {
		fmt.Println(err)
		return
	}

	// In the handler's transaction: business writes, then the output message.
	tx, err := db.Conn.BeginTx(ctx, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	pub, err := w.Publisher(tx)
	if err != nil {
		fmt.Println(err)
		return
	}
	msg := message.NewMessage("order-42-confirmed", []byte(`{"order":42}`))
	msg.Metadata.Set("tenant", "acme")
	if err := pub.Publish("orders.confirmed", msg); err != nil {
		_ = tx.Rollback()
		fmt.Println(err)
		return
	}
	if err := tx.Commit(); err != nil {
		fmt.Println(err)
		return
	}

	// The operator's view of the table: the backlog, the failed rows.
	store, err := outbox.NewStore(db)
	if err != nil {
		fmt.Println(err)
		return
	}
	pending, err := store.Pending(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("pending:", pending.Count)

	// The relay, usually started once with relay.Run(ctx).
	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10}, watermill.NopLogger{})
	defer func() { _ = broker.Close() }()
	received, err := broker.Subscribe(ctx, "orders.confirmed")
	if err != nil {
		fmt.Println(err)
		return
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: broker})
	if err != nil {
		fmt.Println(err)
		return
	}
	n, err := relay.Flush(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("relayed:", n)

	var got *message.Message
	select {
	case got = <-received:
		got.Ack()
	case <-time.After(10 * time.Second):
		fmt.Println("nothing arrived")
		return
	}
	fmt.Println(got.UUID, string(got.Payload), got.Metadata.Get("tenant"))

	pending, err = store.Pending(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("pending:", pending.Count)
	// Output:
	// pending: 1
	// relayed: 1
	// order-42-confirmed {"order":42} acme
	// pending: 0
}

// refusing is a destination that refuses every message for good
// (exactlyonce.Permanent) until it is fixed, and keeps what it accepts.
type refusing struct {
	fixed bool
	got   []string
}

func (r *refusing) Publish(topic string, msgs ...*message.Message) error {
	if !r.fixed {
		return exactlyonce.Permanent(fmt.Errorf("%s refused: header over the broker's limit", topic))
	}
	for _, m := range msgs {
		r.got = append(r.got, topic+" "+m.UUID)
	}
	return nil
}

func (r *refusing) Close() error { return nil }

// An operator finds a quarantined row by the business id its producer set in
// the metadata, and requeues it once the cause is fixed: the relay sends it
// again at once, with its UUID. (Discard would delete it: never published.)
func ExampleStore_Find() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.DatabaseURL())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: "example_quarantine_" + hex.EncodeToString(suffix)}
	defer func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE")
	}()
	if err := sqlschema.Migrate(ctx, db); err != nil {
		fmt.Println(err)
		return
	}
	w, err := outbox.NewWriter(db)
	if err != nil {
		fmt.Println(err)
		return
	}
	tx, err := db.Conn.BeginTx(ctx, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	pub, err := w.Publisher(tx)
	if err != nil {
		fmt.Println(err)
		return
	}
	msg := message.NewMessage("order-42-shipped", []byte(`{"order":42}`))
	msg.Metadata.Set("order_id", "42")
	if err := pub.Publish("orders.shipped", msg); err != nil {
		_ = tx.Rollback()
		fmt.Println(err)
		return
	}
	if err := tx.Commit(); err != nil {
		fmt.Println(err)
		return
	}

	// The destination refuses it for good: quarantined.
	dest := &refusing{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: dest, MaxAttempts: 1, Logger: watermill.NopLogger{}})
	if err != nil {
		fmt.Println(err)
		return
	}
	_, err = relay.Flush(ctx)
	fmt.Println("relay failed:", err != nil)

	// Find it by its business id.
	store, err := outbox.NewStore(db)
	if err != nil {
		fmt.Println(err)
		return
	}
	page, err := store.Find(ctx, outbox.RowFilter{Metadata: map[string]string{"order_id": "42"}}, outbox.Page{})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, row := range page.Rows {
		fmt.Println(row.Topic, row.UUID, row.PayloadSize, "bytes", row.Quarantined(), row.LastError)
	}
	// Read one with its payload (GetPrefix reads at most its first bytes).
	row, err := store.Get(ctx, page.Rows[0].ID)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(string(row.Payload))

	// Fixed: requeue it, and the relay sends it.
	dest.fixed = true
	if err := store.Requeue(ctx, page.Rows[0].ID, outbox.Expect{}); err != nil {
		fmt.Println(err)
		return
	}
	n, err := relay.Flush(ctx)
	fmt.Println("relayed:", n, err, dest.got)
	left, err := store.Count(ctx, outbox.RowFilter{State: outbox.StateAll})
	fmt.Println("quarantined or failing:", left, err)
	// Output:
	// relay failed: true
	// orders.shipped order-42-shipped 12 bytes true permanent: orders.shipped refused: header over the broker's limit
	// {"order":42}
	// relayed: 1 <nil> [orders.shipped order-42-shipped]
	// quarantined or failing: 0 <nil>
}
