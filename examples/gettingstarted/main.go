// Command gettingstarted is the complete program of docs/getting-started.md: it consumes orders from
// RabbitMQ, records each payment exactly once in PostgreSQL, and publishes an event through the outbox.
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/exactlyonce/watermill-exactlyonce/console"
	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/metrics"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func env(name, def string) string { return cmp.Or(os.Getenv(name), def) }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context) error {
	amqpURL := env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	orders, events, poison := env("ORDERS_QUEUE", "orders"), env("EVENTS_QUEUE", "payments.events"), env("POISON_QUEUE", "payments.poison")
	logger := watermill.NewSlogLogger(nil)

	pool, err := pgxpool.New(ctx, env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	// The database and the library's tables, stated once and passed everywhere.
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: env("DB_SCHEMA", "payments")}
	if err := sqlschema.Migrate(ctx, db); err != nil { // the inbox and outbox tables
		return err
	}
	payments := pgx.Identifier{db.Schema, "payments"}.Sanitize() // our own table
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+payments+` (
		order_id text PRIMARY KEY, amount_cents bigint NOT NULL, paid_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return err
	}

	// 256 deliveries in flight on one subscription (group commit puts those that wait together
	// in one transaction, up to 64, two batches at a time), acknowledged together once committed.
	// The router closes it. The UUID of a message from a producer that is not Watermill is its message_id.
	sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: amqpURL, Prefetch: 256, Logger: logger})
	if err != nil {
		return err
	}
	// Publisher confirms, a window of them: the relay deletes a row, and the poison queue acks a
	// delivery, once RabbitMQ confirmed the message. It declares each queue before its first message.
	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: amqpURL})
	if err != nil {
		return err
	}
	defer pub.Close()
	// The relay publishes the outbox's rows through pub, and deletes each once RabbitMQ confirmed it.
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: pub})
	if err != nil {
		return err
	}

	// The middleware's events (OnEvent below), the relay's counters and the outbox backlog (one
	// query per scrape), on a registry of this run (or prometheus.DefaultRegisterer: promhttp.Handler()).
	reg := prometheus.NewRegistry()
	m, err := metrics.New(metrics.Config{Registerer: reg, Outbox: db, Relays: []*outbox.Relay{relay}})
	if err != nil {
		return err
	}
	// Group commit: the deliveries in flight share one transaction (one claim statement, one COMMIT).
	guard, err := exactlyonce.New(exactlyonce.Config{DB: db, Batch: &exactlyonce.BatchConfig{}, OnEvent: m.OnEvent})
	if err != nil {
		return err
	}
	// RouterLogger: the router does not log again, per redelivery, what the middleware reported
	// (an outage is a few lines: when it started, while it goes on, when it ended).
	router, err := message.NewRouter(message.RouterConfig{}, exactlyonce.RouterLogger(logger))
	if err != nil {
		return err
	}
	// Messages no redelivery can fix (no message_id) go to the poison queue. No Recoverer
	// middleware: the exactly-once middleware recovers a handler's panic (rolled back, nacked).
	poisonQueue, err := middleware.PoisonQueueWithFilter(pub, poison, exactlyonce.IsPermanent)
	if err != nil {
		return err
	}
	router.AddMiddleware(poisonQueue, guard.Middleware)
	// The returned event goes to the outbox in the batch's transaction, bound for events.
	router.AddHandler("payments", orders, sub, events, exactlyonce.OutboxOnly(), func(msg *message.Message) ([]*message.Message, error) {
		var order struct {
			OrderID     string `json:"order_id"`
			AmountCents int64  `json:"amount_cents"`
		}
		if err := json.Unmarshal(msg.Payload, &order); err != nil {
			return nil, exactlyonce.Permanent(err) // can never succeed: parked for an operator, acked
		}
		// Deferred in the batch's transaction, sent with the batch's other writes in one round trip before
		// its COMMIT; if it fails, only this message is nacked and redelivered. (For reads, take the
		// transaction itself: exactlyonce.PgxTxFromContext.)
		if err := exactlyonce.Exec(msg.Context(), `INSERT INTO `+payments+` (order_id, amount_cents) VALUES ($1, $2)`,
			order.OrderID, order.AmountCents); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), msg.Payload)}, nil
	})

	// One HTTP server: /metrics for Prometheus, and the console under /exactlyonce/, behind a
	// bearer token (at least 16 bytes: CONSOLE_TOKEN=$(openssl rand -hex 32)).
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	if err := console.Mount(mux, console.Config{DB: db, Auth: console.BearerToken(os.Getenv("CONSOLE_TOKEN")), Prefix: "/exactlyonce"}); err != nil {
		return err
	}
	srv := &http.Server{Addr: env("HTTP_ADDR", "127.0.0.1:8080"), Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	// The relay, the router and the server run until SIGINT/SIGTERM, or until one of them stops.
	return relay.RunWith(ctx, router.Run, func(ctx context.Context) error { return console.ListenAndServe(ctx, srv) })
}
