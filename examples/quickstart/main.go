// Command quickstart is the smallest complete use of watermill-exactlyonce:
// a Watermill router consumes "order placed" messages from RabbitMQ, the
// exactly-once middleware deduplicates them in PostgreSQL in the same
// transaction as the handler's insert, the handler's "order confirmed" event
// goes through the outbox, and the relay publishes it to RabbitMQ.
//
// It publishes a batch that contains duplicates and one simulated lost ack
// (a redelivery after the commit), waits until everything is processed and
// relayed, prints a summary table and exits. Run it with `make demo`.
//
// Configuration: DATABASE_URL (default postgres on 127.0.0.1:5432, database
// test) and AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/).
package main

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

const (
	ordersTopic    = "quickstart.orders"
	confirmedTopic = "quickstart.confirmed"
)

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx)
	stop()
	if err != nil {
		log.Fatalf("quickstart: %v", err)
	}
}

func run(ctx context.Context) error {
	dbURL := env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	amqpURL := env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	// Warnings and errors only; the simulated lost ack below logs one error.
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))

	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := wsql.BeginnerFromPgx(pool)

	// 1. Schema: the inbox and outbox tables (idempotent), and our own table.
	tables := sqlschema.Config{Schema: "quickstart"}
	if err := sqlschema.Migrate(ctx, db, tables); err != nil {
		return err
	}
	for _, q := range []string{
		`CREATE TABLE IF NOT EXISTS quickstart.orders (order_id text PRIMARY KEY, placed_at timestamptz NOT NULL DEFAULT now())`,
		// A fresh demo every run.
		`TRUNCATE quickstart.orders, quickstart.watermill_inbox, quickstart.watermill_outbox`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			return err
		}
	}

	// 2. RabbitMQ: a durable queue per topic, publisher confirms on.
	amqpCfg := wamqp.NewDurableQueueConfig(amqpURL)
	amqpCfg.Publish.ConfirmDelivery = true
	// No channel pool: watermill-amqp v3.1.0's pool can lose all its
	// channels after a broker outage, and Publish then blocks forever
	// (docs/getting-started.md, "Run the relay").
	amqpCfg.Publish.ChannelPoolSize = 0
	pub, err := wamqp.NewPublisher(amqpCfg, logger)
	if err != nil {
		return err
	}
	defer pub.Close()
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
	purgeQueues(amqpURL, ordersTopic, confirmedTopic)

	// 3. The router with the exactly-once middleware.
	var counters middleware.Counters
	eo, err := middleware.New(middleware.Config{DB: db, Tables: tables, OnEvent: counters.Observe})
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	var lostAcks atomic.Int32
	handler := router.AddHandler("confirm-order", ordersTopic, sub, confirmedTopic, pub,
		func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := middleware.PgxTxFromContext(msg.Context())
			if _, err := tx.Exec(msg.Context(),
				`INSERT INTO quickstart.orders (order_id) VALUES ($1)`, msg.UUID); err != nil {
				return nil, err
			}
			event := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"`+msg.UUID+`"}`))
			return []*message.Message{event}, nil // written to the outbox, same transaction
		})
	// Simulate one lost ack: after the first commit, report a failure so
	// RabbitMQ redelivers. The inbox recognises the redelivery.
	handler.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && msg.UUID == "order-1" && lostAcks.Add(1) == 1 {
				return nil, errors.New("simulated lost ack after commit")
			}
			return out, err
		}
	}, eo.Middleware)

	// 4. The relay: outbox -> RabbitMQ.
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: pub, Tables: tables, PollInterval: 50 * time.Millisecond})
	if err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = relay.Run(runCtx) }()
	go func() { _ = router.Run(runCtx) }()
	<-router.Running()

	var confirmed atomic.Int32
	confirmedMsgs, err := confirmedSub.Subscribe(runCtx, confirmedTopic)
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
			if err := pub.Publish(ordersTopic, message.NewMessage(id, []byte(`{}`))); err != nil {
				return err
			}
			published++
		}
	}
	deliveries := int64(published + 1) // + the redelivery after the lost ack

	deadline := time.After(30 * time.Second)
	for counters.Processed.Load()+counters.Duplicates.Load() < deliveries || confirmed.Load() < 5 {
		select {
		case <-deadline:
			return fmt.Errorf("timed out: processed=%d duplicates=%d relayed=%d",
				counters.Processed.Load(), counters.Duplicates.Load(), confirmed.Load())
		case <-time.After(50 * time.Millisecond):
		}
	}
	var orders int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM quickstart.orders`).Scan(&orders); err != nil {
		return err
	}
	cancel()
	_ = router.Close()

	fmt.Println()
	fmt.Println("watermill-exactlyonce quickstart")
	fmt.Printf("  %-38s %d\n", "messages published (5 distinct orders)", published)
	fmt.Printf("  %-38s %d\n", "redeliveries after a lost ack", 1)
	fmt.Printf("  %-38s %d\n", "handler runs committed", counters.Processed.Load())
	fmt.Printf("  %-38s %d\n", "duplicates blocked", counters.Duplicates.Load())
	fmt.Printf("  %-38s %d\n", "order rows written", orders)
	fmt.Printf("  %-38s %d\n", "confirmed events relayed", confirmed.Load())
	if orders != 5 || confirmed.Load() != 5 {
		return errors.New("expected exactly one effect and one event per order")
	}
	fmt.Println("  every order took effect exactly once.")
	return nil
}
