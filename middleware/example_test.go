package middleware_test

import (
	"context"
	"fmt"
	"os"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The middleware wraps a plain handler: the first delivery runs it inside a
// transaction, the redelivery is acked without running it, and the returned
// message waits in the outbox for the relay. In a service, attach
// eo.Middleware to a router or handler instead of calling it directly.
func Example() {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	db := wsql.BeginnerFromPgx(pool)

	tables := sqlschema.Config{Schema: "example_middleware"}
	_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS example_middleware CASCADE") // a clean slate
	if err := sqlschema.Migrate(ctx, db, tables); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA example_middleware CASCADE") //nolint:errcheck // best-effort cleanup
	if _, err := pool.Exec(ctx, "CREATE TABLE example_middleware.greetings (name text)"); err != nil {
		panic(err)
	}

	eo, err := middleware.New(middleware.Config{DB: db, Tables: tables, Consumer: "greeter", PublishTopic: "greeted"})
	if err != nil {
		panic(err)
	}
	handler := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := middleware.PgxTxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), "INSERT INTO example_middleware.greetings VALUES ($1)", string(msg.Payload)); err != nil {
			return nil, err
		}
		fmt.Println("handler ran for", msg.UUID)
		return []*message.Message{message.NewMessage("greeted-"+msg.UUID, msg.Payload)}, nil
	})

	msg := message.NewMessage("msg-1", []byte("Ada"))
	for range 3 { // one delivery and two redeliveries
		if _, err := handler(msg); err != nil {
			panic(err)
		}
	}

	var greetings int
	_ = pool.QueryRow(ctx, "SELECT count(*) FROM example_middleware.greetings").Scan(&greetings)
	pending, _ := outbox.PendingStats(ctx, db, tables)
	rec, _ := eo.Store().Lookup(ctx, db, "greeter", "msg-1")
	fmt.Println("greetings:", greetings, "outbox:", pending.Count, "status:", rec.Status, "duplicates:", rec.Duplicates)
	// Output:
	// handler ran for msg-1
	// greetings: 1 outbox: 1 status: done duplicates: 2
}
