package inbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// An operator's round: list the parked keys, release one after fixing its
// cause (its next delivery runs again), count the records, and purge old
// ones. The store takes the same sqlschema.DB as the middleware.
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
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: "example_inbox_" + hex.EncodeToString(suffix)}
	defer func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE")
	}()
	if err := sqlschema.Migrate(ctx, db); err != nil {
		fmt.Println(err)
		return
	}
	// What the middleware left behind: a key done long ago, and one parked
	// by a Permanent handler error.
	if _, err := pool.Exec(ctx, `INSERT INTO `+db.Inbox()+` (consumer, message_key, status, processed_at, last_error) VALUES
('send-sms', 'order-41', 'done', now() - interval '30 days', NULL),
('send-sms', 'order-42', 'parked', now(), '400 invalid phone number')`); err != nil {
		fmt.Println(err)
		return
	}

	store, err := inbox.NewStore(db)
	if err != nil {
		fmt.Println(err)
		return
	}
	parked, err := store.Parked(ctx, "send-sms", 10)
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range parked {
		fmt.Printf("parked: %s (%s)\n", r.Key, r.LastError)
	}

	released, err := store.Release(ctx, "send-sms", "order-42", inbox.Expect{})
	if err != nil {
		fmt.Println(err)
		return
	}
	rec, err := store.Get(ctx, "send-sms", "order-42")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("released:", released, "status:", rec.Status)

	st, err := store.Stats(ctx, "send-sms")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("records:", st.Total, st.Rows)

	n, err := store.Purge(ctx, inbox.PurgeOptions{OlderThan: 14 * 24 * time.Hour})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("purged:", n)
	// Output:
	// parked: order-42 (400 invalid phone number)
	// released: true status: failed
	// records: 2 map[done:1 failed:1]
	// purged: 1
}
