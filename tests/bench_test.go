package tests

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The throughput benchmark of the core issue: a Watermill router consuming
// from RabbitMQ, whose handler does one business INSERT in its transaction,
// with and without the exactly-once middleware, at the same concurrency.
//
//	go test -run '^$' -bench 'BenchmarkRouterThroughput' -benchtime 5000x -count 3 ./tests/
//
// BenchmarkRouterThroughputRatio measures both variants side by side in
// alternating rounds and reports exactlyonce/baseline as the "ratio" metric
// (target >= 0.9).

// Knobs, for investigating where the time goes; both variants always run
// with the same values. The defaults are the reference configuration.
var (
	// benchHandlers is the number of router handlers (each with its own
	// AMQP subscriber, so its own channel) consuming the same queue:
	// watermill-amqp hands one delivery at a time to the router per
	// subscription, so concurrency comes from several handlers.
	benchHandlers = benchEnvInt("EXACTLYONCE_BENCH_HANDLERS", 4)
	// benchPrefetch is the AMQP prefetch of each subscriber.
	benchPrefetch = benchEnvInt("EXACTLYONCE_BENCH_PREFETCH", 64)
	// benchPoolSize is the pgxpool's MaxConns.
	benchPoolSize = benchEnvInt("EXACTLYONCE_BENCH_POOL", 20)
	// benchSyncCommit, when set, is the synchronous_commit of the pool's
	// sessions (e.g. "off"); empty keeps the server's setting.
	benchSyncCommit = os.Getenv("EXACTLYONCE_BENCH_SYNC_COMMIT")
)

func benchEnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

const (
	// benchConfirmWindow is how many publisher confirms the pre-fill keeps
	// outstanding.
	benchConfirmWindow = 512
	// benchConsumer is the inbox consumer name shared by the handlers: they
	// are replicas of one logical consumer, so a message redelivered to
	// another handler must still be a duplicate.
	benchConsumer = "bench"
	// benchTimeout bounds one round (pre-fill excluded).
	benchTimeout = 5 * time.Minute
)

type benchVariant string

const (
	benchBaseline    benchVariant = "baseline"
	benchExactlyOnce benchVariant = "exactlyonce"
)

// benchEnv is what rounds of both variants share: one pool, one schema with
// the inbox tables and a business table.
type benchEnv struct {
	pool     *pgxpool.Pool
	tables   sqlschema.DB
	business string // sanitized business table name
	inbox    string // sanitized inbox table name
	insert   string // the business INSERT
}

func benchSetup(b testing.TB) *benchEnv {
	b.Helper()
	tables := testenv.Schema(b).WithDefaults()
	pool := benchPool(b)
	env := &benchEnv{
		pool:     pool,
		tables:   tables,
		business: pgx.Identifier{tables.Schema, "bench_orders"}.Sanitize(),
		inbox:    tables.Inbox(),
	}
	env.insert = "INSERT INTO " + env.business + " (id, payload) VALUES ($1, $2)"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := pool.Exec(ctx, "CREATE TABLE "+env.business+" (id text PRIMARY KEY, payload bytea NOT NULL, created_at timestamptz NOT NULL DEFAULT now())")
	require.NoError(b, err)
	return env
}

// benchPool is a pgx pool sized by benchPoolSize, with benchSyncCommit.
func benchPool(b testing.TB) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(testenv.DatabaseURL())
	require.NoError(b, err)
	cfg.MaxConns = int32(benchPoolSize)
	if benchSyncCommit != "" {
		cfg.ConnConfig.RuntimeParams["synchronous_commit"] = benchSyncCommit
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(b, err, "PostgreSQL at "+testenv.DatabaseURL())
	b.Cleanup(pool.Close)
	require.NoError(b, pool.Ping(ctx), "PostgreSQL at "+testenv.DatabaseURL())
	return pool
}

// benchReset empties the business and inbox tables between rounds, so that
// every round starts from the same state.
func (e *benchEnv) benchReset(b testing.TB) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := e.pool.Exec(ctx, "TRUNCATE "+e.business+", "+e.inbox)
	require.NoError(b, err)
}

// benchPrefill publishes n persistent messages with Watermill's UUID header
// to queue (through the default exchange), keeping a window of publisher
// confirms outstanding, and checks that the queue holds all of them.
func benchPrefill(b testing.TB, queue string, n int) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(b, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(b, err)
	require.NoError(b, ch.Confirm(false))

	prefix := queue + "-"
	payload := []byte(`{"order":"bench","amount":4200,"currency":"EUR"}`)
	window := make(chan *amqp.DeferredConfirmation, benchConfirmWindow)
	await := func(dc *amqp.DeferredConfirmation) {
		acked, err := dc.WaitContext(ctx)
		require.NoError(b, err)
		require.True(b, acked, "RabbitMQ nacked a pre-fill message")
	}
	for i := range n {
		if len(window) == cap(window) {
			await(<-window)
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, amqp.Publishing{
			Headers:      amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: prefix + strconv.Itoa(i)},
			DeliveryMode: amqp.Persistent,
			Body:         payload,
		})
		require.NoError(b, err)
		window <- dc
	}
	for len(window) > 0 {
		await(<-window)
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(b, err)
	require.Equal(b, n, q.Messages, "pre-filled queue depth")
	require.NoError(b, ch.Close())
}

// benchHandler returns the handler of the variant: baseline opens its own
// transaction on the pool; exactlyonce runs inside the middleware's.
func (e *benchEnv) benchHandler(b testing.TB, v benchVariant) message.NoPublishHandlerFunc {
	b.Helper()
	switch v {
	case benchBaseline:
		return func(msg *message.Message) error {
			ctx := msg.Context()
			tx, err := e.pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if _, err := tx.Exec(ctx, e.insert, msg.UUID, msg.Payload); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
	case benchExactlyOnce:
		eo := newMiddleware(b, exactlyonce.Config{
			DB:       testenv.WithConn(e.tables, wsql.BeginnerFromPgx(e.pool)),
			Consumer: benchConsumer,
		})
		h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			tx, err := exactlyonce.PgxTxFromContext(ctx)
			if err != nil {
				return nil, err
			}
			_, err = tx.Exec(ctx, e.insert, msg.UUID, msg.Payload)
			return nil, err
		})
		return func(msg *message.Message) error {
			_, err := h(msg)
			return err
		}
	}
	b.Fatalf("unknown variant %q", v)
	return nil
}

// benchRound consumes n pre-filled messages with a fresh router running the
// variant's handler on benchHandlers handlers, and returns the time from
// starting the router to the last message committed. The caller's timer
// should cover only this call; pre-fill happens inside before the clock
// starts, and is excluded from the returned duration.
func (e *benchEnv) benchRound(b testing.TB, v benchVariant, n int, clock func(start bool)) time.Duration {
	b.Helper()
	e.benchReset(b)
	queue := testenv.Queue(b, "bench_")
	benchPrefill(b, queue, n)

	var processed, failed atomic.Int64
	done := make(chan struct{})
	inner := e.benchHandler(b, v)
	handler := func(msg *message.Message) error {
		if err := inner(msg); err != nil {
			failed.Add(1)
			return err
		}
		if processed.Add(1) == int64(n) {
			close(done)
		}
		return nil
	}

	router := newRouter(b)
	subs := make([]message.Subscriber, 0, benchHandlers)
	defer func() {
		for _, s := range subs {
			_ = s.Close()
		}
	}()
	for i := range benchHandlers {
		cfg := wamqp.NewDurableQueueConfig(testenv.AMQPURL())
		cfg.Consume.Qos.PrefetchCount = benchPrefetch
		sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
		require.NoError(b, err)
		subs = append(subs, sub)
		router.AddConsumerHandler(fmt.Sprintf("%s-%d", v, i), queue, sub, handler)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runErr := make(chan error, 1)

	clock(true)
	start := time.Now()
	go func() { runErr <- router.Run(ctx) }()
	var elapsed time.Duration
	select {
	case <-done:
		elapsed = time.Since(start)
		clock(false)
	case err := <-runErr:
		clock(false)
		b.Fatalf("router stopped early: %v", err)
	case <-time.After(benchTimeout):
		clock(false)
		b.Fatalf("%s: only %d of %d messages processed (%d handler errors) within %s", v, processed.Load(), n, failed.Load(), benchTimeout)
	}

	cancel()
	require.NoError(b, router.Close())
	select {
	case err := <-runErr:
		require.NoError(b, err)
	case <-time.After(time.Minute):
		b.Fatal("router did not stop within a minute")
	}

	// The run must have done what it claims: every message once, no errors.
	require.Zero(b, failed.Load(), "handler errors")
	vctx, vcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer vcancel()
	var rows, inboxRows int64
	require.NoError(b, e.pool.QueryRow(vctx, "SELECT count(*) FROM "+e.business).Scan(&rows))
	require.NoError(b, e.pool.QueryRow(vctx, "SELECT count(*) FROM "+e.inbox).Scan(&inboxRows))
	require.Equal(b, int64(n), rows, "business rows")
	if v == benchExactlyOnce {
		require.Equal(b, int64(n), inboxRows, "inbox rows")
	} else {
		require.Zero(b, inboxRows, "inbox rows")
	}
	return elapsed
}

// BenchmarkRouterThroughput measures each variant on its own: b.N messages
// pre-filled, then timed from router start until all are committed.
func BenchmarkRouterThroughput(b *testing.B) {
	for _, v := range []benchVariant{benchBaseline, benchExactlyOnce} {
		b.Run(string(v), func(b *testing.B) {
			env := benchSetup(b)
			b.StopTimer()
			b.ResetTimer()
			elapsed := env.benchRound(b, v, b.N, func(start bool) {
				if start {
					b.StartTimer()
				} else {
					b.StopTimer()
				}
			})
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msg/s")
		})
	}
}

// BenchmarkRouterThroughputRatio runs both variants in alternating rounds
// (baseline first in even rounds, exactlyonce first in odd ones, so that
// load from anything else on the machine hits both alike) of b.N messages
// each, and reports each variant's msg/s over all its rounds and
// ratio = exactlyonce msg/s / baseline msg/s. Run it with -benchtime Nx to
// fix the round size (e.g. 3000x); EXACTLYONCE_BENCH_ROUNDS sets the number
// of rounds (default 3). It also reports median-ratio, the median of the
// per-round ratios, which one disturbed round cannot move much. The timer covers the consumption of all rounds of
// both variants, so ns/op is not a per-message figure: read the metrics.
func BenchmarkRouterThroughputRatio(b *testing.B) {
	rounds := benchEnvInt("EXACTLYONCE_BENCH_ROUNDS", 3)
	env := benchSetup(b)
	clock := func(start bool) {
		if start {
			b.StartTimer()
		} else {
			b.StopTimer()
		}
	}
	b.StopTimer()
	b.ResetTimer()
	total := map[benchVariant]time.Duration{}
	perRound := map[benchVariant][]string{}
	var pairRatios []float64
	for r := range rounds {
		rate := map[benchVariant]float64{}
		order := []benchVariant{benchBaseline, benchExactlyOnce}
		if r%2 == 1 {
			order[0], order[1] = order[1], order[0]
		}
		for _, v := range order {
			d := env.benchRound(b, v, b.N, clock)
			total[v] += d
			rate[v] = float64(b.N) / d.Seconds()
			perRound[v] = append(perRound[v], fmt.Sprintf("%.0f", rate[v]))
		}
		pairRatios = append(pairRatios, rate[benchExactlyOnce]/rate[benchBaseline])
	}
	n := float64(rounds * b.N)
	base := n / total[benchBaseline].Seconds()
	eo := n / total[benchExactlyOnce].Seconds()
	b.ReportMetric(base, "baseline-msg/s")
	b.ReportMetric(eo, "exactlyonce-msg/s")
	b.ReportMetric(eo/base, "ratio")
	// The median of the per-round ratios resists a round that a passing
	// disturbance (an fsync stall, a checkpoint) slowed down.
	slices.Sort(pairRatios)
	b.ReportMetric(pairRatios[len(pairRatios)/2], "median-ratio")
	if b.N > 1 {
		b.Logf("handlers=%d prefetch=%d pool=%d synchronous_commit=%q, %d rounds of %d messages",
			benchHandlers, benchPrefetch, benchPoolSize, benchSyncCommit, rounds, b.N)
		for _, v := range []benchVariant{benchBaseline, benchExactlyOnce} {
			b.Logf("%-11s msg/s per round: %s", v, strings.Join(perRound[v], " "))
		}
	}
}
