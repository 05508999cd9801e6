package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The router section: one queue, pre-filled with the round's messages
// before the clock starts, drained by a fresh Watermill router per variant
// and round. Each mode runs over two subscribers: rabbitmq.Subscriber (one
// subscription, acks batched; prefetch cfg.prefetch, or cfg.batchPrefetch
// in the group commit modes, whose batches want a window several batches
// deep), and the subscriber of before, watermill-amqp's with
// ConcurrentSubscriber (cfg.inflight subscriptions of prefetch cfg.prefetch
// each, an ack per message); the same pool and the same business INSERT.
// The bare broker consumer (amqp091-go, prefetch cfg.batchPrefetch, an ack
// per message, no Watermill, no database) drains the same queue: the
// broker's own speed at the window group commit runs with.
//
// Each engine of -engines has its own environment (a schema, or on MariaDB
// a database, with the inbox and the business table, and a connection pool
// of cfg.pool): the modes run on every engine, in the same rounds, through
// the same handlers (the transaction from PgxTxFromContext on PostgreSQL,
// StdTxFromContext on MariaDB); the watermill-amqp variants on PostgreSQL
// only.

type routerVariant string

const (
	bareConsumer    routerVariant = "bare consumer"
	noMiddleware    routerVariant = "no middleware"
	perMessage      routerVariant = "per-message"
	groupCommit     routerVariant = "group commit"
	groupCommitExec routerVariant = "group commit + Queue" // printed as before exactlyonce.Queue became Exec, so that tables compare

	// wamqpSuffix marks a variant run over watermill-amqp's subscriber.
	wamqpSuffix = ", watermill-amqp"
)

var routerModes = []routerVariant{noMiddleware, perMessage, groupCommit, groupCommitExec}

func (v routerVariant) overWatermillAMQP() routerVariant { return v + wamqpSuffix }

// mode is v without its subscriber.
func (v routerVariant) mode() routerVariant {
	return routerVariant(strings.TrimSuffix(string(v), wamqpSuffix))
}

func (v routerVariant) watermillAMQP() bool { return strings.HasSuffix(string(v), wamqpSuffix) }

// consumerName is the inbox consumer of every middleware variant.
const consumerName = "bench"

// routerRun is a variant of the router section on one engine; the bare
// consumer has none (no database).
type routerRun struct {
	v routerVariant
	e engine
}

func (r routerRun) String() string {
	if r.v == bareConsumer {
		return string(r.v)
	}
	return string(r.v) + r.e.suffix()
}

// routerRuns are the runs of a round: the bare consumer; on PostgreSQL
// every mode over both subscribers; on MariaDB the modes over
// rabbitmq.Subscriber (the subscribers' comparison is the broker's, not
// the engine's).
func routerRuns(engines []engine) []routerRun {
	runs := []routerRun{{v: bareConsumer}}
	for _, e := range engines {
		for _, m := range routerModes {
			runs = append(runs, routerRun{m, e})
			if !e.mysql() {
				runs = append(runs, routerRun{m.overWatermillAMQP(), e})
			}
		}
	}
	return runs
}

// routerEnv is what the rounds of the router section share on one engine.
type routerEnv struct {
	engine   engine
	pool     *pgxpool.Pool // PostgreSQL's handlers' connections
	std      *sql.DB       // MariaDB's
	db       sqlschema.DB  // Conn is pool or std
	business string        // quoted business table
	insert   string        // the handler's INSERT
	queue    string
	trace    *stmtTrace // -stmts
}

func (e *routerEnv) close() {
	if e.pool != nil {
		e.pool.Close()
	}
	if e.std != nil {
		_ = e.std.Close()
	}
}

func (h *harness) routerSection(ctx context.Context) ([]*line, error) {
	cfg := h.cfg
	queue, err := h.newQueue("router")
	if err != nil {
		return nil, err
	}
	envs := map[engine]*routerEnv{}
	for _, e := range cfg.engines {
		db, err := h.newSchemaOn(ctx, e, "router")
		if err != nil {
			return nil, fmt.Errorf("%s: %w", e, err)
		}
		var trace *stmtTrace
		if cfg.stmts {
			trace = newStmtTrace()
		}
		env, err := h.newRouterEnvOn(ctx, e, db, trace)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", e, err)
		}
		defer env.close()
		env.queue = queue
		envs[e] = env
	}

	runs := routerRuns(cfg.engines)
	rates := map[routerRun][]float64{}
	for r := range cfg.rounds {
		var parts []string
		for i := range runs {
			run := runs[(i+r)%len(runs)] // each run in a new position each round
			var rate float64
			if run.v == bareConsumer {
				rate, err = h.bareRound(ctx, "router/bare consumer", []string{queue}, cfg.batchPrefetch, cfg.messages, r)
			} else {
				rate, err = h.routerRound(ctx, envs[run.e], run.v, r)
			}
			if err != nil {
				return nil, fmt.Errorf("round %d, %s: %w", r+1, run, err)
			}
			rates[run] = append(rates[run], rate)
			parts = append(parts, fmt.Sprintf("%s %s", run, thousands(int64(rate))))
		}
		logf("router round %d/%d (msg/s): %s", r+1, cfg.rounds, strings.Join(parts, ", "))
	}
	return routerLines(cfg, rates), nil
}

// routerLines are the section's lines: each comparison of modes on every
// engine (PostgreSQL's line, then MariaDB's), the subscribers on
// PostgreSQL, and with both engines each mode on MariaDB against
// PostgreSQL.
func routerLines(cfg *config, rates map[routerRun][]float64) []*line {
	where := fmt.Sprintf("router, %d in flight", cfg.inflight)
	deep := fmt.Sprintf("router, prefetch %d", cfg.batchPrefetch)
	gc := where + " / group commit prefetch " + strconv.Itoa(cfg.batchPrefetch)
	bare := rates[routerRun{v: bareConsumer}]
	perEngine := []func(e engine) *line{
		func(e engine) *line {
			return &line{name: deep + e.suffix(), aName: "group commit + Queue", bName: "bare amqp091 consumer, ack each", a: rates[routerRun{groupCommitExec, e}], b: bare, unit: "msg/s",
				target: "A/B ≥ 0.7", check: func(_, _, r float64) bool { return r >= 0.7 }}
		},
		func(e engine) *line {
			return &line{name: where + e.suffix(), aName: "per-message", bName: "no middleware", a: rates[routerRun{perMessage, e}], b: rates[routerRun{noMiddleware, e}], unit: "msg/s",
				target: "A/B ≥ 0.9", check: func(_, _, r float64) bool { return r >= 0.9 }}
		},
		func(e engine) *line {
			return &line{name: gc + e.suffix(), aName: "group commit", bName: "per-message", a: rates[routerRun{groupCommit, e}], b: rates[routerRun{perMessage, e}], unit: "msg/s",
				target: "A/B ≥ 2", check: func(_, _, r float64) bool { return r >= 2 }}
		},
		func(e engine) *line {
			return &line{name: gc + e.suffix(), aName: "group commit + Queue", bName: "per-message", a: rates[routerRun{groupCommitExec, e}], b: rates[routerRun{perMessage, e}], unit: "msg/s",
				target: "A ≥ 10,000 msg/s, A/B ≥ 3", check: func(a, _, r float64) bool { return a >= 10_000 && r >= 3 }}
		},
	}
	var lines []*line
	for _, f := range perEngine {
		for _, e := range cfg.engines {
			lines = append(lines, f(e))
		}
	}
	prefetch := func(m routerVariant) int {
		if m == groupCommit || m == groupCommitExec {
			return cfg.batchPrefetch
		}
		return cfg.prefetch
	}
	if cfg.hasEngine(postgres) {
		for _, m := range routerModes {
			lines = append(lines, &line{name: "router, " + string(m) + postgres.suffix(), aName: fmt.Sprintf("rabbitmq.Subscriber, prefetch %d", prefetch(m)), bName: fmt.Sprintf("watermill-amqp, %d x prefetch %d (before)", cfg.inflight, cfg.prefetch),
				a: rates[routerRun{m, postgres}], b: rates[routerRun{m.overWatermillAMQP(), postgres}], unit: "msg/s", target: "—"})
		}
	}
	if cfg.hasEngine(postgres) && cfg.hasEngine(mariadb) {
		for _, m := range routerModes {
			lines = append(lines, &line{name: fmt.Sprintf("router, %s, rabbitmq.Subscriber prefetch %d: engine", m, prefetch(m)), aName: string(mariadb), bName: string(postgres),
				a: rates[routerRun{m, mariadb}], b: rates[routerRun{m, postgres}], unit: "msg/s", target: "—"})
		}
	}
	return lines
}

// newRouterEnv is PostgreSQL's router environment (the ordered and rss
// sections', and the rss child's) on db's schema: a pool of cfg.pool
// connections and the business table.
func newRouterEnv(ctx context.Context, cfg *config, db sqlschema.DB) (*routerEnv, error) {
	pool, err := newPool(ctx, cfg.dbURL, cfg.pool, "")
	if err != nil {
		return nil, err
	}
	return finishRouterEnv(ctx, &routerEnv{engine: postgres, pool: pool}, db)
}

// newRouterEnvOn is newRouterEnv on engine e (MariaDB: a database/sql
// handle of cfg.pool connections), traced when trace is not nil.
func (h *harness) newRouterEnvOn(ctx context.Context, e engine, db sqlschema.DB, trace *stmtTrace) (*routerEnv, error) {
	c, err := h.openConn(ctx, e, h.cfg.pool, trace)
	if err != nil {
		return nil, err
	}
	return finishRouterEnv(ctx, &routerEnv{engine: e, pool: c.pg, std: c.std, trace: trace}, db)
}

func finishRouterEnv(ctx context.Context, env *routerEnv, db sqlschema.DB) (*routerEnv, error) {
	if env.std != nil {
		db.Conn = wsql.BeginnerFromStdSQL(env.std)
	} else {
		db.Conn = wsql.BeginnerFromPgx(env.pool)
	}
	env.db = db
	env.business = db.Dialect.QuoteIdentifier(db.Schema, "bench_orders")
	env.insert = mustSQL(env.engine, "BusinessInsert", sqlData{Business: env.business})
	c := dbConn{engine: env.engine, pg: env.pool, std: env.std}
	if err := c.exec(ctx, mustSQL(env.engine, "CreateBusiness", sqlData{Business: env.business})); err != nil {
		env.close()
		return nil, err
	}
	return env, nil
}

// handler returns the variant's handler, to be wrapped by nothing else: the
// middleware variants include the middleware.
func (e *routerEnv) handler(v routerVariant) (message.HandlerFunc, error) {
	v = v.mode()
	if v == noMiddleware && e.std != nil {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx, err := e.std.BeginTx(ctx, nil)
			if err != nil {
				return nil, err
			}
			defer func() { _ = tx.Rollback() }()
			if _, err := tx.ExecContext(ctx, e.insert, msg.UUID, []byte(msg.Payload)); err != nil {
				return nil, err
			}
			return nil, tx.Commit()
		}, nil
	}
	if v == noMiddleware {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx, err := e.pool.Begin(ctx)
			if err != nil {
				return nil, err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if _, err := tx.Exec(ctx, e.insert, msg.UUID, []byte(msg.Payload)); err != nil {
				return nil, err
			}
			return nil, tx.Commit(ctx)
		}, nil
	}
	mc := exactlyonce.Config{DB: e.db, Consumer: consumerName, Logger: watermill.NopLogger{}}
	if v == groupCommit || v == groupCommitExec {
		mc.Batch = &exactlyonce.BatchConfig{}
	}
	eo, err := exactlyonce.New(mc)
	if err != nil {
		return nil, err
	}
	queued := v == groupCommitExec
	std := e.std != nil
	return eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if queued {
			return nil, exactlyonce.Exec(ctx, e.insert, msg.UUID, []byte(msg.Payload))
		}
		if std {
			tx, err := exactlyonce.StdTxFromContext(ctx)
			if err != nil {
				return nil, err
			}
			_, err = tx.ExecContext(ctx, e.insert, msg.UUID, []byte(msg.Payload))
			return nil, err
		}
		tx, err := exactlyonce.PgxTxFromContext(ctx)
		if err != nil {
			return nil, err
		}
		_, err = tx.Exec(ctx, e.insert, msg.UUID, []byte(msg.Payload))
		return nil, err
	}), nil
}

// drain is a router consuming one queue with one handler, counting the
// deliveries that returned without error, and timing from the first
// delivery's arrival in the handler to the n-th success.
type drain struct {
	n       int64
	ok, bad atomic.Int64
	first   sync.Once
	start   time.Time
	end     time.Time
	done    chan struct{}
	lastErr atomic.Value
}

func newDrain(n int) *drain { return &drain{n: int64(n), done: make(chan struct{})} }

func (d *drain) wrap(h message.HandlerFunc) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		d.first.Do(func() { d.start = time.Now() })
		if _, err := h(msg); err != nil {
			d.bad.Add(1)
			d.lastErr.Store(err.Error())
			return err
		}
		if d.ok.Add(1) == d.n {
			d.end = time.Now()
			close(d.done)
		}
		return nil
	}
}

// runRouter registers handler on a fresh router consuming queue through
// ConcurrentSubscriber(inflight) over one watermill-amqp subscriber, runs it
// until d is done (or timeout), and stops it.
func runRouter(ctx context.Context, amqpURL, queue string, inflight, prefetch int, d *drain, h message.HandlerFunc, timeout time.Duration) error {
	sc := wamqp.NewDurableQueueConfig(amqpURL)
	sc.Consume.Qos.PrefetchCount = prefetch
	sub, err := wamqp.NewSubscriber(sc, watermill.NopLogger{})
	if err != nil {
		return err
	}
	return runRouterOn(ctx, exactlyonce.ConcurrentSubscriber(sub, inflight), queue, d, h, timeout)
}

// runRouterOwn is runRouter over rabbitmq.Subscriber: one subscription
// with prefetch deliveries in flight.
func runRouterOwn(ctx context.Context, amqpURL, queue string, prefetch int, d *drain, h message.HandlerFunc, timeout time.Duration) error {
	sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: amqpURL, Prefetch: prefetch, Logger: watermill.NopLogger{}})
	if err != nil {
		return err
	}
	return runRouterOn(ctx, sub, queue, d, h, timeout)
}

// runRouterOn registers handler on a fresh router consuming queue through
// s, runs it until d is done (or timeout), stops it and closes s.
func runRouterOn(ctx context.Context, s message.Subscriber, queue string, d *drain, h message.HandlerFunc, timeout time.Duration) error {
	defer func() { _ = s.Close() }()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router.AddConsumerHandler(consumerName, queue, s, d.wrap(h))
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(rctx) }()
	var err2 error
	select {
	case <-d.done:
	case err := <-runErr:
		return fmt.Errorf("router stopped early: %w", err)
	case <-time.After(timeout):
		err2 = fmt.Errorf("only %d of %d messages processed (%d handler errors, last %v) within %s", d.ok.Load(), d.n, d.bad.Load(), d.lastErr.Load(), timeout)
	case <-ctx.Done():
		err2 = ctx.Err()
	}
	cancel()
	if err := router.Close(); err != nil && err2 == nil {
		err2 = err
	}
	select {
	case err := <-runErr:
		if err != nil && err2 == nil {
			err2 = err
		}
	case <-time.After(time.Minute):
		return errors.Join(err2, errors.New("router did not stop within a minute"))
	}
	return err2
}

// routerRound pre-fills the queue with n messages, then times their
// draining through variant v on e's engine, and checks the outcome: n
// business rows, and n inbox rows under the middleware.
func (h *harness) routerRound(ctx context.Context, e *routerEnv, v routerVariant, round int) (float64, error) {
	n := h.cfg.messages
	admin := h.adminConn(e.engine)
	for _, t := range []string{e.business, e.db.Inbox()} {
		if err := admin.exec(ctx, mustSQL(e.engine, "Truncate", sqlData{Table: t})); err != nil {
			return 0, err
		}
	}
	if err := h.purge(e.queue); err != nil {
		return 0, err
	}
	prefix := fmt.Sprintf("r%d-%s-", round, strings.ReplaceAll(string(v), " ", ""))
	if err := publishN(ctx, h.amqp, e.queue, prefix, 0, n); err != nil {
		return 0, fmt.Errorf("pre-fill: %w", err)
	}
	if depth, err := h.depth(e.queue); err != nil {
		return 0, err
	} else if depth != n {
		return 0, fmt.Errorf("pre-filled queue holds %d messages, want %d", depth, n)
	}
	handler, err := e.handler(v)
	if err != nil {
		return 0, err
	}
	run := routerRun{v, e.engine}
	d := newDrain(n)
	err = h.timedTraced("router/"+run.String(), e.trace, func() (int, time.Duration, error) {
		var err error
		if v.watermillAMQP() {
			err = runRouter(ctx, h.cfg.amqpURL, e.queue, h.cfg.inflight, h.cfg.prefetch, d, handler, 10*time.Minute)
		} else {
			prefetch := h.cfg.prefetch
			if m := v.mode(); m == groupCommit || m == groupCommitExec {
				prefetch = h.cfg.batchPrefetch // batches several deep, as group commit wants
			}
			err = runRouterOwn(ctx, h.cfg.amqpURL, e.queue, prefetch, d, handler, 10*time.Minute)
		}
		return n, d.end.Sub(d.start), err
	})
	if err != nil {
		return 0, err
	}
	if bad := d.bad.Load(); bad > 0 {
		logf("router %s: %d handler errors (redelivered), last: %v", run, bad, d.lastErr.Load())
	}
	rows, err := admin.count(ctx, mustSQL(e.engine, "Count", sqlData{Table: e.business}))
	if err != nil {
		return 0, err
	}
	inboxRows, err := admin.count(ctx, mustSQL(e.engine, "Count", sqlData{Table: e.db.Inbox()}))
	if err != nil {
		return 0, err
	}
	wantInbox := int64(n)
	if v.mode() == noMiddleware {
		wantInbox = 0
	}
	if rows != int64(n) || inboxRows != wantInbox {
		return 0, fmt.Errorf("%s: %d business rows and %d inbox rows, want %d and %d", run, rows, inboxRows, n, wantInbox)
	}
	return float64(n) / d.end.Sub(d.start).Seconds(), nil
}
