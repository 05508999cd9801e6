// Command quickstart is a small complete use of watermill-exactlyonce:
// a Watermill router consumes "order placed" messages from RabbitMQ, the
// exactly-once middleware deduplicates them in PostgreSQL in the same
// transaction as the handler's insert, the handler's "order confirmed" event
// goes through the outbox, and the relay publishes it to RabbitMQ.
//
// It publishes a batch that contains duplicates and one simulated lost ack
// (a redelivery after the commit), waits until everything is processed and
// relayed, prints a summary table and exits. Run it with
// `cd examples && go run ./quickstart`. examples/gettingstarted is the
// long-running service to copy.
//
// Configuration: DATABASE_URL (default postgres on 127.0.0.1:5432, database
// test) and AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// names are the schema and the queues (topics) of a run.
type names struct {
	schema, orders, confirmed string
}

var defaultNames = names{schema: "quickstart", orders: "quickstart.orders", confirmed: "quickstart.confirmed"}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Stdout, defaultNames)
	stop()
	if err != nil {
		log.Fatalf("quickstart: %v", err)
	}
}

func run(ctx context.Context, out io.Writer, n names) error {
	dbURL := env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	amqpURL := env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	// Warnings and errors only; the simulated lost ack below logs one error.
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))

	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()

	// 1. Schema: the inbox and outbox tables (idempotent), and our own table.
	// db names the database and the tables once, for everything below.
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: n.schema}
	if err := sqlschema.Migrate(ctx, db); err != nil {
		return err
	}
	orders := pgx.Identifier{n.schema, "orders"}.Sanitize()
	for _, q := range []string{
		`CREATE TABLE IF NOT EXISTS ` + orders + ` (order_id text PRIMARY KEY, placed_at timestamptz NOT NULL DEFAULT now())`,
		// A fresh run every time.
		`TRUNCATE ` + orders + `, ` + db.Inbox() + `, ` + db.Outbox(),
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			return err
		}
	}

	// 2. RabbitMQ: a durable queue per topic, publisher confirms on.
	if err := rabbitmq.DeclareQueues(ctx, amqpURL, n.orders, n.confirmed); err != nil {
		return err
	}
	if err := purgeQueues(amqpURL, n.orders, n.confirmed); err != nil {
		return err
	}
	amqpCfg := wamqp.NewDurableQueueConfig(amqpURL)
	amqpCfg.Marshaler = rabbitmq.Marshaler{}
	amqpCfg.Publish.ConfirmDelivery = true
	// No channel pool: watermill-amqp v3.1.0's pool can lose all its
	// channels after a broker outage, and Publish then blocks forever
	// (upstream fix: ThreeDotsLabs/watermill-amqp#37).
	amqpCfg.Publish.ChannelPoolSize = 0
	producer, err := wamqp.NewPublisher(amqpCfg, logger) // stands in for another service
	if err != nil {
		return err
	}
	defer producer.Close()
	relayPub, err := wamqp.NewPublisher(amqpCfg, logger) // the relay's own
	if err != nil {
		return err
	}
	defer relayPub.Close()
	sub, err := wamqp.NewSubscriber(amqpCfg, logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	confirmedSub, err := wamqp.NewSubscriber(amqpCfg, logger)
	if err != nil {
		return err
	}
	defer confirmedSub.Close()

	// 3. The router with the exactly-once middleware.
	var processed, duplicates atomic.Int64
	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Logger: logger, OnEvent: func(e exactlyonce.Event) {
		switch e.Outcome {
		case exactlyonce.Processed:
			processed.Add(1)
		case exactlyonce.Duplicate:
			duplicates.Add(1)
		}
	}})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	var lostAcks atomic.Int32
	var delivered atomic.Int64 // every delivery that reached the handler's middlewares
	// Four deliveries in flight under one handler (one consumer name).
	handler := router.AddHandler("confirm-order", n.orders, exactlyonce.ConcurrentSubscriber(sub, 4),
		n.confirmed, exactlyonce.OutboxOnly(),
		func(msg *message.Message) ([]*message.Message, error) {
			tx, err := exactlyonce.PgxTxFromContext(msg.Context())
			if err != nil {
				return nil, err
			}
			if _, err := tx.Exec(msg.Context(),
				`INSERT INTO `+orders+` (order_id) VALUES ($1)`, msg.UUID); err != nil {
				return nil, err
			}
			event := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"`+msg.UUID+`"}`))
			return []*message.Message{event}, nil // written to the outbox, same transaction
		})
	// Simulate one lost ack: after the first commit, report a failure so
	// RabbitMQ redelivers. The inbox recognises the redelivery.
	handler.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			delivered.Add(1)
			out, err := h(msg)
			if err == nil && msg.UUID == "order-1" && lostAcks.Add(1) == 1 {
				return nil, errors.New("simulated lost ack after commit")
			}
			return out, err
		}
	}, eo.Middleware)

	// 4. The relay: outbox -> RabbitMQ, with its own publisher.
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: relayPub, PollInterval: 50 * time.Millisecond, Logger: logger})
	if err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	relayDone := make(chan struct{})
	go func() { defer close(relayDone); _ = relay.Run(runCtx) }()
	defer func() { cancel(); <-relayDone }()
	routerDone := make(chan struct{})
	go func() { defer close(routerDone); _ = router.Run(runCtx) }()
	defer func() { _ = router.Close(); <-routerDone }()
	<-router.Running()

	var confirmed atomic.Int32
	confirmedMsgs, err := confirmedSub.Subscribe(runCtx, n.confirmed)
	if err != nil {
		return err
	}
	go func() {
		for m := range confirmedMsgs {
			confirmed.Add(1)
			m.Ack()
		}
	}()

	// 5. Publish 5 orders; orders 1-3 are sent more than once.
	copies := map[string]int{"order-1": 2, "order-2": 3, "order-3": 2, "order-4": 1, "order-5": 1}
	published := 0
	for _, id := range []string{"order-1", "order-2", "order-3", "order-4", "order-5"} {
		for range copies[id] {
			if err := producer.Publish(n.orders, message.NewMessage(id, []byte(`{}`))); err != nil {
				return err
			}
			published++
		}
	}
	deliveries := int64(published + 1) // + the redelivery after the lost ack

	deadline := time.After(30 * time.Second)
	for processed.Load()+duplicates.Load() < deliveries || confirmed.Load() < 5 {
		select {
		case <-deadline:
			return fmt.Errorf("timed out: processed=%d duplicates=%d relayed=%d",
				processed.Load(), duplicates.Load(), confirmed.Load())
		case <-time.After(50 * time.Millisecond):
		}
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+orders).Scan(&rows); err != nil {
		return err
	}

	_, _ = fmt.Fprintln(out)
	_, _ = fmt.Fprintln(out, "watermill-exactlyonce quickstart")
	_, _ = fmt.Fprintf(out, "  %-38s %d\n", "messages published (5 distinct orders)", published)
	_, _ = fmt.Fprintf(out, "  %-38s %d\n", "redeliveries after a lost ack", delivered.Load()-int64(published))
	_, _ = fmt.Fprintf(out, "  %-38s %d\n", "handler runs committed", processed.Load())
	_, _ = fmt.Fprintf(out, "  %-38s %d\n", "duplicates blocked", duplicates.Load())
	_, _ = fmt.Fprintf(out, "  %-38s %d\n", "order rows written", rows)
	_, _ = fmt.Fprintf(out, "  %-38s %d\n", "confirmed events relayed", confirmed.Load())
	if rows != 5 || confirmed.Load() != 5 || processed.Load() != 5 {
		return errors.New("expected exactly one effect and one event per order")
	}
	_, _ = fmt.Fprintln(out, "  every order took effect exactly once.")
	return nil
}
