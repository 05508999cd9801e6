// Command orderedworker is a process of the chaos suite's per-key order run
// (TestChaosOrdered): an outbox relay or a consumer, configured by the
// environment, running until SIGTERM (or SIGKILL, which is the point).
//
//	ORD_ROLE        relay or consumer
//	ORD_DB_URL      PostgreSQL, or with ORD_DRIVER=mysql a mysql:// URL
//	ORD_DRIVER      pgxpool (the default) or mysql (MariaDB: go-sql-driver/mysql,
//	                the MySQL dialect)
//	ORD_AMQP_URL    RabbitMQ (through the harness's proxy)
//	ORD_AMQP_URLS   the cluster's other nodes, comma-separated (cluster runs)
//	ORD_QUEUES      quorum: the queues are quorum queues, and the consumer
//	                is rabbitmq.Subscriber (cluster runs); otherwise
//	                classic, the consumer watermill-amqp's subscriber
//	ORD_SCHEMA      the run's schema (inbox and outbox tables)
//	ORD_TOPIC       the topic
//	ORD_PARTITIONS  partition queues of the topic; 0: the unordered setup
//	                (one queue, competing subscriptions)
//	ORD_MODE        consumer: transactional, batch (group commit) or lease
//	ORD_WORKERS     relay: RelayConfig.Workers
//	ORD_EFFECTS     consumer: the effects table (key, seq, uuid, worker)
//	ORD_NAME        the process's name, recorded with its effects
package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/go-sql-driver/mysql" // database/sql driver "mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/mysqldsn"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Consumer is the consumer's name in the inbox.
const Consumer = "ordered-consumer"

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "orderedworker:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	partitions, _ := strconv.Atoi(os.Getenv("ORD_PARTITIONS"))
	db := sqlschema.DB{Schema: os.Getenv("ORD_SCHEMA")}
	switch driver := os.Getenv("ORD_DRIVER"); driver {
	case "", "pgxpool":
		pc, err := pgxpool.ParseConfig(os.Getenv("ORD_DB_URL"))
		if err != nil {
			return err
		}
		pc.MaxConns = 24
		pool, err := pgxpool.NewWithConfig(context.Background(), pc)
		if err != nil {
			return err
		}
		defer pool.Close()
		db.Conn = wsql.BeginnerFromPgx(pool)
	case "mysql":
		dsn, err := mysqldsn.FromURL(os.Getenv("ORD_DB_URL"))
		if err != nil {
			return err
		}
		std, err := sql.Open("mysql", dsn)
		if err != nil {
			return err
		}
		std.SetMaxOpenConns(24)
		defer func() { _ = std.Close() }()
		db.Conn, db.Dialect = wsql.BeginnerFromStdSQL(std), sqlschema.MySQL
	default:
		return fmt.Errorf("ORD_DRIVER: want pgxpool or mysql, got %q", driver)
	}
	logger := watermill.NewSlogLogger(nil)
	topic := os.Getenv("ORD_TOPIC")
	amqpURL := os.Getenv("ORD_AMQP_URL")
	var urls []string
	if v := os.Getenv("ORD_AMQP_URLS"); v != "" {
		urls = strings.Split(v, ",")
	}
	var queues rabbitmq.Queues
	switch q := os.Getenv("ORD_QUEUES"); q {
	case "", "classic":
	case "quorum":
		queues.Type = rabbitmq.Quorum
	default:
		return fmt.Errorf("ORD_QUEUES: want classic or quorum, got %q", q)
	}
	switch os.Getenv("ORD_ROLE") {
	case "relay":
		workers, _ := strconv.Atoi(os.Getenv("ORD_WORKERS"))
		cfg := rabbitmq.PublisherConfig{URL: amqpURL, URLs: urls, Queues: queues}
		if partitions > 0 {
			cfg.Partitions = map[string]int{topic: partitions}
		}
		pub, err := rabbitmq.NewPublisher(cfg)
		if err != nil {
			return err
		}
		defer func() { _ = pub.Close() }()
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: pub, Workers: workers, MaxAttempts: 1,
			ErrorBackoff: 50 * time.Millisecond, MaxErrorBackoff: 500 * time.Millisecond, Logger: logger})
		if err != nil {
			return err
		}
		return relay.Run(ctx)
	case "consumer":
		if queues.Type == rabbitmq.Quorum {
			return consumeOwn(ctx, db, logger, rabbitmq.SubscriberConfig{URL: amqpURL, URLs: urls, Queues: queues,
				Logger: logger, ReconnectDelay: time.Second}, topic, partitions)
		}
		return consume(ctx, db, logger, amqpURL, topic, partitions)
	}
	return errors.New("ORD_ROLE: want relay or consumer")
}

// middleware is the consumer's exactly-once middleware in ORD_MODE, and
// its handler, which records each message's effect.
func middleware(db sqlschema.DB, logger watermill.LoggerAdapter) (*exactlyonce.Guard, message.NoPublishHandlerFunc, error) {
	mode := os.Getenv("ORD_MODE")
	effects, name := os.Getenv("ORD_EFFECTS"), os.Getenv("ORD_NAME")
	cfg := exactlyonce.Config{DB: db, Consumer: Consumer, NackDelay: 100 * time.Millisecond, Logger: logger}
	switch mode {
	case "lease":
		cfg.Lease = &exactlyonce.LeaseConfig{Duration: 2 * time.Second}
	case "batch":
		cfg.Batch = &exactlyonce.BatchConfig{}
	case "transactional":
	default:
		return nil, nil, fmt.Errorf("ORD_MODE: want transactional, batch or lease, got %q", mode)
	}
	eo, err := exactlyonce.New(cfg)
	if err != nil {
		return nil, nil, err
	}
	write := testenv.Exec
	if mode == "batch" {
		write = exactlyonce.Exec // sent with the batch's other writes
	}
	insert := `INSERT INTO ` + effects + ` (key, seq, uuid, worker) VALUES ($1, $2, $3, $4)`
	if db.Dialect == sqlschema.MySQL {
		insert = "INSERT INTO " + effects + " (`key`, seq, uuid, worker) VALUES (?, ?, ?, ?)"
	}
	return eo, func(msg *message.Message) error {
		seq, err := strconv.Atoi(msg.Metadata.Get("seq"))
		if err != nil {
			return fmt.Errorf("message %s: no seq: %w", msg.UUID, err)
		}
		return write(context.WithoutCancel(msg.Context()), insert, msg.Metadata.Get("key"), seq, msg.UUID, name)
	}, nil
}

// consumeOwn consumes the partitions with rabbitmq.Subscriber (cfg: the
// cluster's nodes, quorum queues): it reconnects on its own, through the
// next node that answers; the router runs again if it stops.
func consumeOwn(ctx context.Context, db sqlschema.DB, logger watermill.LoggerAdapter, cfg rabbitmq.SubscriberConfig, topic string, partitions int) error {
	eo, handle, err := middleware(db, logger)
	if err != nil {
		return err
	}
	for ctx.Err() == nil {
		sub, err := rabbitmq.NewSubscriber(cfg)
		if err != nil {
			return err
		}
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, exactlyonce.RouterLogger(logger))
		if err != nil {
			return err
		}
		router.AddMiddleware(eo.Middleware)
		router.AddConsumerHandler(Consumer, topic, rabbitmq.PartitionedSubscriber(sub, partitions), handle)
		err = router.Run(ctx)
		_ = sub.Close()
		if ctx.Err() != nil {
			return nil
		}
		// The first subscriptions failed (no node answered): run the
		// router again, as a supervisor would.
		logger.Error("router stopped, running it again", err, nil)
		time.Sleep(200 * time.Millisecond)
	}
	return nil
}

func consume(ctx context.Context, db sqlschema.DB, logger watermill.LoggerAdapter, amqpURL, topic string, partitions int) error {
	eo, handle, err := middleware(db, logger)
	if err != nil {
		return err
	}
	// The partitioned setup: one subscription per partition, one message at
	// a time each. The unordered one: one queue, 8 competing subscriptions
	// (exactlyonce.ConcurrentSubscriber), prefetch 8.
	amqpCfg := testenv.PartitionSubscriberConfig(amqpURL)
	if partitions == 0 {
		amqpCfg = wamqp.NewDurableQueueConfig(amqpURL)
		amqpCfg.Marshaler = rabbitmq.Marshaler{}
		amqpCfg.Consume.Qos.PrefetchCount = 8
	}
	amqpCfg.Connection.Reconnect = &wamqp.ReconnectConfig{
		BackoffInitialInterval: 100 * time.Millisecond, BackoffRandomizationFactor: 0.3,
		BackoffMultiplier: 1.5, BackoffMaxInterval: time.Second,
	}
	for ctx.Err() == nil {
		sub, err := wamqp.NewSubscriber(amqpCfg, logger)
		if err != nil {
			time.Sleep(200 * time.Millisecond) // the proxy refuses: wait for it
			continue
		}
		subscriber := exactlyonce.ConcurrentSubscriber(sub, 8)
		if partitions > 0 {
			subscriber = rabbitmq.PartitionedSubscriber(sub, partitions)
		}
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, exactlyonce.RouterLogger(logger))
		if err != nil {
			return err
		}
		router.AddMiddleware(eo.Middleware)
		router.AddConsumerHandler(Consumer, topic, subscriber, handle)
		err = router.Run(ctx)
		_ = sub.Close()
		if ctx.Err() != nil {
			return nil
		}
		// The subscriptions failed (the proxy cut the connection while
		// they were made): run the router again, as a supervisor would.
		logger.Error("router stopped, running it again", err, nil)
		time.Sleep(200 * time.Millisecond)
	}
	return nil
}
