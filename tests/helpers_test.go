package tests

// Shared helpers of the end-to-end tests. They are used by dedup_test.go,
// concurrency_test.go and retry_test.go, and meant for the other files of
// this package too (fault tests and the like). Conventions:
//
//   - every helper takes the test first and fails it with require (only from
//     the test's goroutine) or with t.Errorf (from other goroutines);
//   - everything a helper creates (tables, queues, routers, connections) is
//     cleaned up at the end of the test through t.Cleanup;
//   - waits are bounded (e2eTimeout) and await an observable state.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// e2eTimeout bounds every wait of these tests (messages to be processed,
// relayed, received).
const e2eTimeout = 30 * time.Second

// ---------------------------------------------------------------------------
// Business effects table

// effectsTable is the "business" table the test handlers write to, one row
// per handler run that committed: msg_key is the message key, attempt the
// handler run number for that key (1 for the first run), at the database
// clock time the row was written.
type effectsTable struct {
	// Name is the quoted, schema-qualified table name.
	Name string
	db   wsql.ContextExecutor
}

// createEffectsTable creates the effects table in the test schema of
// tables (from testenv.Schema, so it is dropped with the schema).
func createEffectsTable(t testing.TB, d testenv.Driver, tables sqlschema.Config) effectsTable {
	t.Helper()
	name := pgx.Identifier{tables.Schema, "effects"}.Sanitize()
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	_, err := d.DB.ExecContext(ctx, `CREATE TABLE `+name+` (
    id         bigserial   PRIMARY KEY,
    msg_key    text        NOT NULL,
    attempt    integer     NOT NULL,
    written_at timestamptz NOT NULL DEFAULT clock_timestamp()
)`)
	require.NoError(t, err)
	return effectsTable{Name: name, db: d.DB}
}

// Insert writes one effect row through the transaction the exactly-once
// middleware put in ctx, whichever driver it is (PgxTxFromContext or
// StdTxFromContext). It fails when ctx holds no transaction: a handler must
// never write outside the middleware's transaction.
func (e effectsTable) Insert(ctx context.Context, key string, attempt int) error {
	q := `INSERT INTO ` + e.Name + ` (msg_key, attempt) VALUES ($1, $2)`
	if tx, ok := middleware.PgxTxFromContext(ctx); ok {
		_, err := tx.Exec(ctx, q, key, attempt)
		return err
	}
	if tx, ok := middleware.StdTxFromContext(ctx); ok {
		_, err := tx.ExecContext(ctx, q, key, attempt)
		return err
	}
	return errors.New("no exactly-once transaction in the handler's context")
}

// Count returns the number of committed effect rows of key ("" for all).
func (e effectsTable) Count(t testing.TB, key string) int64 {
	t.Helper()
	if key == "" {
		return countRows(t, e.db, `SELECT count(*) FROM `+e.Name)
	}
	return countRows(t, e.db, `SELECT count(*) FROM `+e.Name+` WHERE msg_key = $1`, key)
}

// Attempts returns the attempt numbers of the committed rows of key, in
// insertion order.
func (e effectsTable) Attempts(t testing.TB, key string) []int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	rows, err := e.db.QueryContext(ctx, `SELECT attempt FROM `+e.Name+` WHERE msg_key = $1 ORDER BY id`, key)
	require.NoError(t, err)
	var out []int
	for rows.Next() {
		var a int
		require.NoError(t, rows.Scan(&a))
		out = append(out, a)
	}
	require.NoError(t, seam.Close(rows))
	return out
}

// countRows runs a `SELECT count(*) ...` query and returns the count.
func countRows(t testing.TB, db wsql.ContextExecutor, query string, args ...any) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	var n int64
	require.NoError(t, seam.QueryRow(ctx, db, query, args, &n), query)
	return n
}

// ---------------------------------------------------------------------------
// Inbox and outbox inspection

// inboxRecord returns the inbox record of (consumer, key); it fails the test
// if there is none.
func inboxRecord(t testing.TB, d testenv.Driver, tables sqlschema.Config, consumer, key string) inbox.Record {
	t.Helper()
	store, err := inbox.NewStore(inbox.Config{Tables: tables})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	rec, err := store.Lookup(ctx, d.DB, consumer, key)
	require.NoError(t, err)
	return rec
}

// outboxPending returns outbox.PendingStats' count of unrelayed rows.
func outboxPending(t testing.TB, d testenv.Driver, tables sqlschema.Config) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	p, err := outbox.PendingStats(ctx, d.DB, tables)
	require.NoError(t, err)
	return p.Count
}

// outboxRow is one unrelayed outbox row.
type outboxRow struct {
	Topic, UUID string
}

// outboxRows returns the unrelayed outbox rows in the order they were
// written.
func outboxRows(t testing.TB, d testenv.Driver, tables sqlschema.Config) []outboxRow {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	rows, err := d.DB.QueryContext(ctx, `SELECT topic, uuid FROM `+tables.Outbox()+` ORDER BY id`)
	require.NoError(t, err)
	var out []outboxRow
	for rows.Next() {
		var r outboxRow
		require.NoError(t, rows.Scan(&r.Topic, &r.UUID))
		out = append(out, r)
	}
	require.NoError(t, seam.Close(rows))
	return out
}

// relayOutbox runs an outbox.Relay (to a watermill-amqp publisher with
// confirms) until the outbox is empty and returns the number of messages it
// relayed. When it returns, RabbitMQ has confirmed every one of them.
func relayOutbox(t testing.TB, d testenv.Driver, tables sqlschema.Config) int {
	t.Helper()
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: d.DB, Publisher: testenv.AMQPPublisher(t), Tables: tables})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), e2eTimeout)
	defer cancel()
	total := 0
	for {
		n, err := relay.RelayOnce(ctx)
		require.NoError(t, err)
		if n == 0 {
			return total
		}
		total += n
	}
}

// ---------------------------------------------------------------------------
// Middleware observation

// eventLog records every middleware event with the time it was observed;
// its Observe method fits middleware.Config.OnEvent. It also keeps
// middleware.Counters.
type eventLog struct {
	middleware.Counters

	mu     sync.Mutex
	events []timedEvent
}

// timedEvent is an event and the time OnEvent received it (after the
// middleware finished with the message, before the router acks or nacks).
type timedEvent struct {
	middleware.Event
	At time.Time
}

// Observe records e; safe for concurrent use.
func (l *eventLog) Observe(e middleware.Event) {
	now := time.Now()
	l.Counters.Observe(e)
	l.mu.Lock()
	l.events = append(l.events, timedEvent{Event: e, At: now})
	l.mu.Unlock()
}

// Events returns a copy of the recorded events.
func (l *eventLog) Events() []timedEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]timedEvent(nil), l.events...)
}

// Settled is the number of deliveries the middleware acked (processed or
// duplicate).
func (l *eventLog) Settled() int64 {
	return l.Processed.Load() + l.Duplicates.Load()
}

// waitSettled waits until log has seen want acked deliveries
// (processed + duplicates), and fails if it sees more.
func waitSettled(t testing.TB, log *eventLog, want int64) {
	t.Helper()
	testenv.Eventually(t, e2eTimeout, func() bool { return log.Settled() >= want },
		"expected %d processed+duplicate deliveries", want)
	require.Equal(t, want, log.Settled(), "more deliveries settled than expected")
}

// countDeliveries returns a router middleware counting the deliveries that
// reach it. Added before the exactly-once middleware, it counts what the
// broker delivered (retries of Watermill's Retry middleware excluded when it
// is added after).
func countDeliveries(n *atomic.Int64) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			n.Add(1)
			return h(msg)
		}
	}
}

// ---------------------------------------------------------------------------
// Routers

// newRouter returns a Watermill router with a bounded close timeout. Start it
// with testenv.StartRouter, which also closes it at cleanup.
func newRouter(t testing.TB) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: e2eTimeout}, watermill.NopLogger{})
	require.NoError(t, err)
	return r
}

// closeRouter closes r (waiting for its handlers and subscribers to stop, so
// that every delivery is acked, nacked or back in the queue) and fails the
// test if it does not stop in time. Closing again at cleanup is harmless.
func closeRouter(t testing.TB, r *message.Router) {
	t.Helper()
	require.NoError(t, r.Close())
}

// addHandler registers h on r, consuming queue in with a fresh watermill-amqp
// subscriber (prefetch 1) and with out as the handler's publish topic, which
// the exactly-once middleware uses as the outbox destination of the
// messages h returns. The router's own publisher is routerMustNotPublish:
// with the middleware in place the router must never publish.
func addHandler(t testing.TB, r *message.Router, name, in, out string, h message.HandlerFunc) *message.Handler {
	t.Helper()
	return r.AddHandler(name, in, testenv.AMQPSubscriber(t, 0), out, routerMustNotPublish{t: t}, h)
}

// routerMustNotPublish is the router-side publisher of the handlers under
// test. The exactly-once middleware writes the handler's outputs to the
// outbox and returns none to the router, so any Publish is a failure (of
// the design's trap 1: outputs published by the router after the commit).
type routerMustNotPublish struct{ t testing.TB }

func (p routerMustNotPublish) Publish(topic string, msgs ...*message.Message) error {
	p.t.Errorf("the router published %d message(s) to %q: outputs must go through the outbox", len(msgs), topic)
	return errors.New("routerMustNotPublish: the router must not publish")
}

func (routerMustNotPublish) Close() error { return nil }

// ---------------------------------------------------------------------------
// RabbitMQ

// publishCopies publishes n messages with the same uuid and payload to
// queue (through a confirming watermill-amqp publisher: when it returns,
// RabbitMQ holds all of them).
func publishCopies(t testing.TB, pub message.Publisher, queue, uuid string, payload []byte, n int) {
	t.Helper()
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(uuid, payload)
	}
	require.NoError(t, pub.Publish(queue, msgs...))
}

// queueMessages returns the number of ready messages in queue
// (QueueDeclarePassive). Messages delivered but not yet acked are not
// counted: close the consumers first (closeRouter) to have them requeued,
// then a count of 0 means every delivery was acked.
func queueMessages(t testing.TB, queue string) int {
	t.Helper()
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	return q.Messages
}

// requireQueueDrained fails unless every delivery of queue was acked. Call
// it after the consumers of queue were closed.
//
// One leftover kind is tolerated and logged: a delivery the router handled
// and acked, but that watermill-amqp v3.1.0 requeued anyway because the
// router closed the subscriber while the ack was still on its way (its
// subscription picks at random between "acked" and "closing"). Such a copy
// is marked redelivered by RabbitMQ and its next consumer's inbox acks it
// as a duplicate. A message that was never delivered (not redelivered) still
// fails the test, and so does more than one leftover per handler.
func requireQueueDrained(t testing.TB, queue string) {
	t.Helper()
	if queueMessages(t, queue) == 0 {
		return
	}
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	left := 0
	for {
		d, ok, err := ch.Get(queue, true)
		require.NoError(t, err)
		if !ok {
			break
		}
		left++
		require.True(t, d.Redelivered, "queue %s holds a message that was never delivered", queue)
		t.Logf("queue %s: a delivery requeued at the router's close (ack in flight) was drained: headers %v", queue, d.Headers)
	}
	require.LessOrEqual(t, left, 2, "queue %s still held %d messages: some deliveries were not acked", queue, left)
}

// outputCollector is a downstream consumer of an output queue: it acks every
// message and records its UUID.
type outputCollector struct {
	sub  message.Subscriber
	done chan struct{}

	mu    sync.Mutex
	uuids []string
}

// collectOutputs starts consuming queue (declared by testenv.Queue).
func collectOutputs(t testing.TB, queue string) *outputCollector {
	t.Helper()
	c := &outputCollector{sub: testenv.AMQPSubscriber(t, 0), done: make(chan struct{})}
	msgs, err := c.sub.Subscribe(context.Background(), queue)
	require.NoError(t, err)
	go func() {
		defer close(c.done)
		for msg := range msgs {
			c.mu.Lock()
			c.uuids = append(c.uuids, msg.UUID)
			c.mu.Unlock()
			msg.Ack()
		}
	}()
	t.Cleanup(func() { c.Stop(t) })
	return c
}

// UUIDs returns the UUIDs received so far, in arrival order.
func (c *outputCollector) UUIDs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.uuids...)
}

// WaitFor waits until at least n messages arrived.
func (c *outputCollector) WaitFor(t testing.TB, n int) {
	t.Helper()
	testenv.Eventually(t, e2eTimeout, func() bool { return len(c.UUIDs()) >= n },
		"expected %d message(s) on the output queue", n)
}

// Stop closes the subscriber and waits until the collecting goroutine ended:
// afterwards UUIDs is final and nothing is left unacked. Calling it again
// (it also runs at cleanup) is harmless.
func (c *outputCollector) Stop(t testing.TB) {
	t.Helper()
	if err := c.sub.Close(); err != nil {
		t.Errorf("closing the output collector: %v", err)
	}
	select {
	case <-c.done:
	case <-time.After(e2eTimeout):
		t.Errorf("output collector did not stop within %s", e2eTimeout)
	}
}

// requireExactlyOneOutput relays the outbox to RabbitMQ and checks that
// exactly one message, with UUID want, arrives on the output queue out:
// the relay sends one message, the downstream consumer receives it, and once
// that consumer stopped nothing else is left in the queue.
func requireExactlyOneOutput(t testing.TB, d testenv.Driver, tables sqlschema.Config, out, want string) {
	t.Helper()
	collector := collectOutputs(t, out)
	require.Equal(t, 1, relayOutbox(t, d, tables), "relayed messages")
	require.Zero(t, outboxPending(t, d, tables), "outbox rows left after the relay")
	collector.WaitFor(t, 1)
	collector.Stop(t)
	require.Equal(t, []string{want}, collector.UUIDs(), "messages received downstream")
	requireQueueDrained(t, out)
}

// ---------------------------------------------------------------------------
// Test bundle

// e2e is the bundle of one end-to-end test for one driver: its own schema
// (inbox and outbox tables), effects table, input and output queues, and
// the event log the middleware reports to.
type e2e struct {
	Driver  testenv.Driver
	Tables  sqlschema.Config
	Effects effectsTable
	// In is the queue the router consumes; Out the handler's publish topic,
	// which the relay publishes the outbox rows to.
	In, Out string
	Log     *eventLog
}

// setupE2E creates the bundle for driver d.
func setupE2E(t testing.TB, d testenv.Driver) *e2e {
	t.Helper()
	tables := testenv.Schema(t)
	return &e2e{
		Driver:  d,
		Tables:  tables,
		Effects: createEffectsTable(t, d, tables),
		In:      testenv.Queue(t, "in_"),
		Out:     testenv.Queue(t, "out_"),
		Log:     &eventLog{},
	}
}

// Middleware returns an exactly-once middleware on the bundle's database and
// tables, reporting to its event log; cfg supplies the other fields.
func (e *e2e) Middleware(t testing.TB, cfg middleware.Config) *middleware.Middleware {
	t.Helper()
	cfg.DB = e.Driver.DB
	cfg.Tables = e.Tables
	cfg.OnEvent = e.Log.Observe
	eo, err := middleware.New(cfg)
	require.NoError(t, err)
	return eo
}

// runCounter counts handler runs per message key; safe for concurrent use.
type runCounter struct {
	mu   sync.Mutex
	runs map[string]int
}

// Next records one more run of key and returns its number (1 for the first).
func (c *runCounter) Next(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.runs == nil {
		c.runs = map[string]int{}
	}
	c.runs[key]++
	return c.runs[key]
}

// Get returns the number of runs of key.
func (c *runCounter) Get(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[key]
}

// Total returns the number of runs of all keys.
func (c *runCounter) Total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, r := range c.runs {
		n += r
	}
	return n
}

// outputUUID is the UUID a test handler gives the output message of run
// attempt of key, so that a test can tell which run's output was kept.
func outputUUID(key string, attempt int) string {
	return fmt.Sprintf("%s-out-%d", key, attempt)
}
