package exactlyonce_test

// Regression tests for the second "first hours" report: a forgotten
// middleware, a store-only lease handler that returns messages, log noise
// during an outage and under lease contention, and the start-up checks.
// Each goes through a Watermill router on a real RabbitMQ queue and real
// PostgreSQL (and Redis for the Redis store).

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	exactlyonce "github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// fh2Errors records the first errors a handler got from the context helpers.
type fh2Errors struct {
	mu   sync.Mutex
	errs []error
}

func (e *fh2Errors) add(err error) {
	e.mu.Lock()
	e.errs = append(e.errs, err)
	e.mu.Unlock()
}

func (e *fh2Errors) first(t *testing.T) error {
	t.Helper()
	var err error
	testenv.Eventually(t, fhWait, func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		if len(e.errs) == 0 {
			return false
		}
		err = e.errs[0]
		return true
	}, "the handler never ran")
	return err
}

// A handler that calls PgxTxFromContext(msg.Context()) on a router without
// the exactly-once middleware: the error names the missing middleware and
// the handler (not the context), it is permanent, and the redelivery loop
// is bounded without a poison queue. With the recommended poison queue
// (PoisonQueueWithFilter(IsPermanent)) the message leaves the loop after
// one delivery, kept in the poison queue.
// Before: "the context is not a handler's ... (use msg.Context() inside
// the handler)", not permanent, thousands of redeliveries per second.
func TestFirstHoursForgottenMiddleware(t *testing.T) {
	t.Parallel()
	handler := func(run *fhRun, seen *fh2Errors) message.NoPublishHandlerFunc {
		return func(msg *message.Message) error {
			run.runs.Add(1)
			_, err := exactlyonce.PgxTxFromContext(msg.Context())
			seen.add(err)
			return err
		}
	}

	t.Run("without a poison queue", func(t *testing.T) {
		t.Parallel()
		q := testenv.Queue(t, "fh2_nomw_")
		var run fhRun
		var seen fh2Errors
		r := fhRouter(t)
		r.AddMiddleware(run.Outer) // no exactly-once middleware: the mistake
		r.AddConsumerHandler("forgot-middleware", q, testenv.AMQPSubscriber(t, 1), handler(&run, &seen))
		testenv.StartRouter(t, r)
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), []byte("{}")))

		err := seen.first(t)
		require.Error(t, err)
		require.True(t, exactlyonce.IsPermanent(err), "no redelivery can fix a missing middleware: %v", err)
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		require.Contains(t, err.Error(), `"forgot-middleware"`, "it names the handler")
		require.Contains(t, err.Error(), "AddMiddleware", "it says how to add the middleware")
		require.NotContains(t, err.Error(), "use msg.Context()", "the handler did use msg.Context()")
		n := run.window(t, "a forgotten middleware")
		require.LessOrEqual(t, n, int64(fhWindow/time.Second)+2, "the redelivery loop is bounded (one delivery a second)")
		fhStop(t, r)
		fhQueueDepth(t, q, 1) // kept
	})

	t.Run("with the recommended poison queue", func(t *testing.T) {
		t.Parallel()
		q := testenv.Queue(t, "fh2_nomw_pq_")
		poison := q + "_poison" // testenv.Queue deletes it too
		require.NoError(t, rabbitmq.DeclareQueues(context.Background(), testenv.AMQPURL(), poison))
		pq, err := middleware.PoisonQueueWithFilter(testenv.AMQPPublisher(t), poison, exactlyonce.IsPermanent)
		require.NoError(t, err)
		var run fhRun
		var seen fh2Errors
		r := fhRouter(t)
		r.AddMiddleware(run.Outer, pq) // the poison queue, and no exactly-once middleware
		r.AddConsumerHandler("forgot-middleware-pq", q, testenv.AMQPSubscriber(t, 1), handler(&run, &seen))
		testenv.StartRouter(t, r)
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), []byte("{}")))

		fhQueueDepth(t, poison, 1)
		fhStop(t, r)
		require.Equal(t, int64(1), run.runs.Load(), "one delivery, then the poison queue took it")
		fhQueueDepth(t, q, 0)
	})

	t.Run("a context that is not the message's, under the middleware", func(t *testing.T) {
		t.Parallel()
		_, err := exactlyonce.PgxTxFromContext(context.Background())
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		require.True(t, exactlyonce.IsPermanent(err))
		require.Contains(t, err.Error(), "msg.Context()", "it says which context to pass")
		_, err = exactlyonce.OutboxFromContext(context.Background())
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		require.ErrorIs(t, exactlyonce.Queue(context.Background(), "SELECT 1"), exactlyonce.ErrNoMiddleware)
		_, err = exactlyonce.InfoFromContext(context.Background())
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
	})

	t.Run("OutboxOnly without the middleware", func(t *testing.T) {
		t.Parallel()
		in := testenv.Queue(t, "fh2_oo_in_")
		out := testenv.Queue(t, "fh2_oo_out_")
		pub := &fhRecordingPublisher{Publisher: exactlyonce.OutboxOnly()}
		var run fhRun
		r := fhRouter(t)
		r.AddMiddleware(run.Outer)
		r.AddHandler("forgot-middleware-oo", in, testenv.AMQPSubscriber(t, 1), out, pub, func(msg *message.Message) ([]*message.Message, error) {
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
		require.Contains(t, err.Error(), `"forgot-middleware-oo"`, "it names the handler")
		n := run.window(t, "OutboxOnly without the middleware")
		require.LessOrEqual(t, n, int64(fhWindow/time.Second)+2, "the redelivery loop is bounded (one delivery a second)")
		fhStop(t, r)
		fhQueueDepth(t, out, 0)
		fhQueueDepth(t, in, 1)
	})
}

// fh2Log is a Watermill logger that keeps every line with its level.
type fh2Log struct {
	mu    sync.Mutex
	lines []string // "LEVEL msg err"
}

func (l *fh2Log) add(level, msg string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	line := level + " " + msg
	if err != nil {
		line += " err=" + err.Error()
	}
	l.lines = append(l.lines, line)
}

func (l *fh2Log) Error(msg string, err error, _ watermill.LogFields) { l.add("ERROR", msg, err) }
func (l *fh2Log) Info(msg string, _ watermill.LogFields)             { l.add("INFO", msg, nil) }
func (l *fh2Log) Debug(msg string, _ watermill.LogFields)            { l.add("DEBUG", msg, nil) }
func (l *fh2Log) Trace(msg string, _ watermill.LogFields)            { l.add("TRACE", msg, nil) }
func (l *fh2Log) With(watermill.LogFields) watermill.LoggerAdapter   { return l }

// count returns the lines at level that contain every one of parts.
func (l *fh2Log) count(level string, parts ...string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
next:
	for _, line := range l.lines {
		if !strings.HasPrefix(line, level+" ") {
			continue
		}
		for _, p := range parts {
			if !strings.Contains(line, p) {
				continue next
			}
		}
		n++
	}
	return n
}

func (l *fh2Log) dump(t *testing.T, level string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.HasPrefix(line, level+" ") {
			t.Log(line)
		}
	}
}

// A 10 s database outage, with the recommended logging set-up (the
// router's logger wrapped by RouterLogger, the middleware on the same
// logger): a few lines (the outage started, and ended with its length and
// count), however many deliveries failed meanwhile.
// Before: two ERROR lines per failed delivery (the middleware's and the
// router's).
func TestFirstHoursOutageIsAFewLines(t *testing.T) {
	t.Parallel()
	proxy := testenv.NewProxy(t, fhHostPort(t, testenv.DatabaseURL()))
	pool := testenv.PoolFor(t, proxy.RewriteURL(testenv.DatabaseURL()))
	tables := testenv.WithConn(testenv.Schema(t), wsql.BeginnerFromPgx(pool))
	q := testenv.Queue(t, "fh2_outage_")
	var log fh2Log
	var ev testenv.Counters
	eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, NackDelay: 50 * time.Millisecond, OnEvent: ev.Observe, Logger: &log})
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, exactlyonce.RouterLogger(&log))
	require.NoError(t, err)
	r.AddMiddleware(eo.Middleware)
	r.AddConsumerHandler("outage", q, exactlyonce.ConcurrentSubscriber(testenv.AMQPSubscriber(t, 8), 4), func(*message.Message) error { return nil })
	testenv.StartRouter(t, r)
	pub := testenv.AMQPPublisher(t)
	publish := func(n int) {
		for range n {
			require.NoError(t, pub.Publish(q, message.NewMessage(watermill.NewUUID(), nil)))
		}
	}
	publish(5)
	testenv.Eventually(t, fhWait, func() bool { return ev.Processed.Load() == 5 }, "processed before the outage")

	proxy.Refuse()
	publish(20)
	time.Sleep(10 * time.Second)
	failed := ev.DBUnavailable.Load()
	proxy.Allow()
	testenv.Eventually(t, fhWait, func() bool { return ev.Processed.Load() == 25 }, "processed after the outage")
	fhStop(t, r)

	t.Logf("%d deliveries failed during the outage", failed)
	require.Greater(t, failed, int64(50), "the outage failed many deliveries")
	errorLines := log.count("ERROR")
	if errorLines > 3 {
		log.dump(t, "ERROR")
	}
	require.LessOrEqual(t, errorLines, 3, "an outage is a few lines, not one or two per failed delivery (%d)", failed)
	require.Equal(t, 1, log.count("ERROR", "database unavailable"), "its start")
	require.Equal(t, 1, log.count("INFO", "database unavailable", "ended after"), "its end")
}

// A lease held by a worker that died: the new worker's deliveries of that
// key wait for the lease to expire. That is expected contention, not an
// error: nothing at ERROR level with the recommended logging set-up.
// Before: "another worker holds the lease" at ERROR on every redelivery.
func TestFirstHoursLeaseContentionIsNotAnError(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		var log fh2Log
		q := testenv.Queue(t, "fh2_held_")
		eo := s.middleware(t, exactlyonce.Config{Logger: &log})
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, exactlyonce.RouterLogger(&log))
		require.NoError(t, err)
		r.AddMiddleware(eo.Middleware)
		var runs fhRun
		r.AddConsumerHandler(suiteConsumer, q, testenv.AMQPSubscriber(t, 1), func(*message.Message) error {
			runs.runs.Add(1)
			return nil
		})
		s.claimElsewhere(t, "held", 2*time.Second) // the worker that died
		testenv.StartRouter(t, r)
		fhPublish(t, q, message.NewMessage("held", nil))
		testenv.Eventually(t, fhWait, func() bool { return runs.runs.Load() == 1 }, "run once the dead worker's lease expired")
		fhStop(t, r)
		require.Greater(t, s.ev.Busy.Load(), int64(3), "deliveries were nacked while the lease was held")
		if n := log.count("ERROR"); n > 0 {
			log.dump(t, "ERROR")
			t.Fatalf("%d ERROR lines for expected contention", n)
		}
	})
}

var _ = errors.New
