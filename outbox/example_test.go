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

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// A handler writes its output message to the outbox in its own transaction
// (NewPublisher); the relay (NewRelay, RelayOnce) then moves it to the real
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

	// In the handler's transaction: business writes, then the output message.
	tx, err := db.Conn.BeginTx(ctx, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	pub, err := outbox.NewPublisher(tx, db)
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

	pending, err := outbox.PendingStats(ctx, db)
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
	n, err := relay.RelayOnce(ctx)
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

	pending, err = outbox.PendingStats(ctx, db)
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
