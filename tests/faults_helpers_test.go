package tests

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/url"
	"os"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Helpers of the fault tests (crash_test.go, relay_crash_test.go,
// failure_modes_test.go). Names start with "fault" to stay apart from the
// other test files of the package.

// faultWait bounds every wait of the fault tests.
const faultWait = 30 * time.Second

// faultCtx returns a context bounded by faultWait, cancelled at cleanup.
func faultCtx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), faultWait)
	t.Cleanup(cancel)
	return ctx
}

// faultDriver returns the driver named name ("pgxpool" or "database-sql"),
// connected to testenv.DatabaseURL. Used by worker subprocesses, which get
// the driver's name from their parent.
func faultDriver(t testing.TB, name string) testenv.Driver {
	t.Helper()
	for _, d := range testenv.Drivers(t) {
		if d.Name == name {
			return d
		}
	}
	t.Fatalf("unknown driver %q", name)
	return testenv.Driver{}
}

// faultDriverVia returns a driver of the same kind as like, connecting to
// PostgreSQL through dbURL (a proxy address), closed at cleanup. No
// connection is made here: the proxy may be refusing.
func faultDriverVia(t testing.TB, like testenv.Driver, dbURL string) testenv.Driver {
	t.Helper()
	switch like.Name {
	case "pgxpool":
		cfg, err := pgxpool.ParseConfig(dbURL)
		require.NoError(t, err)
		cfg.MaxConns = 4
		cfg.ConnConfig.ConnectTimeout = 5 * time.Second
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		return testenv.Driver{Name: like.Name, DB: wsql.BeginnerFromPgx(pool)}
	case "database-sql":
		cfg, err := pgx.ParseConfig(dbURL)
		require.NoError(t, err)
		cfg.ConnectTimeout = 5 * time.Second
		db := stdlib.OpenDB(*cfg)
		db.SetMaxOpenConns(4)
		t.Cleanup(func() { _ = db.Close() })
		return testenv.Driver{Name: like.Name, DB: wsql.BeginnerFromStdSQL(db)}
	}
	t.Fatalf("unknown driver %q", like.Name)
	return testenv.Driver{}
}

// faultTable returns the quoted name of table in the test's schema.
func faultTable(tables sqlschema.Config, table string) string {
	return pgx.Identifier{tables.Schema, table}.Sanitize()
}

// faultCreateEffects creates the business table "effects" in the test's
// schema: one row per applied effect, id unique, so a second application of
// the same effect would fail loudly instead of hiding.
func faultCreateEffects(t testing.TB, db wsql.ContextExecutor, tables sqlschema.Config) {
	t.Helper()
	_, err := db.ExecContext(context.Background(),
		"CREATE TABLE "+faultTable(tables, "effects")+" (id text PRIMARY KEY, note text NOT NULL DEFAULT '')")
	require.NoError(t, err)
}

// faultInsertEffect inserts an effect row through the handler's transaction,
// whichever driver the middleware uses.
func faultInsertEffect(ctx context.Context, tables sqlschema.Config, id, note string) error {
	q := "INSERT INTO " + faultTable(tables, "effects") + " (id, note) VALUES ($1, $2)"
	if tx, ok := middleware.PgxTxFromContext(ctx); ok {
		_, err := tx.Exec(ctx, q, id, note)
		return err
	}
	if tx, ok := middleware.StdTxFromContext(ctx); ok {
		_, err := tx.ExecContext(ctx, q, id, note)
		return err
	}
	return errors.New("no transaction in the handler's context")
}

// faultCount runs a count query.
func faultCount(t testing.TB, db wsql.ContextExecutor, q string, args ...any) int64 {
	t.Helper()
	var n int64
	require.NoError(t, seam.QueryRow(context.Background(), db, q, args, &n))
	return n
}

// faultEffects counts the rows of the effects table.
func faultEffects(t testing.TB, db wsql.ContextExecutor, tables sqlschema.Config) int64 {
	t.Helper()
	return faultCount(t, db, "SELECT count(*) FROM "+faultTable(tables, "effects"))
}

// faultQueueState returns the number of ready messages and of consumers of
// a queue, as RabbitMQ reports them (unacked deliveries are not "ready").
func faultQueueState(t testing.TB, conn *amqp.Connection, queue string) (messages, consumers int) {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	return q.Messages, q.Consumers
}

// faultRequireQueueSettled waits until queue has no consumer left (so every
// delivery that was not acked is back in the queue) and then requires it to
// hold exactly want ready messages.
func faultRequireQueueSettled(t testing.TB, conn *amqp.Connection, queue string, want int) {
	t.Helper()
	testenv.Eventually(t, faultWait, func() bool {
		_, consumers := faultQueueState(t, conn, queue)
		return consumers == 0
	}, "queue %s still has a consumer", queue)
	// A requeued delivery is visible as soon as its consumer is gone.
	msgs, _ := faultQueueState(t, conn, queue)
	require.Equal(t, want, msgs, "ready messages in queue %s", queue)
}

// faultDrain takes every ready message off queue (acking them) and returns
// them; it stops at the first empty Get.
func faultDrain(t testing.TB, conn *amqp.Connection, queue string) []amqp.Delivery {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	var out []amqp.Delivery
	for range 100000 {
		d, ok, err := ch.Get(queue, true)
		require.NoError(t, err)
		if !ok {
			return out
		}
		out = append(out, d)
	}
	t.Fatalf("queue %s never ran dry", queue)
	return nil
}

// faultUUIDOf returns the Watermill UUID header of a raw delivery.
func faultUUIDOf(d amqp.Delivery) string {
	s, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
	return s
}

// faultNewRouter returns a router with a short close timeout and no logs
// (the fault tests provoke errors on purpose; their outcome is asserted, not
// logged).
func faultNewRouter(t testing.TB) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	return r
}

// faultEvents records the middleware's events (Config.OnEvent) on top of
// Counters, so a test can inspect the errors returned to the router.
type faultEvents struct {
	middleware.Counters
	mu     sync.Mutex
	events []middleware.Event
}

// Observe fits Config.OnEvent.
func (e *faultEvents) Observe(ev middleware.Event) {
	e.mu.Lock()
	e.events = append(e.events, ev)
	e.mu.Unlock()
	e.Counters.Observe(ev)
}

// Of returns the recorded events of kind k.
func (e *faultEvents) Of(k middleware.EventKind) []middleware.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []middleware.Event
	for _, ev := range e.events {
		if ev.Kind == k {
			out = append(out, ev)
		}
	}
	return out
}

// faultDeliveries is a router middleware, placed outermost, that records
// the UUID of every delivery the router hands to the handler chain.
type faultDeliveries struct {
	mu   sync.Mutex
	seen map[string]int
	n    int
}

func (d *faultDeliveries) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d.mu.Lock()
		if d.seen == nil {
			d.seen = map[string]int{}
		}
		d.seen[msg.UUID]++
		d.n++
		d.mu.Unlock()
		return h(msg)
	}
}

// Total is the number of deliveries seen.
func (d *faultDeliveries) Total() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.n
}

// Seen returns a copy of the deliveries per UUID.
func (d *faultDeliveries) Seen() map[string]int {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[string]int, len(d.seen))
	for k, v := range d.seen {
		out[k] = v
	}
	return out
}

// Worker subprocesses: a test re-executes its own test binary with
// -test.run selecting a worker test and faultWorkerEnv set, so that the
// worker can die for real (os.Exit) in the middle of its work while the
// parent test survives to check what the crash left behind.

// faultWorkerEnv selects the worker role in the subprocess; worker tests
// return at once when it is unset.
const faultWorkerEnv = "EXACTLYONCE_FAULT_WORKER"

// faultRunWorker runs the test binary's test named testName as a worker
// subprocess with env added, waits for it to exit (bounded), and returns its
// exit code and combined output.
func faultRunWorker(t testing.TB, testName string, env map[string]string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+testName+"$", "-test.v", "-test.count=1", "-test.timeout=80s")
	cmd.Env = append(os.Environ(), faultWorkerEnv+"="+testName)
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	require.NoError(t, ctx.Err(), "worker %s did not exit in time; output:\n%s", testName, out.String())
	if err == nil {
		return 0, out.String()
	}
	var exitErr *exec.ExitError
	require.ErrorAs(t, err, &exitErr, "running worker %s; output:\n%s", testName, out.String())
	return exitErr.ExitCode(), out.String()
}

// faultIsWorker reports whether this process is the worker subprocess for
// testName.
func faultIsWorker(testName string) bool {
	return os.Getenv(faultWorkerEnv) == testName
}

// faultEnv reads a variable the parent passed to a worker.
func faultEnv(t testing.TB, key string) string {
	t.Helper()
	v := os.Getenv(key)
	require.NotEmpty(t, v, "worker needs %s", key)
	return v
}

// faultRelayAll runs relay batch after batch until the outbox is empty
// (bounded by faultWait) and returns the number of messages it relayed.
func faultRelayAll(t testing.TB, relay *outbox.Relay, db wsql.ContextExecutor, tables sqlschema.Config) int {
	t.Helper()
	ctx := faultCtx(t)
	total := 0
	for ctx.Err() == nil {
		n, err := relay.RelayOnce(ctx)
		require.NoError(t, err)
		total += n
		if n > 0 {
			continue
		}
		p, err := outbox.PendingStats(ctx, db, tables)
		require.NoError(t, err)
		if p.Count == 0 {
			return total
		}
		// Rows still locked by a transaction that is ending (a crashed
		// relay's backend notices its client is gone): poll again.
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Fatalf("outbox not empty after %s", faultWait)
	return total
}

// faultPending is the number of rows waiting in the outbox.
func faultPending(t testing.TB, db wsql.ContextExecutor, tables sqlschema.Config) int64 {
	t.Helper()
	p, err := outbox.PendingStats(context.Background(), db, tables)
	require.NoError(t, err)
	return p.Count
}

// faultDBAddr is the host:port of testenv.DatabaseURL, the target of a
// database proxy.
func faultDBAddr(t testing.TB) string {
	t.Helper()
	u, err := url.Parse(testenv.DatabaseURL())
	require.NoError(t, err)
	if u.Port() == "" {
		return net.JoinHostPort(u.Hostname(), "5432")
	}
	return u.Host
}
