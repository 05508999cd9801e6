// Command worker is the system under test of the chaos suite (package
// tests/chaos). The harness builds it once and runs several copies of it as
// subprocesses, so that it can SIGKILL them at any moment:
//
//   - consumer: a Watermill router with CHAOS_HANDLERS handlers on the input
//     queue (watermill-amqp, prefetch CHAOS_PREFETCH), protected by the
//     exactly-once middleware in transactional or lease mode under one
//     consumer name shared by every consumer process. Its handler inserts an
//     effect row (in lease mode after calling the harness's fake SMS provider
//     with the attempt's idempotency key) and returns one output message.
//     Mode batch is transactional mode with group commit (Config.Batch with
//     its defaults): one handler on exactlyonce.ConcurrentSubscriber with
//     4 x CHAOS_HANDLERS deliveries in flight, whose effect row is written
//     with exactlyonce.Exec (pipelined with pgx). With
//     CHAOS_SUBSCRIBER=rabbitmq (either mode) the consumer has one handler
//     on rabbitmq.Subscriber with a prefetch of 4 x CHAOS_HANDLERS.
//     CHAOS_SUBSCRIBER=cluster is the same on a three-node cluster: the
//     nodes CHAOS_AMQP_URL then CHAOS_AMQP_URLS (comma-separated), every
//     queue a quorum queue; the relay and the downstream consumer use the
//     package's Publisher and Subscriber there too.
//   - relay: outbox.Relay from the outbox to the output queue, with publisher
//     confirms. A "poison" key's handler also returns one message the broker
//     refuses, fanned out to the output queue and a second queue (two outbox
//     rows): the relay must quarantine both and keep the rest flowing.
//   - downstream: a router on the output queue with the transactional
//     middleware under its own consumer name, inserting one downstream effect
//     row per output message it processes.
//
// With CHAOS_STORE=redis (the chaos run lease@redis) the consumers keep
// lease mode's records in Redis (redisstore, prefix CHAOS_REDIS_PREFIX,
// reached at CHAOS_REDIS_URL) and use no database: their handler only
// calls the provider, and no relay or downstream process runs.
//
// Every process reaches PostgreSQL and RabbitMQ through the harness's TCP
// proxies (CHAOS_DB_URL, CHAOS_AMQP_URL), so that the harness can cut them,
// and tags its PostgreSQL connections with an application_name (set in
// CHAOS_DB_URL) so that the harness can pg_terminate_backend them.
//
// With CHAOS_DRIVER=mysql (the chaos runs @mariadb and @mariadb-rc)
// CHAOS_DB_URL is a mysql:// URL (through the proxy too, naming the run's
// database, where the harness finds the connections to KILL), opened with
// go-sql-driver/mysql, and the tables are the MySQL dialect's
// (sqlschema.MySQL); the worker's own statements are MySQL's.
//
// Handler faults (panics, slow handlers) are planned by the harness from its
// seed: the handler asks the harness's event sink (CHAOS_SINK_URL) which
// fault, if any, to inject for this run of a key; the sink answers each
// planned fault once per key and counts it. The worker also reports every
// middleware event, every provider call it is about to make, and every
// batch the relay got confirmed. The sink lives in the harness process, which
// no fault touches, so these records survive the faults they describe.
//
// SIGTERM (or SIGINT) stops the worker gracefully: the router finishes the
// messages in flight, the relay its batch.
package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/mysqldsn"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Names shared with the harness (tests/chaos/harness_test.go keeps copies).
const (
	// ConsumerName is the inbox consumer of every consumer process.
	ConsumerName = "chaos-consumer"
	// DownstreamName is the inbox consumer of the downstream process.
	DownstreamName = "chaos-downstream"
	// KeyMetadata carries the input message's key on its output message.
	KeyMetadata = "chaos_key"
	// PoisonMetadata marks the outputs of a "poison" key that the broker
	// can never take: the relay's marshaler turns it into an AMQP
	// expiration RabbitMQ refuses ("never" is not a number of milliseconds),
	// and RabbitMQ closes the channel instead of confirming the message.
	PoisonMetadata = "chaos_poison"
)

// config is read from the environment (the harness sets it).
type config struct {
	Role    string // consumer | relay | downstream
	Mode    string // transactional | lease | batch (transactional with group commit)
	Name    string // this process, e.g. consumer-1 (for logs and effect rows)
	DBURL   string
	AMQPURL string
	Driver  string // pgxpool | database-sql | mysql
	Schema  string
	In, Out string
	OutB    string // outputs of odd keys go here, so that a relay batch holds several topics
	Out2    string // second destination of poison outputs
	// RelayMaxAttempts is the relay's MaxAttempts.
	RelayMaxAttempts int
	Handlers         int
	Prefetch         int
	SinkURL          string
	Provider         string        // lease mode: the fake provider's base URL
	Lease            time.Duration // lease mode: Config.Lease
	Slow             time.Duration // how long a "slow" fault sleeps
	Work             time.Duration // transactional mode: simulated work per message
	// Store is "postgres" (the default) or "redis" (lease mode's records
	// in Redis: RedisURL, RedisPrefix; no database).
	Store       string
	RedisURL    string
	RedisPrefix string
	// Subscriber is "watermill-amqp" (the default) or "rabbitmq": the
	// consumer's one handler on rabbitmq.Subscriber with 4 x Handlers
	// deliveries in flight; or "cluster": the same with the nodes
	// AMQPURL, AMQPURLs and quorum queues, for every role.
	Subscriber string
	// AMQPURLs are the cluster's other nodes (CHAOS_AMQP_URLS).
	AMQPURLs []string
}

// cluster reports whether the worker runs against the three-node cluster.
func (c config) cluster() bool { return c.Subscriber == "cluster" }

func env(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func readConfig() (config, error) {
	c := config{
		Role:     os.Getenv("CHAOS_ROLE"),
		Mode:     env("CHAOS_MODE", "transactional"),
		Name:     env("CHAOS_NAME", os.Getenv("CHAOS_ROLE")),
		DBURL:    os.Getenv("CHAOS_DB_URL"),
		AMQPURL:  os.Getenv("CHAOS_AMQP_URL"),
		Driver:   env("CHAOS_DRIVER", "pgxpool"),
		Schema:   os.Getenv("CHAOS_SCHEMA"),
		In:       os.Getenv("CHAOS_IN"),
		Out:      os.Getenv("CHAOS_OUT"),
		OutB:     os.Getenv("CHAOS_OUT_B"),
		Out2:     os.Getenv("CHAOS_OUT2"),
		SinkURL:  os.Getenv("CHAOS_SINK_URL"),
		Provider: os.Getenv("CHAOS_PROVIDER_URL"),
		Store:    env("CHAOS_STORE", "postgres"),
		RedisURL: os.Getenv("CHAOS_REDIS_URL"),

		RedisPrefix: os.Getenv("CHAOS_REDIS_PREFIX"),
		Subscriber:  env("CHAOS_SUBSCRIBER", "watermill-amqp"),
	}
	if v := os.Getenv("CHAOS_AMQP_URLS"); v != "" {
		c.AMQPURLs = strings.Split(v, ",")
	}
	var err error
	ints := map[string]*int{"CHAOS_HANDLERS": &c.Handlers, "CHAOS_PREFETCH": &c.Prefetch, "CHAOS_RELAY_MAX_ATTEMPTS": &c.RelayMaxAttempts}
	defs := map[string]string{"CHAOS_HANDLERS": "4", "CHAOS_PREFETCH": "10", "CHAOS_RELAY_MAX_ATTEMPTS": "2"}
	for k, p := range ints {
		if *p, err = strconv.Atoi(env(k, defs[k])); err != nil || *p < 1 {
			return c, fmt.Errorf("%s: want a positive integer, got %q", k, os.Getenv(k))
		}
	}
	durs := map[string]*time.Duration{"CHAOS_LEASE": &c.Lease, "CHAOS_SLOW": &c.Slow, "CHAOS_WORK": &c.Work}
	ddefs := map[string]string{"CHAOS_LEASE": "2s", "CHAOS_SLOW": "3s", "CHAOS_WORK": "5ms"}
	for k, p := range durs {
		if *p, err = time.ParseDuration(env(k, ddefs[k])); err != nil {
			return c, fmt.Errorf("%s: %w", k, err)
		}
	}
	required := map[string]string{"CHAOS_ROLE": c.Role, "CHAOS_DB_URL": c.DBURL, "CHAOS_AMQP_URL": c.AMQPURL,
		"CHAOS_SCHEMA": c.Schema, "CHAOS_SINK_URL": c.SinkURL}
	switch c.Store {
	case "postgres":
	case "redis":
		if c.Role != "consumer" || c.Mode != "lease" {
			return c, errors.New("CHAOS_STORE=redis: only lease-mode consumers")
		}
		required = map[string]string{"CHAOS_AMQP_URL": c.AMQPURL, "CHAOS_SINK_URL": c.SinkURL,
			"CHAOS_REDIS_URL": c.RedisURL, "CHAOS_REDIS_PREFIX": c.RedisPrefix}
	default:
		return c, fmt.Errorf("CHAOS_STORE: want postgres or redis, got %q", c.Store)
	}
	for k, v := range required {
		if v == "" {
			return c, fmt.Errorf("%s is required", k)
		}
	}
	if c.Mode != "transactional" && c.Mode != "lease" && c.Mode != "batch" {
		return c, fmt.Errorf("CHAOS_MODE: want transactional, lease or batch, got %q", c.Mode)
	}
	if c.Role == "consumer" && c.Mode == "lease" && c.Provider == "" {
		return c, errors.New("CHAOS_PROVIDER_URL is required in lease mode")
	}
	return c, nil
}

func main() {
	os.Exit(run())
}

// run is main with an exit code: 0 after a graceful stop, 1 when the role
// failed, 2 for a bad configuration.
func run() int {
	cfg, err := readConfig()
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos worker:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false).With(watermill.LogFields{"worker": cfg.Name})
	w := &worker{cfg: cfg, logger: logger}
	w.sink = &sink{base: cfg.SinkURL, name: cfg.Name, client: &http.Client{Timeout: 10 * time.Second}}
	w.http = &http.Client{Timeout: 10 * time.Second}
	w.dialect = sqlschema.Postgres
	if cfg.Driver == "mysql" {
		w.dialect = sqlschema.MySQL
	}
	w.effects = w.dialect.QuoteIdentifier(cfg.Schema, "effects")
	w.downEffects = w.dialect.QuoteIdentifier(cfg.Schema, "down_effects")

	if cfg.Store == "redis" {
		closeRedis, err := w.openRedis()
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos worker:", err)
			return 2
		}
		defer closeRedis()
	} else {
		closeDB, err := w.openDB()
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos worker:", err)
			return 2
		}
		defer closeDB()
		w.tables = sqlschema.DB{Conn: w.db, Schema: cfg.Schema, Dialect: w.dialect}
	}

	logger.Info("chaos worker starting", watermill.LogFields{"role": cfg.Role, "mode": cfg.Mode, "driver": cfg.Driver, "pid": os.Getpid()})
	switch cfg.Role {
	case "consumer":
		err = w.runConsumer(ctx)
	case "relay":
		err = w.runRelay(ctx)
	case "downstream":
		err = w.runDownstream(ctx)
	default:
		err = fmt.Errorf("CHAOS_ROLE: want consumer, relay or downstream, got %q", cfg.Role)
	}
	if err != nil {
		logger.Error("chaos worker failed", err, nil)
		return 1
	}
	logger.Info("chaos worker stopped", nil)
	return 0
}

type worker struct {
	cfg         config
	logger      watermill.LoggerAdapter
	tables      sqlschema.DB // its Conn is db
	db          wsql.Beginner
	sink        *sink
	http        *http.Client
	effects     string
	downEffects string
	dialect     sqlschema.Dialect
	redisStore  *redisstore.Store // CHAOS_STORE=redis

	// txMu guards txIDs: on MySQL, the worker's name of each transaction
	// that wrote an effect (see txID).
	txMu  sync.Mutex
	txIDs map[*sql.Tx]int
}

// openRedis makes the Redis store of CHAOS_STORE=redis, without
// connecting (the proxy may be refusing at this moment). Short timeouts:
// a cut connection is a failed command, not a hang.
func (w *worker) openRedis() (func(), error) {
	opts, err := redis.ParseURL(w.cfg.RedisURL)
	if err != nil {
		return nil, fmt.Errorf("CHAOS_REDIS_URL: %w", err)
	}
	opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout = time.Second, 2*time.Second, 2*time.Second
	opts.PoolSize = w.cfg.Handlers + 4
	client := redis.NewClient(opts)
	w.redisStore, err = redisstore.New(redisstore.Config{Client: client, Prefix: w.cfg.RedisPrefix})
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	return func() { _ = client.Close() }, nil
}

// openDB opens the driver's pool without connecting (the proxy may be
// refusing at this moment; every use retries).
func (w *worker) openDB() (func(), error) {
	maxConns := w.cfg.Handlers + 4
	switch w.cfg.Driver {
	case "pgxpool":
		pc, err := pgxpool.ParseConfig(w.cfg.DBURL)
		if err != nil {
			return nil, fmt.Errorf("CHAOS_DB_URL: %w", err)
		}
		pc.MaxConns = int32(maxConns)
		pc.ConnConfig.ConnectTimeout = 3 * time.Second
		pool, err := pgxpool.NewWithConfig(context.Background(), pc)
		if err != nil {
			return nil, err
		}
		w.db = wsql.BeginnerFromPgx(pool)
		return pool.Close, nil
	case "database-sql":
		cc, err := pgx.ParseConfig(w.cfg.DBURL)
		if err != nil {
			return nil, fmt.Errorf("CHAOS_DB_URL: %w", err)
		}
		cc.ConnectTimeout = 3 * time.Second
		db := stdlib.OpenDB(*cc)
		db.SetMaxOpenConns(maxConns)
		w.db = wsql.BeginnerFromStdSQL(db)
		return func() { _ = db.Close() }, nil
	case "mysql":
		dsn, err := mysqldsn.FromURL(w.cfg.DBURL)
		if err != nil {
			return nil, fmt.Errorf("CHAOS_DB_URL: %w", err)
		}
		mc, err := mysql.ParseDSN(dsn)
		if err != nil {
			return nil, fmt.Errorf("CHAOS_DB_URL: %w", err)
		}
		mc.Timeout = 3 * time.Second // dial
		conn, err := mysql.NewConnector(mc)
		if err != nil {
			return nil, err
		}
		db := sql.OpenDB(conn)
		db.SetMaxOpenConns(maxConns)
		w.db = wsql.BeginnerFromStdSQL(db)
		return func() { _ = db.Close() }, nil
	}
	return nil, fmt.Errorf("CHAOS_DRIVER: want pgxpool, database-sql or mysql, got %q", w.cfg.Driver)
}

// amqpConfig is a durable-queue config through the proxy that reconnects
// quickly (the default backoff grows to a minute).
func (w *worker) amqpConfig() wamqp.Config {
	c := wamqp.NewDurableQueueConfig(w.cfg.AMQPURL)
	c.Connection.Reconnect = &wamqp.ReconnectConfig{
		BackoffInitialInterval:     100 * time.Millisecond,
		BackoffRandomizationFactor: 0.3,
		BackoffMultiplier:          1.5,
		BackoffMaxInterval:         time.Second,
	}
	return c
}

// retry calls f until it succeeds, ctx ends or a minute passed: a worker
// restarted while the proxy refuses must wait for it, not die.
func retry[T any](ctx context.Context, what string, logger watermill.LoggerAdapter, f func() (T, error)) (T, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		v, err := f()
		if err == nil {
			return v, nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return v, fmt.Errorf("%s: %w", what, err)
		}
		logger.Info("chaos worker: retrying "+what, watermill.LogFields{"err": err.Error()})
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (w *worker) subscriber(ctx context.Context) (*wamqp.Subscriber, error) {
	c := w.amqpConfig()
	c.Consume.Qos.PrefetchCount = w.cfg.Prefetch
	return retry(ctx, "connecting the subscriber", w.logger, func() (*wamqp.Subscriber, error) {
		return wamqp.NewSubscriber(c, w.logger)
	})
}

// middleware returns the exactly-once middleware of role, in lease mode
// (with the configured lease) when lease is set, with group commit when
// batch is set.
func (w *worker) middleware(consumer, role string, lease, batch bool) (*exactlyonce.Guard, error) {
	cfg := exactlyonce.Config{
		DB:        w.tables,
		Consumer:  consumer,
		NackDelay: 250 * time.Millisecond,
		Logger:    w.logger,
		OnEvent: func(ev exactlyonce.Event) {
			w.sink.event(role, ev)
		},
	}
	if lease {
		cfg.Lease = &exactlyonce.LeaseConfig{Duration: w.cfg.Lease}
		if w.redisStore != nil {
			cfg.DB, cfg.Lease.Store = sqlschema.DB{}, w.redisStore
		}
	}
	if batch {
		cfg.Batch = &exactlyonce.BatchConfig{}
	}
	return exactlyonce.New(cfg)
}

func (w *worker) newRouter() (*message.Router, error) {
	return message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, w.logger)
}

// runRouter runs r until ctx ends, then closes it gracefully.
// errNotStarted: the router stopped before it ran its handlers (a
// subscription failed: the broker connection was cut while the handlers
// subscribed). A service would be restarted by its supervisor; the worker
// starts the router again itself (startConsumer).
var errNotStarted = errors.New("the router stopped before it was running")

func runRouter(ctx context.Context, r *message.Router) error {
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case err := <-done:
		if ctx.Err() == nil {
			select {
			case <-r.Running():
				return fmt.Errorf("router stopped: %w", err)
			default:
				return fmt.Errorf("%w: %w", errNotStarted, err)
			}
		}
		return err
	case <-ctx.Done():
	}
	if err := r.Close(); err != nil {
		return err
	}
	return <-done
}

func (w *worker) runConsumer(ctx context.Context) error {
	deadline := time.Now().Add(time.Minute)
	for {
		err := w.runConsumerOnce(ctx)
		if !errors.Is(err, errNotStarted) || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		w.logger.Error("consumer router did not start, starting it again", err, nil)
		time.Sleep(200 * time.Millisecond)
	}
}

func (w *worker) runConsumerOnce(ctx context.Context) error {
	eo, err := w.middleware(ConsumerName, "consumer", w.cfg.Mode == "lease", w.cfg.Mode == "batch")
	if err != nil {
		return err
	}
	r, err := w.newRouter()
	if err != nil {
		return err
	}
	r.AddMiddleware(eo.Middleware)
	if w.cfg.Subscriber == "rabbitmq" || w.cfg.cluster() {
		// One subscription with a prefetch window: the deliveries in flight
		// of one handler (group commit batches them), acks batched.
		own, err := w.ownSubscriber(4 * w.cfg.Handlers)
		if err != nil {
			return err
		}
		defer func() { _ = own.Close() }()
		r.AddHandler(ConsumerName+"-own", w.cfg.In, own, w.cfg.Out, exactlyonce.OutboxOnly(), w.handle)
		return runRouter(ctx, r)
	}
	sub, err := w.subscriber(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = sub.Close() }()
	if w.cfg.Mode == "batch" {
		// Group commit needs several deliveries of one handler in flight.
		r.AddHandler(ConsumerName+"-batch", w.cfg.In, exactlyonce.ConcurrentSubscriber(sub, 4*w.cfg.Handlers), w.cfg.Out,
			exactlyonce.OutboxOnly(), w.handle)
		return runRouter(ctx, r)
	}
	for i := range w.cfg.Handlers {
		name := fmt.Sprintf("%s-h%d", ConsumerName, i)
		if w.cfg.Store == "redis" {
			// The Redis store records no outputs: a handler with a publish
			// topic would be refused.
			r.AddConsumerHandler(name, w.cfg.In, sub, func(msg *message.Message) error {
				_, err := w.handle(msg)
				return err
			})
			continue
		}
		// The router's publisher: the middleware writes the handler's output
		// to the outbox and returns nothing to the router.
		r.AddHandler(name, w.cfg.In, sub, w.cfg.Out, exactlyonce.OutboxOnly(), w.handle)
	}
	return runRouter(ctx, r)
}

// ownSubscriber is a rabbitmq.Subscriber with prefetch: on the cluster's
// nodes and quorum queues in a cluster run.
func (w *worker) ownSubscriber(prefetch int) (*rabbitmq.Subscriber, error) {
	cfg := rabbitmq.SubscriberConfig{URL: w.cfg.AMQPURL, Prefetch: prefetch, Logger: w.logger, ReconnectDelay: time.Second}
	if w.cfg.cluster() {
		cfg.URLs, cfg.Queues = w.cfg.AMQPURLs, rabbitmq.Queues{Type: rabbitmq.Quorum}
	}
	return rabbitmq.NewSubscriber(cfg)
}

// handle is the consumer's handler.
func (w *worker) handle(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	info, err := exactlyonce.InfoFromContext(ctx)
	if err != nil {
		return nil, err
	}
	key := info.Key
	lease := w.cfg.Mode == "lease"
	if lease && info.Attempt < 1 {
		return nil, fmt.Errorf("chaos worker: lease mode without a lease attempt for %q", key)
	}

	// The harness planned the faults; it answers each once per key (poison
	// on every run).
	fault, err := w.sink.run(key, info.Attempt, info.Interrupted)
	if err != nil {
		return nil, err
	}
	switch fault {
	case "panic":
		panic("chaos: injected handler panic for " + key)
	case "slow":
		if err := sleep(ctx, w.cfg.Slow); err != nil {
			return nil, err
		}
		if lease {
			// Past its lease: a careful handler checks that it still owns
			// the key before the external call (another worker may have
			// taken it over, with the same idempotency key).
			if err := exactlyonce.ExtendLease(ctx, 0); err != nil {
				_, _ = w.sink.post("/event", url.Values{"role": {"handler"}, "kind": {"slow_lease_lost"}, "key": {key},
					"attempt": {strconv.Itoa(info.Attempt)}})
				return nil, err
			}
		}
	}

	if lease {
		if err := w.sink.call(key, info.Attempt, info.Interrupted); err != nil {
			return nil, err
		}
		if err := testenv.SendSMS(ctx, w.http, w.cfg.Provider, info.IdempotencyKey, "+46700000000", "chaos "+key); err != nil {
			return nil, err
		}
		if w.redisStore != nil {
			return nil, nil // the SMS is the only effect: Redis records it done
		}
		out, err := w.complete(ctx, key, info.Attempt, fault == "poison")
		if err != nil {
			// Reported before the middleware records the failure, so that
			// the harness can explain the next attempt's repeated call.
			_, _ = w.sink.post("/event", url.Values{"role": {"handler"}, "kind": {"failed_after_call"}, "key": {key},
				"attempt": {strconv.Itoa(info.Attempt)}})
			return nil, err
		}
		return out, nil
	}
	if err := sleep(ctx, w.cfg.Work); err != nil {
		return nil, err
	}
	return w.complete(ctx, key, info.Attempt, fault == "poison")
}

// complete inserts the effect row through the middleware's transaction and
// returns the output message; for a poison key also the poison message, once
// for each of the two output queues.
func (w *worker) complete(ctx context.Context, key string, attempt int, poison bool) ([]*message.Message, error) {
	out := message.NewMessage(watermill.NewUUID(), []byte(`{"effect":"`+key+`"}`))
	out.Metadata.Set(KeyMetadata, key)
	if w.cfg.OutB != "" && key[len(key)-1]%2 == 1 {
		// Odd keys to the other output queue: a relay batch then holds
		// several topics, so an outage can begin between two of its
		// Publish calls.
		exactlyonce.SetDestination(out, w.cfg.OutB)
	}
	outputs := []*message.Message{out}
	if poison {
		bad := message.NewMessage(watermill.NewUUID(), []byte(`{"poison":"`+key+`"}`))
		bad.Metadata.Set(KeyMetadata, key)
		bad.Metadata.Set(PoisonMetadata, "never")
		bad2 := bad.Copy()
		exactlyonce.SetDestination(bad2, w.cfg.Out2)
		outputs = append(outputs, bad, bad2)
	}
	// After the provider call the write must not fail because the router is
	// closing (it cancels the message's context): the effect happened.
	write := testenv.Exec
	if w.cfg.Mode == "batch" {
		write = exactlyonce.Exec // sent with the batch's other writes
	}
	var err error
	if w.dialect == sqlschema.MySQL {
		txid, terr := w.txID(ctx)
		if terr != nil {
			return nil, terr
		}
		err = write(context.WithoutCancel(ctx), "INSERT INTO "+w.effects+" (`key`, attempt, worker, out_uuid, txid) VALUES (?, ?, ?, ?, ?)",
			key, attempt, w.cfg.Name, out.UUID, txid)
	} else {
		err = write(context.WithoutCancel(ctx), `INSERT INTO `+w.effects+` (key, attempt, worker, out_uuid) VALUES ($1, $2, $3, $4)`,
			key, attempt, w.cfg.Name, out.UUID)
	}
	if err != nil {
		return nil, fmt.Errorf("chaos worker: inserting the effect of %q: %w", key, err)
	}
	return outputs, nil
}

// txID names the handler's transaction on MySQL, for the effects' txid
// column (PostgreSQL's is txid_current()): this process and a number per
// *sql.Tx, so that the harness counts the effects of each transaction (group
// commit puts several in one). MariaDB offers no transaction id a statement
// can read reliably (INFORMATION_SCHEMA.INNODB_TRX is a cache); the
// transaction object the middleware hands every handler of one database
// transaction is the same, and the map keeps it alive, so its number is
// never reused.
func (w *worker) txID(ctx context.Context) (string, error) {
	tx, err := exactlyonce.StdTxFromContext(ctx)
	if err != nil {
		return "", err
	}
	w.txMu.Lock()
	defer w.txMu.Unlock()
	if w.txIDs == nil {
		w.txIDs = map[*sql.Tx]int{}
	}
	n, ok := w.txIDs[tx]
	if !ok {
		n = len(w.txIDs) + 1
		w.txIDs[tx] = n
	}
	return fmt.Sprintf("%s/%d/%d", w.cfg.Name, os.Getpid(), n), nil
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func (w *worker) runDownstream(ctx context.Context) error {
	eo, err := w.middleware(DownstreamName, "downstream", false, false)
	if err != nil {
		return err
	}
	var sub message.Subscriber
	if w.cfg.cluster() {
		sub, err = w.ownSubscriber(w.cfg.Prefetch)
	} else {
		sub, err = w.subscriber(ctx)
	}
	if err != nil {
		return err
	}
	r, err := w.newRouter()
	if err != nil {
		return err
	}
	r.AddMiddleware(eo.Middleware)
	queues := []string{w.cfg.Out}
	if w.cfg.OutB != "" {
		queues = append(queues, w.cfg.OutB)
	}
	for i := range w.cfg.Handlers * len(queues) {
		queue := queues[i%len(queues)]
		insert := `INSERT INTO ` + w.downEffects + ` (key, uuid, worker) VALUES ($1, $2, $3)`
		if w.dialect == sqlschema.MySQL {
			insert = "INSERT INTO " + w.downEffects + " (`key`, uuid, worker) VALUES (?, ?, ?)"
		}
		r.AddConsumerHandler(fmt.Sprintf("%s-h%d", DownstreamName, i), queue, sub, func(msg *message.Message) error {
			return testenv.Exec(msg.Context(), insert, msg.Metadata.Get(KeyMetadata), msg.UUID, w.cfg.Name)
		})
	}
	return runRouter(ctx, r)
}

func (w *worker) runRelay(ctx context.Context) error {
	if w.cfg.Mode == "batch" || w.cfg.cluster() {
		return w.runWindowedRelay(ctx)
	}
	c := w.amqpConfig()
	c.Publish.ConfirmDelivery = true
	// A channel per Publish: watermill-amqp v3.1.0's channel pool loses a
	// slot each time a closed channel cannot be reopened (the broker down
	// at that moment), and with every slot lost Publish blocks forever,
	// holding the relay's batch (found by this suite; upstream PR
	// ThreeDotsLabs/watermill-amqp#37).
	c.Publish.ChannelPoolSize = 0
	c.Marshaler = wamqp.DefaultMarshaler{PostprocessPublishing: func(p amqp.Publishing) amqp.Publishing {
		if v, ok := p.Headers[PoisonMetadata].(string); ok {
			p.Expiration = v // RabbitMQ refuses it: PRECONDITION_FAILED, channel closed
		}
		return p
	}}
	pub, err := retry(ctx, "connecting the publisher", w.logger, func() (*wamqp.Publisher, error) {
		return wamqp.NewPublisher(c, w.logger)
	})
	if err != nil {
		return err
	}
	defer func() { _ = pub.Close() }()
	// watermill-amqp says "delivery not confirmed" for a nack, a lost
	// connection and a message the broker refused alike: nothing it
	// returns can be told to be the message's own. A user who knows what
	// the broker refuses checks it before publishing, and marks it.
	return w.relay(ctx, expirationCheck{countingPublisher{Publisher: pub, sink: w.sink}})
}

// expirationCheck refuses, before publishing, a message whose expiration
// RabbitMQ would refuse (not a number of milliseconds), marking the error
// as the message's own (exactlyonce.Permanent): what a user of a publisher
// that cannot tell causes apart does for the refusals they know.
type expirationCheck struct{ message.Publisher }

func (p expirationCheck) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if v := m.Metadata.Get(PoisonMetadata); v != "" {
			if _, err := strconv.ParseUint(v, 10, 32); err != nil {
				return exactlyonce.Permanent(fmt.Errorf("message %s: expiration %q is not a number of milliseconds: RabbitMQ refuses it", m.UUID, v))
			}
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}

// relay runs the outbox relay through pub, with the suite's settings: fast
// polls and backoffs, and MaxAttempts small so that a failure of a healthy
// row counted as permanent would show.
func (w *worker) relay(ctx context.Context, pub message.Publisher) error {
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB:              w.tables,
		Publisher:       pub,
		BatchSize:       50,
		PollInterval:    50 * time.Millisecond,
		ErrorBackoff:    50 * time.Millisecond,
		MaxErrorBackoff: 500 * time.Millisecond,
		MaxAttempts:     w.cfg.RelayMaxAttempts,
		Logger:          w.logger,
	})
	if err != nil {
		return err
	}
	return relay.Run(ctx)
}

// runWindowedRelay is the relay of the group-commit run: throughput
// settings end to end, so it publishes through rabbitmq.Publisher, with a
// window of outstanding confirms (outbox.BatchPublisher). The relay of a
// cluster run (either mode) too: on the cluster's nodes, to quorum queues.
func (w *worker) runWindowedRelay(ctx context.Context) error {
	cfg := rabbitmq.PublisherConfig{URL: w.cfg.AMQPURL, Window: 64, Marshaler: poisonMarshaler{}}
	if w.cfg.cluster() {
		cfg.URLs, cfg.Queues = w.cfg.AMQPURLs, rabbitmq.Queues{Type: rabbitmq.Quorum}
	}
	pub, err := rabbitmq.NewPublisher(cfg)
	if err != nil {
		return err
	}
	defer func() { _ = pub.Close() }()
	return w.relay(ctx, countingBatchPublisher{Publisher: pub, sink: w.sink})
}

// poisonMarshaler is rabbitmq.Marshaler with the poison outputs' refused
// expiration (see the watermill-amqp relay's PostprocessPublishing).
type poisonMarshaler struct{}

func (poisonMarshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	p, err := rabbitmq.Marshaler{}.Marshal(msg)
	if v, ok := p.Headers[PoisonMetadata].(string); ok && err == nil {
		p.Expiration = v // RabbitMQ refuses it: PRECONDITION_FAILED, channel closed
	}
	return p, err
}

// countingBatchPublisher reports every message the broker confirmed.
type countingBatchPublisher struct {
	*rabbitmq.Publisher
	sink *sink
}

func (p countingBatchPublisher) PublishBatch(ctx context.Context, batch []msgid.TopicMessage) []error {
	errs := p.Publisher.PublishBatch(ctx, batch)
	n := 0
	for _, err := range errs {
		if err == nil {
			n++
		}
	}
	if n > 0 {
		_, _ = p.sink.post("/relayed", url.Values{"n": {strconv.Itoa(n)}})
	}
	return errs
}

var _ outbox.BatchPublisher = countingBatchPublisher{}

// countingPublisher reports every Publish call the broker confirmed.
type countingPublisher struct {
	message.Publisher
	sink *sink
}

func (p countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	_, _ = p.sink.post("/relayed", url.Values{"n": {strconv.Itoa(len(msgs))}})
	return nil
}

// sink is the client of the harness's event sink.
type sink struct {
	base, name string
	client     *http.Client
}

// post sends a record and returns the answer's body. Errors are returned
// to callers that need the answer and otherwise only logged by the caller.
func (s *sink) post(path string, q url.Values) (string, error) {
	q.Set("worker", s.name)
	resp, err := s.client.Post(s.base+path+"?"+q.Encode(), "text/plain", nil)
	if err != nil {
		return "", err
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("event sink answered %s: %s", resp.Status, body)
	}
	return string(body), nil
}

// run records a handler run and returns the fault to inject ("" for none).
func (s *sink) run(key string, attempt int, interrupted bool) (string, error) {
	fault, err := s.post("/run", url.Values{"key": {key}, "attempt": {strconv.Itoa(attempt)}, "interrupted": {strconv.FormatBool(interrupted)}})
	if err != nil {
		return "", fmt.Errorf("chaos worker: asking the event sink: %w", err)
	}
	return fault, nil
}

// call records a provider call about to be made.
func (s *sink) call(key string, attempt int, interrupted bool) error {
	_, err := s.post("/call", url.Values{"key": {key}, "attempt": {strconv.Itoa(attempt)}, "interrupted": {strconv.FormatBool(interrupted)}})
	if err != nil {
		return fmt.Errorf("chaos worker: recording the provider call: %w", err)
	}
	return nil
}

// event records a middleware event, by its kind (testenv.EventKind: the
// outcome, and for a nack its cause).
func (s *sink) event(role string, ev exactlyonce.Event) {
	_, _ = s.post("/event", url.Values{"role": {role}, "kind": {testenv.EventKind(ev)}, "key": {ev.Key},
		"attempt": {strconv.Itoa(ev.Attempt)}, "interrupted": {strconv.FormatBool(ev.Interrupted)}})
}
