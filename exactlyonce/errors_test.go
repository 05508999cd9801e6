package exactlyonce_test

// The errors the middleware returns for a handler's failure or a
// misconfiguration, and what the router then does with the delivery (a
// Permanent error in transactional mode, a handler without a publish
// topic, forgotten migrations, OutboxOnly without the middleware, a
// panicking handler, IsPermanent with a poison queue, the context helpers),
// each through a Watermill router on a real RabbitMQ queue and real
// PostgreSQL. The rate tests count deliveries
// in a fixed window (fhWindow); everything else awaits events.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

const (
	// fhWindow is the window the rate tests count deliveries in.
	fhWindow = 3 * time.Second
	// fhNackDelay is the NackDelay of the rate tests that set one.
	fhNackDelay = 500 * time.Millisecond
	// fhWait bounds every wait for an event.
	fhWait = 30 * time.Second
)

// fhMaxDeliveries is the most deliveries a NackDelay-bounded failure may
// have in fhWindow: one per NackDelay, plus the ones at the window's edges.
const fhMaxDeliveries = int64(fhWindow/fhNackDelay) + 2

// fhRun observes one router: the deliveries it hands to the handler chain
// (counted by the outermost middleware, Outer), what that chain returned
// to the router (nil: the router acks), and the middleware's events.
type fhRun struct {
	deliveries atomic.Int64 // deliveries the router handed over
	runs       atomic.Int64 // runs of the handler itself (the test's handler counts them)
	counters   testenv.Counters

	mu       sync.Mutex
	returned []error
	events   []exactlyonce.Event
}

// Outer is the outermost router middleware: it counts deliveries and
// records what the chain returned.
func (r *fhRun) Outer(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		r.deliveries.Add(1)
		out, err := h(msg)
		r.mu.Lock()
		r.returned = append(r.returned, err)
		r.mu.Unlock()
		return out, err
	}
}

// Observe fits Config.OnEvent.
func (r *fhRun) Observe(e exactlyonce.Event) {
	r.counters.Observe(e)
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
}

// eventsSoFar returns the middleware's events so far.
func (r *fhRun) eventsSoFar() []exactlyonce.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]exactlyonce.Event(nil), r.events...)
}

// returnedErrs returns what the chain returned to the router so far.
func (r *fhRun) returnedErrs() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.returned...)
}

// event waits for the middleware's n-th event (1-based) and returns it.
func (r *fhRun) event(t *testing.T, n int) exactlyonce.Event {
	t.Helper()
	var e exactlyonce.Event
	testenv.Eventually(t, fhWait, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		if len(r.events) < n {
			return false
		}
		e = r.events[n-1]
		return true
	}, "event %d never came", n)
	return e
}

// returnedAt waits until the chain returned for the n-th delivery.
func (r *fhRun) returnedAt(t *testing.T, n int) error {
	t.Helper()
	var err error
	testenv.Eventually(t, fhWait, func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		if len(r.returned) < n {
			return false
		}
		err = r.returned[n-1]
		return true
	}, "delivery %d never returned", n)
	return err
}

// window waits for the first delivery, then counts the deliveries that
// follow it within fhWindow, and logs the rate.
func (r *fhRun) window(t *testing.T, what string) int64 {
	t.Helper()
	testenv.Eventually(t, fhWait, func() bool { return r.deliveries.Load() > 0 }, "no delivery")
	start := r.deliveries.Load()
	time.Sleep(fhWindow) // a fixed measurement window, not a synchronisation
	n := r.deliveries.Load() - start
	t.Logf("AFTER %s: %d deliveries in %s after the first = %.1f redeliveries/s", what, n, fhWindow, float64(n)/fhWindow.Seconds())
	return n
}

// fhRouter is a router that logs nothing (a failing delivery would log on
// every redelivery).
func fhRouter(t *testing.T) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	return r
}

// fhPublish publishes a Watermill message to queue.
func fhPublish(t *testing.T, queue string, msg *message.Message) {
	t.Helper()
	require.NoError(t, testenv.AMQPPublisher(t).Publish(queue, msg))
}

// fhQueueDepth waits until queue holds want ready messages (the broker
// requeues a closed consumer's unacked ones asynchronously).
func fhQueueDepth(t *testing.T, queue string, want int) {
	t.Helper()
	conn := testenv.AMQPConn(t)
	depth := func() (int, error) {
		ch, err := conn.Channel() // a failed passive declare closes its channel
		if err != nil {
			return 0, err
		}
		defer func() { _ = ch.Close() }()
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		return q.Messages, err
	}
	testenv.Eventually(t, fhWait, func() bool {
		n, err := depth()
		return err == nil && n == want
	}, "queue %s should hold %d message(s)", queue, want)
}

// fhStop closes the router (which closes its subscribers: the broker takes
// back what was not acked).
func fhStop(t *testing.T, r *message.Router) {
	t.Helper()
	require.NoError(t, r.Close())
}

// fhEffects creates an effects table in the bundle's schema and returns
// the statement that inserts a row (in the bundle's dialect) and the query
// that counts its rows.
func fhEffects(t *testing.T, b *testenv.Bundle) (insert, countQuery string) {
	t.Helper()
	table := b.Table("effects")
	b.Exec(t, "CREATE TABLE "+table+" (id text)")
	return b.Q("INSERT INTO " + table + " (id) VALUES ($1)"), "SELECT count(*) FROM " + table
}

// (a) Permanent(err) in transactional mode parks the key and acks: one
// delivery, the handler's writes rolled back, the record parked with the
// reason, a later copy acked as parked without running the handler.
// Before: neither parked nor acked, redelivered in a tight loop.
func TestPermanentInTransactionalModeParks(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		ctx, d, tables := b.Ctx, b.Driver, b.DB
		insert, effects := fhEffects(t, b)
		q := testenv.Queue(t, "fh_perm_")
		var run fhRun
		eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, OnEvent: run.Observe, Logger: testenv.Logger(t)}) // default NackDelay
		require.NoError(t, err)
		r := fhRouter(t)
		r.AddMiddleware(run.Outer, eo.Middleware)
		r.AddConsumerHandler("permanent", q, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
			run.runs.Add(1)
			if err := testenv.Exec(msg.Context(), insert, msg.UUID); err != nil {
				return err
			}
			pub, err := exactlyonce.OutboxFromContext(msg.Context())
			if err != nil {
				return err
			}
			if err := pub.Publish("downstream", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
				return err
			}
			return exactlyonce.Permanent(errors.New("payload will never parse"))
		})
		testenv.StartRouter(t, r)

		uuid := watermill.NewUUID()
		fhPublish(t, q, message.NewMessage(uuid, []byte(`{"broken"`)))
		ev := run.event(t, 1)
		require.Equal(t, exactlyonce.Parked, ev.Outcome)
		require.Equal(t, uuid, ev.Key)
		require.ErrorContains(t, ev.Err, "payload will never parse", "the event says why the key was parked")
		require.NoError(t, run.returnedAt(t, 1), "the router acks")

		n := run.window(t, "Permanent in transactional mode (default NackDelay)")
		require.Zero(t, n, "exactly one delivery: parked and acked, never redelivered")
		require.Equal(t, int64(1), run.runs.Load())

		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		rec, err := store.Lookup(ctx, d.DB, "permanent", uuid)
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusParked, rec.Status)
		require.Contains(t, rec.LastError, "payload will never parse")
		require.Equal(t, int64(0), count(t, d, effects), "the handler's writes were rolled back")
		require.Equal(t, int64(0), count(t, d, "SELECT count(*) FROM "+tables.Outbox()), "and its outbox message")

		// A redelivered copy (the same UUID published again) is acked as
		// parked without running the handler.
		fhPublish(t, q, message.NewMessage(uuid, []byte(`{"broken"`)))
		ev = run.event(t, 2)
		require.Equal(t, exactlyonce.Parked, ev.Outcome)
		require.NoError(t, run.returnedAt(t, 2), "the copy is acked")
		require.Equal(t, int64(1), run.runs.Load(), "the handler does not run for a parked key")
		require.Equal(t, int64(2), run.counters.Parked.Load())
		require.Zero(t, run.counters.Failed.Load())
		rec, err = store.Lookup(ctx, d.DB, "permanent", uuid)
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusParked, rec.Status)
		require.Equal(t, int64(1), rec.Duplicates)

		fhStop(t, r)
		fhQueueDepth(t, q, 0) // both copies acked
		require.Equal(t, int64(2), run.deliveries.Load())
	})
}

// (b) A handler without a publish topic whose messages have no
// destination: the delivery fails with ErrNoDestination, nothing commits,
// the message stays in the queue, and its redeliveries are bounded by
// NackDelay. Both ways of registering such a handler: AddHandler with no
// publish topic (it returns its messages), and AddConsumerHandler (it
// cannot return messages, so it publishes them through OutboxFromContext to
// its publish topic, which is empty). The second still fails at the time
// of writing: the outbox publisher's "empty destination topic" error is a
// handler error, not ErrNoDestination, and is nacked at once (~1,300
// redeliveries/s).
func TestNoDestinationIsBoundedAndKept(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name     string
		register func(r *message.Router, q string, sub message.Subscriber, h func(msg *message.Message) ([]*message.Message, error))
	}{
		{"AddHandler with no publish topic and OutboxOnly", func(r *message.Router, q string, sub message.Subscriber, h func(msg *message.Message) ([]*message.Message, error)) {
			r.AddHandler("no-destination", q, sub, "", exactlyonce.OutboxOnly(), h)
		}},
		{"AddConsumerHandler publishing to its publish topic", func(r *message.Router, q string, sub message.Subscriber, h func(msg *message.Message) ([]*message.Message, error)) {
			// Such a handler cannot return messages: it hands them to
			// OutboxFromContext, for the handler's publish topic (none).
			r.AddConsumerHandler("no-destination", q, sub, func(msg *message.Message) error {
				out, err := h(msg)
				if err != nil {
					return err
				}
				pub, err := exactlyonce.OutboxFromContext(msg.Context())
				if err != nil {
					return err
				}
				return pub.Publish(message.PublishTopicFromCtx(msg.Context()), out...)
			})
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := testenv.NewBundle(t, testenv.DriverNamed(t, "pgxpool"))
			d, tables := b.Driver, b.DB
			insert, effects := fhEffects(t, b)
			q := testenv.Queue(t, "fh_nodest_")
			var run fhRun
			eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, NackDelay: fhNackDelay, OnEvent: run.Observe, Logger: watermill.NopLogger{}})
			require.NoError(t, err)
			r := fhRouter(t)
			r.AddMiddleware(run.Outer, eo.Middleware)
			c.register(r, q, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) ([]*message.Message, error) {
				run.runs.Add(1)
				if err := testenv.Exec(msg.Context(), insert, msg.UUID); err != nil {
					return nil, err
				}
				return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("out"))}, nil
			})
			testenv.StartRouter(t, r)
			fhPublish(t, q, message.NewMessage(watermill.NewUUID(), []byte("{}")))

			n := run.window(t, c.name+" (NackDelay 500ms)")
			require.LessOrEqual(t, n, fhMaxDeliveries, "redeliveries are bounded by NackDelay")
			require.GreaterOrEqual(t, n, int64(2), "the message is redelivered, not lost")
			// Before stopping: the deliveries that ended under a live
			// context (the one in flight when the router closes ends with
			// its context canceled).
			errs, events := run.returnedErrs(), run.eventsSoFar()
			fhStop(t, r)

			require.NotEmpty(t, errs)
			for _, err := range errs {
				require.ErrorIs(t, err, exactlyonce.ErrNoDestination)
				require.False(t, exactlyonce.IsPermanent(err), "a configuration error waits in the queue for the fix")
			}
			require.NotEmpty(t, events)
			for _, ev := range events {
				require.Equal(t, exactlyonce.Nacked, ev.Outcome)
				require.ErrorIs(t, ev.Err, exactlyonce.ErrNoDestination)
			}
			require.Zero(t, run.counters.Processed.Load())
			require.Equal(t, int64(0), count(t, d, "SELECT count(*) FROM "+tables.Inbox()), "nothing committed: no inbox record")
			require.Equal(t, int64(0), count(t, d, "SELECT count(*) FROM "+tables.Outbox()), "no outbox row")
			require.Equal(t, int64(0), count(t, d, effects), "no effect")
			fhQueueDepth(t, q, 1) // the message is back in the queue
		})
	}
}

// (c) Forgotten migrations: the error wraps sqlschema.ErrNotMigrated and
// ErrClaimFailed (never ErrDBUnavailable), says what to run and names the
// schema; FailOpen does not run the handler for it; the redeliveries are
// bounded by NackDelay and the message is kept.
func TestNotMigratedSaysSo(t *testing.T) {
	t.Parallel()
	for _, name := range testenv.EngineDriverNames {
		for _, create := range []bool{true, false} {
			sub := name + "/missing schema"
			if create {
				sub = name + "/empty schema"
			}
			t.Run(sub, func(t *testing.T) {
				t.Parallel()
				d := testenv.DriverNamed(t, name)
				schema := testenv.Unique(t, "eo_nomig_")
				switch {
				case create && d.Dialect == sqlschema.MySQL:
					_, schema = testenv.MySQLDatabase(t) // a database without the tables
				case create:
					pool := testenv.Pool(t)
					_, err := pool.Exec(context.Background(), "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize())
					require.NoError(t, err)
					t.Cleanup(func() {
						_, err := pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
						require.NoError(t, err)
					})
				}
				q := testenv.Queue(t, "fh_nomig_")
				var run fhRun
				eo, err := exactlyonce.New(exactlyonce.Config{DB: sqlschema.DB{Conn: d.DB, Dialect: d.Dialect, Schema: schema}, FailOpen: true,
					NackDelay: fhNackDelay, OnEvent: run.Observe, Logger: watermill.NopLogger{}})
				require.NoError(t, err)
				r := fhRouter(t)
				r.AddMiddleware(run.Outer, eo.Middleware)
				r.AddConsumerHandler("not-migrated", q, testenv.AMQPSubscriber(t, 1), func(*message.Message) error {
					run.runs.Add(1)
					return nil
				})
				testenv.StartRouter(t, r)
				fhPublish(t, q, message.NewMessage(watermill.NewUUID(), []byte("{}")))

				n := run.window(t, "tables not migrated, FailOpen (NackDelay 500ms)")
				require.LessOrEqual(t, n, fhMaxDeliveries, "redeliveries are bounded by NackDelay")
				require.GreaterOrEqual(t, n, int64(2), "the message is redelivered, not lost")
				// Before stopping: the deliveries that ended under a live
				// context (the one in flight when the router closes ends
				// with its context canceled).
				errs, events := run.returnedErrs(), run.eventsSoFar()
				fhStop(t, r)

				require.NotEmpty(t, errs)
				for _, err := range errs {
					require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
					require.ErrorIs(t, err, exactlyonce.ErrClaimFailed)
					require.NotErrorIs(t, err, exactlyonce.ErrDBUnavailable, "not an outage")
					require.ErrorContains(t, err, "run sqlschema.Migrate")
					require.ErrorContains(t, err, schema)
					require.True(t, strings.HasPrefix(err.Error(), "exactlyonce: "), err.Error())
					require.False(t, exactlyonce.IsPermanent(err))
				}
				require.NotEmpty(t, events)
				for _, ev := range events {
					require.Equal(t, exactlyonce.Nacked, ev.Outcome, "never FailOpen")
					require.ErrorIs(t, ev.Err, sqlschema.ErrNotMigrated)
					require.ErrorIs(t, ev.Err, exactlyonce.ErrClaimFailed)
					require.NotErrorIs(t, ev.Err, exactlyonce.ErrDBUnavailable)
				}
				require.Zero(t, run.runs.Load(), "FailOpen never runs the handler for tables that are not migrated")
				require.Zero(t, run.counters.FailOpen.Load())
				fhQueueDepth(t, q, 1)
			})
		}
	}
}

// fhRecordingPublisher records what its publisher returned.
type fhRecordingPublisher struct {
	message.Publisher
	mu   sync.Mutex
	errs []error
}

func (p *fhRecordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := p.Publisher.Publish(topic, msgs...)
	p.mu.Lock()
	p.errs = append(p.errs, err)
	p.mu.Unlock()
	return err
}

func (p *fhRecordingPublisher) first() (error, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.errs) == 0 {
		return nil, false
	}
	return p.errs[0], true
}

// (d) OutboxOnly as a handler's publisher without the middleware: the
// router's publish fails with ErrNoMiddleware naming the handler, the
// delivery is nacked (kept) once a second, and nothing reaches the broker.
func TestOutboxOnlyWithoutMiddlewareFails(t *testing.T) {
	t.Parallel()
	in := testenv.Queue(t, "fh_oo_in_")
	out := testenv.Queue(t, "fh_oo_out_")
	pub := &fhRecordingPublisher{Publisher: exactlyonce.OutboxOnly()}
	var run fhRun
	r := fhRouter(t)
	r.AddMiddleware(run.Outer) // no exactly-once middleware: the mistake
	r.AddHandler("forgot-middleware", in, testenv.AMQPSubscriber(t, 1), out, pub, func(msg *message.Message) ([]*message.Message, error) {
		run.runs.Add(1)
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("out"))}, nil
	})
	testenv.StartRouter(t, r)
	fhPublish(t, in, message.NewMessage(watermill.NewUUID(), []byte("{}")))

	var err error
	testenv.Eventually(t, fhWait, func() bool {
		var ok bool
		err, ok = pub.first()
		return ok
	}, "the router never published")
	require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
	require.ErrorContains(t, err, `"forgot-middleware"`, "it names the handler")
	require.ErrorContains(t, err, out, "it names the topic")
	testenv.Eventually(t, fhWait, func() bool { return run.runs.Load() >= 2 }, "the delivery is nacked and redelivered")
	n := run.window(t, "OutboxOnly without the middleware")
	require.LessOrEqual(t, n, int64(fhWindow/time.Second)+2, "the redelivery loop is bounded (one delivery a second)")
	fhStop(t, r)
	fhQueueDepth(t, out, 0) // nothing published to the broker
	fhQueueDepth(t, in, 1)  // the message is kept
}

// (e) A panicking handler: the error is Watermill's RecoveredPanicError
// with the panic value, and nothing of the attempt commits: the redelivery
// runs again and commits once.
func TestPanicIsRecoveredPanicError(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		d, tables := b.Driver, b.DB
		insert, effects := fhEffects(t, b)
		q := testenv.Queue(t, "fh_panic_")
		var run fhRun
		eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, OnEvent: run.Observe, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		type bug struct{ msg string }
		r := fhRouter(t)
		r.AddMiddleware(run.Outer, eo.Middleware)
		r.AddHandler("panics-once", q, testenv.AMQPSubscriber(t, 1), "downstream", exactlyonce.OutboxOnly(),
			func(msg *message.Message) ([]*message.Message, error) {
				if err := testenv.Exec(msg.Context(), insert, msg.UUID); err != nil {
					return nil, err
				}
				pub, err := exactlyonce.OutboxFromContext(msg.Context())
				if err != nil {
					return nil, err
				}
				if err := pub.Publish("audit", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
					return nil, err
				}
				if run.runs.Add(1) == 1 {
					panic(bug{"nil map in handler"})
				}
				return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
			})
		testenv.StartRouter(t, r)
		uuid := watermill.NewUUID()
		fhPublish(t, q, message.NewMessage(uuid, []byte("{}")))

		err = run.returnedAt(t, 1)
		var pe middleware.RecoveredPanicError
		require.ErrorAs(t, err, &pe)
		require.Equal(t, bug{"nil map in handler"}, pe.V, "the panic value")
		require.NotEmpty(t, pe.Stacktrace)
		ev := run.event(t, 1)
		require.Equal(t, exactlyonce.Nacked, ev.Outcome)
		require.ErrorAs(t, ev.Err, &pe)
		require.False(t, exactlyonce.IsPermanent(err), "a panic may be a transient bug: redelivered")

		ev = run.event(t, 2) // the redelivery
		require.Equal(t, exactlyonce.Processed, ev.Outcome)
		fhStop(t, r)
		require.Equal(t, int64(2), run.runs.Load())
		require.Equal(t, int64(1), run.counters.Processed.Load())
		require.Equal(t, int64(1), run.counters.Failed.Load())
		require.Equal(t, int64(1), count(t, d, effects), "only the committed attempt's write")
		require.Equal(t, int64(2), count(t, d, "SELECT count(*) FROM "+tables.Outbox()), "only the committed attempt's two messages")
		require.Equal(t, int64(1), count(t, d, "SELECT count(*) FROM "+tables.Inbox()))
		fhQueueDepth(t, q, 0)
	})
}

// refusedDB returns a database handle of driver name whose every
// connection is refused (a proxy that refuses), as an unreachable database.
func refusedDB(t *testing.T, driver string) wsql.Beginner {
	t.Helper()
	host := testenv.DatabaseURL()
	proxy := testenv.NewProxy(t, fhHostPort(t, host))
	proxy.Refuse()
	url := proxy.RewriteURL(host)
	if driver == "pgxpool" {
		cfg, err := pgxpool.ParseConfig(url)
		require.NoError(t, err)
		cfg.ConnConfig.ConnectTimeout = 5 * time.Second
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg) // connects lazily
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		return wsql.BeginnerFromPgx(pool)
	}
	cfg, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnectTimeout = 5 * time.Second
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = db.Close() })
	return wsql.BeginnerFromStdSQL(db)
}

// fhHostPort returns the host:port of a postgres URL.
func fhHostPort(t *testing.T, url string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	return net.JoinHostPort(cfg.Host, fmt.Sprint(cfg.Port))
}

// (f) IsPermanent is true for what no redelivery can fix and false for
// what a fix or time can; with PoisonQueueWithFilter(IsPermanent) outside
// the middleware, a message with an empty UUID lands in a poison queue
// declared up front, and can be read back from it.
func TestIsPermanent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testenv.Drivers(t)[0]
	tables := testenv.WithConn(testenv.Schema(t), d.DB)
	deliver := func(t *testing.T, db sqlschema.DB, uuid string, h message.HandlerFunc) error {
		t.Helper()
		eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Consumer: "c", NackDelay: -1, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		_, err = eo.Middleware(h)(message.NewMessage(uuid, nil))
		require.Error(t, err)
		return err
	}
	ok := func(*message.Message) ([]*message.Message, error) { return nil, nil }

	t.Run("sentinels", func(t *testing.T) {
		require.True(t, exactlyonce.IsPermanent(exactlyonce.ErrInvalidKey))
		require.True(t, exactlyonce.IsPermanent(exactlyonce.Permanent(errors.New("x"))))
		require.True(t, exactlyonce.IsPermanent(fmt.Errorf("wrapped: %w", exactlyonce.Permanent(errors.New("x")))))
		require.NoError(t, exactlyonce.Permanent(nil))
		for _, err := range []error{nil, exactlyonce.ErrNoDestination, exactlyonce.ErrDBUnavailable, exactlyonce.ErrClaimFailed,
			sqlschema.ErrNotMigrated, exactlyonce.ErrLeaseHeld, exactlyonce.ErrLeaseLost, errors.New("plain")} {
			require.False(t, exactlyonce.IsPermanent(err), "%v", err)
		}
	})
	t.Run("empty key", func(t *testing.T) {
		err := deliver(t, tables, "", ok)
		require.ErrorIs(t, err, exactlyonce.ErrInvalidKey)
		require.True(t, exactlyonce.IsPermanent(err))
	})
	t.Run("nil output message", func(t *testing.T) {
		err := deliver(t, tables, "nil-output", func(*message.Message) ([]*message.Message, error) {
			return []*message.Message{nil}, nil
		})
		require.True(t, exactlyonce.IsPermanent(err), "%v", err)
	})
	t.Run("no destination", func(t *testing.T) {
		err := deliver(t, tables, "no-dest", func(*message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage("out", nil)}, nil
		})
		require.ErrorIs(t, err, exactlyonce.ErrNoDestination)
		require.False(t, exactlyonce.IsPermanent(err))
	})
	t.Run("database unavailable", func(t *testing.T) {
		err := deliver(t, sqlschema.DB{Conn: refusedDB(t, "pgxpool"), Schema: tables.Schema}, "unavailable", ok)
		require.ErrorIs(t, err, exactlyonce.ErrDBUnavailable)
		require.False(t, exactlyonce.IsPermanent(err))
	})
	t.Run("not migrated", func(t *testing.T) {
		err := deliver(t, sqlschema.DB{Conn: d.DB, Schema: testenv.Unique(t, "eo_none_")}, "not-migrated", ok)
		require.ErrorIs(t, err, exactlyonce.ErrClaimFailed)
		require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
		require.False(t, exactlyonce.IsPermanent(err))
	})
	t.Run("handler error", func(t *testing.T) {
		err := deliver(t, tables, "handler-error", func(*message.Message) ([]*message.Message, error) {
			return nil, errors.New("provider said 503")
		})
		require.False(t, exactlyonce.IsPermanent(err))
	})

	t.Run("poison queue end to end", func(t *testing.T) {
		in := testenv.Queue(t, "fh_poison_in_")
		poison := in + "_poison" // testenv.Queue deletes it too
		require.NoError(t, rabbitmq.DeclareQueues(ctx, testenv.AMQPURL(), poison))
		pq, err := middleware.PoisonQueueWithFilter(testenv.AMQPPublisher(t), poison, exactlyonce.IsPermanent)
		require.NoError(t, err)
		var run fhRun
		eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, NackDelay: fhNackDelay, OnEvent: run.Observe, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		r := fhRouter(t)
		r.AddMiddleware(run.Outer, pq, eo.Middleware) // the poison queue outside the middleware
		var handled sync.Map
		r.AddConsumerHandler("poison-e2e", in, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
			run.runs.Add(1)
			handled.Store(msg.UUID, true)
			return nil
		})
		testenv.StartRouter(t, r)

		// A producer that is not Watermill: no UUID header, no message_id.
		conn := testenv.AMQPConn(t)
		ch, err := conn.Channel()
		require.NoError(t, err)
		defer func() { _ = ch.Close() }()
		body := []byte(`{"sms":"your code is 1234"}`)
		require.NoError(t, ch.PublishWithContext(ctx, "", in, false, false, amqp.Publishing{
			Headers: amqp.Table{"producer": "legacy-php"}, Body: body, DeliveryMode: amqp.Persistent,
		}))
		good := watermill.NewUUID()
		fhPublish(t, in, message.NewMessage(good, []byte(`{"sms":"hello"}`)))

		ev := run.event(t, 1)
		require.Equal(t, exactlyonce.Nacked, ev.Outcome)
		require.ErrorIs(t, ev.Err, exactlyonce.ErrInvalidKey)
		require.NoError(t, run.returnedAt(t, 1), "the poison queue took it: acked")
		require.Equal(t, exactlyonce.Processed, run.event(t, 2).Outcome, "the message behind it is not blocked")
		var got amqp.Delivery
		var getErr error
		testenv.Eventually(t, fhWait, func() bool {
			d, ok, err := ch.Get(poison, true)
			if err != nil {
				getErr = err
				return false
			}
			got = d
			return ok
		}, "nothing in the poison queue (%v)", getErr)
		require.Equal(t, body, got.Body, "the poisoned message is the keyless one, intact")
		reason, _ := got.Headers[middleware.ReasonForPoisonedKey].(string)
		require.Contains(t, reason, exactlyonce.ErrInvalidKey.Error())
		require.Equal(t, in, got.Headers[middleware.PoisonedTopicKey])
		require.Equal(t, "poison-e2e", got.Headers[middleware.PoisonedHandlerKey])
		require.Equal(t, "legacy-php", got.Headers["producer"], "the original metadata is kept")

		fhStop(t, r)
		require.Equal(t, int64(1), run.runs.Load(), "the handler only saw the good message")
		_, sawGood := handled.Load(good)
		require.True(t, sawGood)
		require.Equal(t, int64(2), run.deliveries.Load(), "the keyless message was delivered once")
		fhQueueDepth(t, in, 0)
		fhQueueDepth(t, poison, 0) // read back: exactly one poisoned message
	})
}

// (g) The context helpers return an error outside a handler (never a
// zero value with no reason); in a fail-open run the transaction helpers
// return an error wrapping ErrDBUnavailable while InfoFromContext works.
func TestContextHelpersErrors(t *testing.T) {
	t.Parallel()
	t.Run("outside a handler", func(t *testing.T) {
		t.Parallel()
		for name, ctx := range map[string]context.Context{
			"background":                 context.Background(),
			"message outside middleware": message.NewMessage("k", nil).Context(),
		} {
			tx, err := exactlyonce.PgxTxFromContext(ctx)
			require.Error(t, err, name)
			require.Nil(t, tx, name)
			stx, err := exactlyonce.StdTxFromContext(ctx)
			require.Error(t, err, name)
			require.Nil(t, stx, name)
			pub, err := exactlyonce.OutboxFromContext(ctx)
			require.Error(t, err, name)
			require.Nil(t, pub, name)
			info, err := exactlyonce.InfoFromContext(ctx)
			require.Error(t, err, name)
			require.Zero(t, info, name)
			require.Error(t, exactlyonce.ExtendLease(ctx, time.Second), name)
			require.True(t, strings.HasPrefix(err.Error(), "exactlyonce: "), err.Error())
		}
	})
	for _, driver := range []string{"pgxpool", "database-sql"} {
		t.Run("fail-open run/"+driver, func(t *testing.T) {
			t.Parallel()
			q := testenv.Queue(t, "fh_ctx_")
			var run fhRun
			eo, err := exactlyonce.New(exactlyonce.Config{DB: sqlschema.DB{Conn: refusedDB(t, driver)}, FailOpen: true,
				OnEvent: run.Observe, Logger: watermill.NopLogger{}})
			require.NoError(t, err)
			type seen struct {
				pgxErr, stdErr, outboxErr, infoErr error
				info                               exactlyonce.Info
			}
			got := make(chan seen, 1)
			r := fhRouter(t)
			r.AddMiddleware(run.Outer, eo.Middleware)
			r.AddConsumerHandler("fail-open", q, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
				ctx := msg.Context()
				var s seen
				_, s.pgxErr = exactlyonce.PgxTxFromContext(ctx)
				_, s.stdErr = exactlyonce.StdTxFromContext(ctx)
				_, s.outboxErr = exactlyonce.OutboxFromContext(ctx)
				s.info, s.infoErr = exactlyonce.InfoFromContext(ctx)
				select {
				case got <- s:
				default:
				}
				return nil
			})
			testenv.StartRouter(t, r)
			uuid := watermill.NewUUID()
			fhPublish(t, q, message.NewMessage(uuid, nil))

			var s seen
			select {
			case s = <-got:
			case <-time.After(fhWait):
				t.Fatal("the handler never ran fail-open")
			}
			require.ErrorIs(t, s.pgxErr, exactlyonce.ErrDBUnavailable)
			require.ErrorIs(t, s.stdErr, exactlyonce.ErrDBUnavailable)
			require.ErrorIs(t, s.outboxErr, exactlyonce.ErrDBUnavailable)
			require.NoError(t, s.infoErr)
			require.Equal(t, exactlyonce.Info{Consumer: "fail-open", Key: uuid, IdempotencyKey: "fail-open:" + uuid, FailOpen: true}, s.info)
			ev := run.event(t, 1)
			require.Equal(t, exactlyonce.FailOpen, ev.Outcome)
			require.NoError(t, run.returnedAt(t, 1), "the fail-open run is acked")
			fhStop(t, r)
			fhQueueDepth(t, q, 0)
		})
	}
}
