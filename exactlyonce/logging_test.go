package exactlyonce_test

// What the middleware logs and reports of a mistake or an outage: the
// context helpers without the middleware, a store-only lease handler that
// returns messages, the log lines of an outage and of lease contention
// (RouterLogger, episodes), and the start-up check, which reports through
// the log.
// Each goes through a Watermill router on a real RabbitMQ queue and real
// PostgreSQL (and Redis for the Redis store).

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
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
func TestContextHelpersWithoutMiddleware(t *testing.T) {
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
		var mu sync.Mutex
		runsOf := map[string]int{} // message UUID -> runs of the handler
		countRuns := func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				mu.Lock()
				runsOf[msg.UUID]++
				mu.Unlock()
				return h(msg)
			}
		}
		r := fhRouter(t)
		r.AddMiddleware(run.Outer, pq, countRuns) // the poison queue, and no exactly-once middleware
		r.AddConsumerHandler("forgot-middleware-pq", q, testenv.AMQPSubscriber(t, 1), handler(&run, &seen))
		testenv.StartRouter(t, r)
		first := message.NewMessage(watermill.NewUUID(), []byte("{}"))
		fhPublish(t, q, first)
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), []byte("next")))

		fhQueueDepth(t, poison, 1)
		// Prefetch 1: the next message is delivered once the first was acked.
		testenv.Eventually(t, fhWait, func() bool { return run.runs.Load() >= 2 }, "the message behind it is delivered")
		fhStop(t, r)
		// The next message may run again before the router has closed (it
		// fails too, and is redelivered while the router stops): only the
		// first one's runs are counted.
		mu.Lock()
		require.Equal(t, 1, runsOf[first.UUID], "one delivery, then the poison queue took it")
		mu.Unlock()
		fhQueueDepth(t, q, 1) // the next one, which fails too (no middleware), and waits
	})

	t.Run("a context that is not the message's, under the middleware", func(t *testing.T) {
		t.Parallel()
		_, err := exactlyonce.PgxTxFromContext(context.Background())
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		require.True(t, exactlyonce.IsPermanent(err))
		require.Contains(t, err.Error(), "msg.Context()", "it says which context to pass")
		_, err = exactlyonce.OutboxFromContext(context.Background())
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		require.ErrorIs(t, exactlyonce.Exec(context.Background(), "SELECT 1"), exactlyonce.ErrNoMiddleware)
		_, err = exactlyonce.InfoFromContext(context.Background())
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
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
func TestOutageIsLoggedInAFewLines(t *testing.T) {
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
	// The episode ends at a success once no failure was seen for 5 s.
	time.Sleep(6 * time.Second)
	publish(1)
	testenv.Eventually(t, fhWait, func() bool { return ev.Processed.Load() == 26 }, "processed later")
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
func TestLeaseContentionIsNotLoggedAsAnError(t *testing.T) {
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
		if n := log.count("ERROR") - log.count("ERROR", "start-up check"); n > 0 {
			log.dump(t, "ERROR")
			t.Fatalf("%d ERROR lines for expected contention", n)
		}
	})
}

// fh2ForgetLastMigration makes the schema look migrated by an earlier
// version of the library: the migrations table no longer records the
// latest migration of target ("inbox" or "outbox").
func fh2ForgetLastMigration(t *testing.T, db sqlschema.DB, target string) {
	t.Helper()
	table := pgx.Identifier{db.Schema, "watermill_exactlyonce_migrations"}.Sanitize()
	_, err := db.Conn.ExecContext(context.Background(), "DELETE FROM "+table+
		" WHERE target LIKE $1 || ':%' AND version = (SELECT max(version) FROM "+table+" WHERE target LIKE $1 || ':%')", target)
	require.NoError(t, err)
}

// The start-up check: the first delivery (whose claim succeeded) reports
// tables older than this version of the library; a database that is down at start-up fails
// nothing, and the check runs once it is back.
// Before: nothing was checked unless the service called sqlschema.Check.
func TestStartupCheck(t *testing.T) {
	t.Parallel()
	start := func(t *testing.T, db sqlschema.DB, log *fh2Log, q string) {
		t.Helper()
		eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Logger: log, NackDelay: 50 * time.Millisecond})
		require.NoError(t, err)
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, exactlyonce.RouterLogger(log))
		require.NoError(t, err)
		r.AddMiddleware(eo.Middleware)
		r.AddConsumerHandler("startup", q, testenv.AMQPSubscriber(t, 1), func(*message.Message) error { return nil })
		testenv.StartRouter(t, r)
		t.Cleanup(func() { _ = r.Close() })
	}

	t.Run("tables of an earlier version", func(t *testing.T) {
		t.Parallel()
		db := testenv.Schema(t)
		fh2ForgetLastMigration(t, db, "inbox")
		var log fh2Log
		q := testenv.Queue(t, "fh2_check_old_")
		start(t, db, &log, q)
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), nil))
		testenv.Eventually(t, fhWait, func() bool { return log.count("ERROR", "start-up check", "not migrated", "inbox_0") == 1 },
			"the missing migration is reported at the first delivery")
		require.Zero(t, log.count("INFO", "start-up check passed"))
	})

	t.Run("migrated", func(t *testing.T) {
		t.Parallel()
		var log fh2Log
		q := testenv.Queue(t, "fh2_check_ok_")
		start(t, testenv.Schema(t), &log, q)
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), nil))
		testenv.Eventually(t, fhWait, func() bool { return log.count("INFO", "start-up check passed") == 1 }, "the check passes")
		require.Zero(t, log.count("ERROR"))
	})

	t.Run("database down at start-up", func(t *testing.T) {
		t.Parallel()
		proxy := testenv.NewProxy(t, fhHostPort(t, testenv.DatabaseURL()))
		pool := testenv.PoolFor(t, proxy.RewriteURL(testenv.DatabaseURL()))
		db := testenv.WithConn(testenv.Schema(t), wsql.BeginnerFromPgx(pool))
		proxy.Refuse()
		var log fh2Log
		q := testenv.Queue(t, "fh2_check_down_")
		start(t, db, &log, q) // starts: nothing fails a service whose database is down
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), nil))
		testenv.Eventually(t, fhWait, func() bool { return log.count("ERROR", "database unavailable") == 1 }, "the delivery fails while the database is down")
		require.Zero(t, log.count("ERROR", "start-up check"), "a database that is down fails no start-up check")
		proxy.Allow()
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), nil))
		testenv.Eventually(t, fhWait, func() bool { return log.count("INFO", "start-up check passed") == 1 }, "checked after the first claim")
		require.Zero(t, log.count("ERROR", "start-up check"))
	})

	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			name     string
			args     []string
			problems []string
		}{
			{"no persistence, evicting", []string{"--appendonly", "no", "--maxmemory-policy", "allkeys-lru"}, []string{"appendonly no", "maxmemory-policy allkeys-lru"}},
			{"as documented", []string{"--appendonly", "yes", "--maxmemory-policy", "noeviction"}, nil},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				c := fh2RedisServer(t, tc.args...)
				store, err := redisstore.New(redisstore.Config{Client: c, Prefix: testenv.RedisPrefix(t, c)})
				require.NoError(t, err)
				var log fh2Log
				eo, err := exactlyonce.New(exactlyonce.Config{Consumer: "sms", Lease: &exactlyonce.LeaseConfig{Store: store}, Logger: &log})
				require.NoError(t, err)
				h := eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
				require.NoError(t, deliverKey(h, "first"))
				if len(tc.problems) == 0 {
					testenv.Eventually(t, fhWait, func() bool { return log.count("INFO", "start-up check passed") == 1 }, "the check passes")
					require.Zero(t, log.count("ERROR"))
					return
				}
				for _, p := range tc.problems {
					testenv.Eventually(t, fhWait, func() bool { return log.count("ERROR", "start-up check", p) == 1 }, "%q is reported", p)
				}
				got, err := store.CheckServer(context.Background())
				require.NoError(t, err)
				require.Len(t, got, len(tc.problems))
			})
		}
	})
}

// fh2RedisServer starts a redis-server of its own with args on a free
// loopback port (stopped at cleanup) and returns a client of it.
func fh2RedisServer(t *testing.T, args ...string) *redis.Client {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	require.NoError(t, err, "redis-server is not installed: run 'make services'")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	require.NoError(t, ln.Close())
	cmd := exec.Command(bin, append([]string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--dir", t.TempDir()}, args...)...)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + port})
	t.Cleanup(func() { _ = c.Close() })
	testenv.Eventually(t, 10*time.Second, func() bool { return c.Ping(context.Background()).Err() == nil }, "redis-server on port %s did not start", port)
	return c
}

// Found in review of the changes above; each failed before its fix.

// A handler's mistake under a store-only lease refuses that handler's
// later keys, not those of another handler recording under the same
// consumer (a router-level middleware with Config.Consumer set).
func TestStoreOnlyRefusalIsPerHandler(t *testing.T) {
	t.Parallel()
	s := redisLeaseStore(t)
	eo := s.middleware(t, exactlyonce.Config{Consumer: "svc"})
	q1, q2 := testenv.Queue(t, "fh2_shared_bad_"), testenv.Queue(t, "fh2_shared_ok_")
	r := fhRouter(t)
	r.AddMiddleware(eo.Middleware)
	var badRuns, okRuns atomic.Int64
	r.AddConsumerHandler("bad", q1, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
		badRuns.Add(1)
		_, err := exactlyonce.PgxTxFromContext(msg.Context()) // its mistake
		return err
	})
	r.AddConsumerHandler("healthy", q2, testenv.AMQPSubscriber(t, 1), func(*message.Message) error {
		okRuns.Add(1)
		return nil
	})
	testenv.StartRouter(t, r)
	fhPublish(t, q1, message.NewMessage("b1", nil))
	testenv.Eventually(t, fhWait, func() bool { return s.ev.Parked.Load() == 1 }, "the bad handler's key is parked")
	fhPublish(t, q1, message.NewMessage("b2", nil))
	for _, k := range []string{"h1", "h2"} {
		fhPublish(t, q2, message.NewMessage(k, nil))
	}
	testenv.Eventually(t, fhWait, func() bool { return okRuns.Load() == 2 }, "the healthy handler runs its keys")
	testenv.Eventually(t, fhWait, func() bool { return s.ev.ClaimFailed.Load() >= 1 }, "the bad handler's next key is refused")
	fhStop(t, r)
	require.Equal(t, int64(1), badRuns.Load(), "the bad handler ran once")
	require.Equal(t, int64(2), s.ev.Processed.Load())
}

// InfoFromContext is a read-only probe that callers may ignore: outside
// the middleware it fails at once, without the wait of the helpers a
// handler needs for its work.
func TestInfoFromContextDoesNotWait(t *testing.T) {
	t.Parallel()
	q := testenv.Queue(t, "fh2_info_")
	var took atomic.Int64
	var n atomic.Int64
	r := fhRouter(t)
	r.AddConsumerHandler("no-middleware-info", q, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
		t0 := time.Now()
		_, err := exactlyonce.InfoFromContext(msg.Context())
		took.Add(int64(time.Since(t0)))
		n.Add(1)
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		return nil // optional enrichment: the error is ignored
	})
	testenv.StartRouter(t, r)
	for range 3 {
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), nil))
	}
	testenv.Eventually(t, fhWait, func() bool { return n.Load() == 3 }, "three messages handled")
	fhStop(t, r)
	require.Less(t, time.Duration(took.Load()), 300*time.Millisecond, "InfoFromContext waited")
}

// One key whose claim keeps failing among keys that succeed is one
// episode: a start line, not a start and an end per failure.
func TestOneFailingKeyIsOneEpisode(t *testing.T) {
	t.Parallel()
	s := postgresLeaseStore(t)
	s.claimElsewhere(t, "stuck", time.Hour) // a lease-mode record: a transactional claim is refused (ErrNotDone)
	var log fh2Log
	var cfg exactlyonce.Config
	s.with(&cfg)
	cfg.Consumer, cfg.NackDelay, cfg.Logger = suiteConsumer, -1, &log
	eo, err := exactlyonce.New(cfg)
	require.NoError(t, err)
	h := eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	for range 5 {
		require.ErrorIs(t, deliverKey(h, "stuck"), exactlyonce.ErrClaimFailed)
		require.NoError(t, deliverKey(h, watermill.NewUUID()))
	}
	require.Equal(t, 1, log.count("ERROR", "claims are failing"), "one start line")
	require.Zero(t, log.count("INFO", "ended after"), "no end while the key keeps failing")
}

// Tables created from sqlschema.SQL by another migration tool record no
// migration: the start-up checks cannot tell, and say so without an ERROR.
func TestStartupCheckOfTablesFromAnotherTool(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t)
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: testenv.Unique(t, "fh2sql_")}
	script, err := sqlschema.SQL(db)
	require.NoError(t, err)
	_, err = pool.Exec(context.Background(), script)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+db.Schema+" CASCADE") })
	var log fh2Log
	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Consumer: "c", Logger: &log})
	require.NoError(t, err)
	require.NoError(t, deliverKey(eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil }), "k"))
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}), NoListen: true, Logger: &log})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	testenv.Eventually(t, fhWait, func() bool { return log.count("INFO", "outbox relay: start-up check") == 1 }, "the relay's check ran")
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, 1, log.count("INFO", "exactlyonce: start-up check", "no migration is recorded"))
	require.Zero(t, log.count("ERROR"))
}

// Under concurrent deliveries the start-up check runs once.
func TestStartupCheckRunsOnce(t *testing.T) {
	t.Parallel()
	var log fh2Log
	eo, err := exactlyonce.New(exactlyonce.Config{DB: testenv.Schema(t), Consumer: "c", Logger: &log})
	require.NoError(t, err)
	h := eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 30 {
				_ = deliverKey(h, watermill.NewUUID())
			}
		})
	}
	wg.Wait()
	require.Equal(t, 1, log.count("INFO", "start-up check"))
}

// RouterLogger demotes only what the middleware reported: an error joined
// with another (a poison queue whose publish failed too) stays an error.
func TestRouterLoggerKeepsJoinedErrors(t *testing.T) {
	t.Parallel()
	eo, err := exactlyonce.New(exactlyonce.Config{DB: sqlschema.DB{Conn: refusedDB(t, "pgxpool")}, Consumer: "c", NackDelay: -1, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	reported := deliverKey(eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil }), "k")
	require.ErrorIs(t, reported, exactlyonce.ErrDBUnavailable)
	var log fh2Log
	l := exactlyonce.RouterLogger(&log).With(watermill.LogFields{"handler": "h"})
	l.Error("Handler returned error", reported, nil)
	l.Error("Handler returned error", fmt.Errorf("wrapped: %w", reported), nil)
	l.Error("Handler returned error", errors.Join(reported, errors.New("poison queue: publish failed")), nil)
	l.Error("Handler returned error", errors.New("provider said 503"), nil)
	require.Equal(t, 2, log.count("DEBUG", "Handler returned error"))
	require.Equal(t, 1, log.count("ERROR", "poison queue: publish failed"))
	require.Equal(t, 1, log.count("ERROR", "provider said 503"))
}
