package main

import (
	"context"
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
	"github.com/jackc/pgx/v5"
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

// routerVariants are the modes over both subscribers, and the bare consumer.
var routerVariants = func() []routerVariant {
	out := []routerVariant{bareConsumer}
	for _, m := range routerModes {
		out = append(out, m, m.overWatermillAMQP())
	}
	return out
}()

func (v routerVariant) overWatermillAMQP() routerVariant { return v + wamqpSuffix }

// mode is v without its subscriber.
func (v routerVariant) mode() routerVariant {
	return routerVariant(strings.TrimSuffix(string(v), wamqpSuffix))
}

func (v routerVariant) watermillAMQP() bool { return strings.HasSuffix(string(v), wamqpSuffix) }

// consumerName is the inbox consumer of every middleware variant.
const consumerName = "bench"

// routerEnv is what the rounds of the router section share.
type routerEnv struct {
	pool     *pgxpool.Pool
	db       sqlschema.DB // Conn is pool
	business string       // quoted business table
	insert   string       // the handler's INSERT
	queue    string
}

func (h *harness) routerSection(ctx context.Context) ([]*line, error) {
	cfg := h.cfg
	db, err := h.newSchema(ctx, "router")
	if err != nil {
		return nil, err
	}
	env, err := newRouterEnv(ctx, cfg, db)
	if err != nil {
		return nil, err
	}
	defer env.pool.Close()
	if env.queue, err = h.newQueue("router"); err != nil {
		return nil, err
	}

	rates := map[routerVariant][]float64{}
	for r := range cfg.rounds {
		var parts []string
		for i := range routerVariants {
			v := routerVariants[(i+r)%len(routerVariants)] // each variant in a new position each round
			var rate float64
			if v == bareConsumer {
				rate, err = h.bareRound(ctx, "router/bare consumer", []string{env.queue}, cfg.batchPrefetch, cfg.messages, r)
			} else {
				rate, err = h.routerRound(ctx, env, v, r)
			}
			if err != nil {
				return nil, fmt.Errorf("round %d, %s: %w", r+1, v, err)
			}
			rates[v] = append(rates[v], rate)
			parts = append(parts, fmt.Sprintf("%s %s", v, thousands(int64(rate))))
		}
		logf("router round %d/%d (msg/s): %s", r+1, cfg.rounds, strings.Join(parts, ", "))
	}
	where := fmt.Sprintf("router, %d in flight", cfg.inflight)
	deep := fmt.Sprintf("router, prefetch %d", cfg.batchPrefetch)
	lines := []*line{
		{name: deep, aName: "group commit + Queue", bName: "bare amqp091 consumer, ack each", a: rates[groupCommitExec], b: rates[bareConsumer], unit: "msg/s",
			target: "A/B ≥ 0.7", check: func(_, _, r float64) bool { return r >= 0.7 }},
		{name: where, aName: "per-message", bName: "no middleware", a: rates[perMessage], b: rates[noMiddleware], unit: "msg/s",
			target: "A/B ≥ 0.9", check: func(_, _, r float64) bool { return r >= 0.9 }},
		{name: where + " / group commit prefetch " + strconv.Itoa(cfg.batchPrefetch), aName: "group commit", bName: "per-message", a: rates[groupCommit], b: rates[perMessage], unit: "msg/s",
			target: "A/B ≥ 2", check: func(_, _, r float64) bool { return r >= 2 }},
		{name: where + " / group commit prefetch " + strconv.Itoa(cfg.batchPrefetch), aName: "group commit + Queue", bName: "per-message", a: rates[groupCommitExec], b: rates[perMessage], unit: "msg/s",
			target: "A ≥ 10,000 msg/s, A/B ≥ 3", check: func(a, _, r float64) bool { return a >= 10_000 && r >= 3 }},
	}
	for _, m := range routerModes {
		pf := cfg.prefetch
		if m == groupCommit || m == groupCommitExec {
			pf = cfg.batchPrefetch
		}
		lines = append(lines, &line{name: "router, " + string(m), aName: fmt.Sprintf("rabbitmq.Subscriber, prefetch %d", pf), bName: fmt.Sprintf("watermill-amqp, %d x prefetch %d (before)", cfg.inflight, cfg.prefetch),
			a: rates[m], b: rates[m.overWatermillAMQP()], unit: "msg/s", target: "—"})
	}
	return lines, nil
}

func newRouterEnv(ctx context.Context, cfg *config, db sqlschema.DB) (*routerEnv, error) {
	pool, err := newPool(ctx, cfg.dbURL, cfg.pool, "")
	if err != nil {
		return nil, err
	}
	db.Conn = wsql.BeginnerFromPgx(pool)
	env := &routerEnv{pool: pool, db: db, business: pgx.Identifier{db.Schema, "bench_orders"}.Sanitize()}
	env.insert = "INSERT INTO " + env.business + " (id, payload) VALUES ($1, $2)"
	if _, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+env.business+" (id text PRIMARY KEY, payload bytea NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"); err != nil {
		pool.Close()
		return nil, err
	}
	return env, nil
}

// handler returns the variant's handler, to be wrapped by nothing else: the
// middleware variants include the middleware.
func (e *routerEnv) handler(v routerVariant) (message.HandlerFunc, error) {
	v = v.mode()
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
	return eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if queued {
			return nil, exactlyonce.Exec(ctx, e.insert, msg.UUID, []byte(msg.Payload))
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
// draining through variant v, and checks the outcome: n business rows, and
// n inbox rows under the middleware.
func (h *harness) routerRound(ctx context.Context, e *routerEnv, v routerVariant, round int) (float64, error) {
	n := h.cfg.messages
	if err := h.exec(ctx, "TRUNCATE "+e.business+", "+e.db.Inbox()); err != nil {
		return 0, err
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
	d := newDrain(n)
	err = h.timed("router/"+string(v), func() (int, time.Duration, error) {
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
		logf("router %s: %d handler errors (redelivered), last: %v", v, bad, d.lastErr.Load())
	}
	rows, err := h.count(ctx, "SELECT count(*) FROM "+e.business)
	if err != nil {
		return 0, err
	}
	inboxRows, err := h.count(ctx, "SELECT count(*) FROM "+e.db.Inbox())
	if err != nil {
		return 0, err
	}
	wantInbox := int64(n)
	if v.mode() == noMiddleware {
		wantInbox = 0
	}
	if rows != int64(n) || inboxRows != wantInbox {
		return 0, fmt.Errorf("%s: %d business rows and %d inbox rows, want %d and %d", v, rows, inboxRows, n, wantInbox)
	}
	return float64(n) / d.end.Sub(d.start).Seconds(), nil
}
