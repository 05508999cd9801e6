package exactlyonce_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func exampleDatabaseURL() string {
	if url := os.Getenv("DATABASE_URL"); url != "" {
		return url
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

// The middleware wraps a plain handler: the first delivery runs it inside a
// transaction, the redelivery is acked without running it, and the returned
// message waits in the outbox for the relay. In a service, attach
// eo.Middleware to a router or handler instead of calling it directly (see
// Example_router).
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDatabaseURL())
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: "example_middleware"}
	_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS example_middleware CASCADE") // a clean slate
	if err := sqlschema.Migrate(ctx, db); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA example_middleware CASCADE") //nolint:errcheck // best-effort cleanup
	if _, err := pool.Exec(ctx, "CREATE TABLE example_middleware.greetings (name text)"); err != nil {
		panic(err)
	}

	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Consumer: "greeter", PublishTopic: "greeted", Logger: watermill.NopLogger{}})
	if err != nil {
		panic(err)
	}
	handler := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, err := exactlyonce.PgxTxFromContext(msg.Context())
		if err != nil {
			return nil, err
		}
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
	rows, err := outbox.NewStore(db)
	if err != nil {
		panic(err)
	}
	pending, _ := rows.Pending(ctx)
	store, err := inbox.NewStore(db)
	if err != nil {
		panic(err)
	}
	rec, _ := store.Get(ctx, "greeter", "msg-1")
	fmt.Println("greetings:", greetings, "outbox:", pending.Count, "status:", rec.Status, "duplicates:", rec.Duplicates)
	// Output:
	// handler ran for msg-1
	// greetings: 1 outbox: 1 status: done duplicates: 2
}

// A Watermill router with the middleware: a GoChannel delivers the same
// message twice; the handler runs once, inserting through the message's
// transaction and returning a message, which goes to the outbox in that
// transaction (the handler is registered with OutboxOnly as its publisher).
// The second copy is acked as a duplicate.
func Example_router() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDatabaseURL())
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: "example_router"}
	_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS example_router CASCADE") // a clean slate
	if err := sqlschema.Migrate(ctx, db); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA example_router CASCADE") //nolint:errcheck // best-effort cleanup
	if _, err := pool.Exec(ctx, "CREATE TABLE example_router.greetings (name text)"); err != nil {
		panic(err)
	}

	outcomes := make(chan exactlyonce.Outcome, 2)
	eo, err := exactlyonce.New(exactlyonce.Config{
		DB:      db,
		OnEvent: func(e exactlyonce.Event) { outcomes <- e.Outcome },
		Logger:  watermill.NopLogger{},
	})
	if err != nil {
		panic(err)
	}

	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(eo.Middleware)
	router.AddHandler("greeter", "greetings", pubSub, "greeted", exactlyonce.OutboxOnly(),
		func(msg *message.Message) ([]*message.Message, error) {
			tx, err := exactlyonce.PgxTxFromContext(msg.Context())
			if err != nil {
				return nil, err
			}
			if _, err := tx.Exec(msg.Context(), "INSERT INTO example_router.greetings VALUES ($1)", string(msg.Payload)); err != nil {
				return nil, err
			}
			fmt.Println("handler ran for", msg.UUID)
			return []*message.Message{message.NewMessage("greeted-"+msg.UUID, msg.Payload)}, nil
		})
	stopped := make(chan error, 1)
	go func() { stopped <- router.Run(ctx) }()
	<-router.Running()

	msg := message.NewMessage("msg-1", []byte("Ada"))
	if err := pubSub.Publish("greetings", msg, msg); err != nil { // the same message twice
		panic(err)
	}
	counts := map[exactlyonce.Outcome]int{}
	for range 2 {
		select {
		case o := <-outcomes:
			counts[o]++
		case <-time.After(30 * time.Second):
			panic("the router did not handle both copies")
		}
	}
	if err := router.Close(); err != nil {
		panic(err)
	}
	if err := <-stopped; err != nil {
		panic(err)
	}
	_ = pubSub.Close()

	var greetings, outboxRows int
	_ = pool.QueryRow(ctx, "SELECT count(*) FROM example_router.greetings").Scan(&greetings)
	_ = pool.QueryRow(ctx, "SELECT count(*) FROM "+db.Outbox()).Scan(&outboxRows)
	fmt.Println("processed:", counts[exactlyonce.Processed], "duplicates:", counts[exactlyonce.Duplicate])
	fmt.Println("greetings:", greetings, "outbox rows:", outboxRows)
	// Output:
	// handler ran for msg-1
	// processed: 1 duplicates: 1
	// greetings: 1 outbox rows: 1
}
