package inbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// An operator finds the parked message of order A-1042 by the business id
// its producer set in the metadata, counts what a bulk replay would take,
// and replays the message: the key is released and the message written to
// the outbox for its topic, with its UUID, in one transaction; the relay
// publishes it, and the consumer runs it once.
func ExampleStore_ReplayParked() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.DatabaseURL())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: "example_parked_" + hex.EncodeToString(suffix)}
	defer func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE")
	}()
	if err := sqlschema.Migrate(ctx, db); err != nil {
		fmt.Println(err)
		return
	}
	// What the middleware left behind: a key parked by a Permanent handler
	// error, and the message it was parked with.
	if _, err := pool.Exec(ctx, `INSERT INTO `+db.Inbox()+` (consumer, message_key, status, processed_at, last_error, parked_by_transaction)
VALUES ('ship-order', 'msg-7', 'parked', now(), 'address rejected by carrier', true)`); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{db.Schema, "watermill_inbox_parked"}.Sanitize()+`
(consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at)
VALUES ('ship-order', 'msg-7', 'msg-7', 'orders.paid', '{"order":"A-1042"}', 18, '{"order_id":"A-1042"}', 'address rejected by carrier', 1, now())`); err != nil {
		fmt.Println(err)
		return
	}

	store, err := inbox.NewStore(db)
	if err != nil {
		fmt.Println(err)
		return
	}
	f := inbox.ParkedFilter{Consumer: "ship-order", Metadata: map[string]string{"order_id": "A-1042"}}
	page, err := store.FindParked(ctx, f, inbox.Page{})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, m := range page.Messages {
		fmt.Printf("found: %s from %s, %d bytes (%s), key %s\n", m.UUID, m.Topic, m.PayloadSize, m.Reason, m.Status)
	}
	n, err := store.CountParked(ctx, f)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("a bulk replay would take:", n)

	m, err := store.ReplayParked(ctx, "ship-order", "msg-7", inbox.ReplayOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	rec, err := store.Get(ctx, "ship-order", "msg-7")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("replayed to %s; key %s\n", m.Topic, rec.Status)
	_, err = store.ReplayParked(ctx, "ship-order", "msg-7", inbox.ReplayOptions{})
	fmt.Println(err)
	// Output:
	// found: msg-7 from orders.paid, 18 bytes (address rejected by carrier), key parked
	// a bulk replay would take: 1
	// replayed to orders.paid; key failed
	// inbox: replay parked: no parked message for this consumer and key (replayed or discarded meanwhile, or never parked with its content) (consumer "ship-order", key "msg-7")
}
