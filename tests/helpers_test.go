package tests

// The one set of helpers of the end-to-end tests. Conventions:
//
//   - every helper takes the test first and fails it with require (only from
//     the test's goroutine) or with t.Errorf (from other goroutines);
//   - everything a helper creates (tables, queues, routers, connections,
//     subprocesses) is cleaned up at the end of the test through t.Cleanup;
//   - waits are bounded (waitTimeout) and await an observable state.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"sync"
	"syscall"
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

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// waitTimeout bounds every wait of these tests (messages to be processed,
// relayed, received; routers and subprocesses to stop).
const waitTimeout = 30 * time.Second

// testCtx returns a context bounded by waitTimeout, cancelled at cleanup.
func testCtx(t testing.TB) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	t.Cleanup(cancel)
	return ctx
}

// ---------------------------------------------------------------------------
// Test bundle

// e2e is the bundle of one end-to-end test for one driver: testenv's
// bundle (its own schema with the inbox and outbox tables, reached through
// the driver), an effects table, input and output queues, a RabbitMQ
// connection for inspection, a confirming publisher, and the event log the
// middleware reports to.
type e2e struct {
	*testenv.Bundle
	Effects effectsTable
	// In is the queue the router consumes; Out the handler's publish topic,
	// which the relay publishes the outbox rows to.
	In, Out string
	Conn    *amqp.Connection
	Pub     message.Publisher
	Log     *eventLog
}

// setupE2E creates the bundle for driver d.
func setupE2E(t testing.TB, d testenv.Driver) *e2e {
	t.Helper()
	b := testenv.NewBundle(t, d)
	return &e2e{
		Bundle:  b,
		Effects: createEffectsTable(t, b),
		In:      testenv.Queue(t, "in_"),
		Out:     testenv.Queue(t, "out_"),
		Conn:    testenv.AMQPConn(t),
		Pub:     testenv.AMQPPublisher(t),
		Log:     &eventLog{},
	}
}

// eachDriver runs f once per driver (testenv.ForEachDriver) with an e2e
// bundle.
func eachDriver(t *testing.T, f func(t *testing.T, e *e2e)) {
	t.Helper()
	testenv.ForEachDriver(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		f(t, setupE2E(t, d))
	})
}

// Middleware returns an exactly-once middleware on the bundle's database and
// tables, reporting to its event log and then to cfg.OnEvent, if set; cfg
// supplies the other fields (see newMiddleware).
func (e *e2e) Middleware(t testing.TB, cfg exactlyonce.Config) *exactlyonce.Guard {
	t.Helper()
	cfg.DB = e.DB
	also := cfg.OnEvent
	cfg.OnEvent = func(ev exactlyonce.Event) {
		e.Log.Observe(ev)
		if also != nil {
			also(ev)
		}
	}
	return newMiddleware(t, cfg)
}

// newMiddleware returns exactlyonce.New(cfg), silent unless cfg.Logger is
// set (the tests provoke failures on purpose and assert them).
func newMiddleware(t testing.TB, cfg exactlyonce.Config) *exactlyonce.Guard {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	eo, err := exactlyonce.New(cfg)
	require.NoError(t, err)
	return eo
}

// driverVia returns a driver of the same kind as like, connecting to
// PostgreSQL through dbURL (a proxy address) with at most 4 connections and
// a 5s connect timeout, closed at cleanup. No connection is made here: the
// proxy may be refusing.
func driverVia(t testing.TB, like testenv.Driver, dbURL string) testenv.Driver {
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

// dbAddr is the host:port of testenv.DatabaseURL, the target of a database
// proxy.
func dbAddr(t testing.TB) string {
	t.Helper()
	u, err := url.Parse(testenv.DatabaseURL())
	require.NoError(t, err)
	if u.Port() == "" {
		return net.JoinHostPort(u.Hostname(), "5432")
	}
	return u.Host
}

// ---------------------------------------------------------------------------
// Business effects table

// effectsTable is the "business" table the test handlers write to, one row
// per handler run that committed: msg_key is the message key, attempt the
// handler run number for that key (1 for the first run), note what the
// handler wants to leave there, at the database clock time the row was
// written.
type effectsTable struct {
	// Name is the quoted, schema-qualified table name.
	Name string
	db   wsql.ContextExecutor
}

// effectsOf is the effects table of db's schema, reached through db.Conn
// (created by createEffectsTable, maybe by another process).
func effectsOf(db sqlschema.DB) effectsTable {
	return effectsTable{Name: pgx.Identifier{db.Schema, "effects"}.Sanitize(), db: db.Conn}
}

// createEffectsTable creates the effects table in the bundle's schema (so
// it is dropped with the schema).
func createEffectsTable(t testing.TB, b *testenv.Bundle) effectsTable {
	t.Helper()
	e := effectsOf(b.DB)
	b.Exec(t, `CREATE TABLE `+e.Name+` (
    id         bigserial   PRIMARY KEY,
    msg_key    text        NOT NULL,
    attempt    integer     NOT NULL,
    note       text        NOT NULL DEFAULT '',
    written_at timestamptz NOT NULL DEFAULT clock_timestamp()
)`)
	return e
}

// Insert writes one effect row through the transaction the exactly-once
// middleware put in ctx, whichever driver it is (testenv.Exec). It fails
// when ctx holds no transaction: a handler must never write outside the
// middleware's transaction.
func (e effectsTable) Insert(ctx context.Context, key string, attempt int) error {
	return e.InsertNote(ctx, key, attempt, "")
}

// InsertNote is Insert with a note.
func (e effectsTable) InsertNote(ctx context.Context, key string, attempt int, note string) error {
	return testenv.Exec(ctx, `INSERT INTO `+e.Name+` (msg_key, attempt, note) VALUES ($1, $2, $3)`, key, attempt, note)
}

// Count returns the number of committed effect rows of key ("" for all).
func (e effectsTable) Count(t testing.TB, key string) int64 {
	t.Helper()
	if key == "" {
		return testenv.Count(t, e.db, `SELECT count(*) FROM `+e.Name)
	}
	return testenv.Count(t, e.db, `SELECT count(*) FROM `+e.Name+` WHERE msg_key = $1`, key)
}

// Attempts returns the attempt numbers of the committed rows of key, in
// insertion order.
func (e effectsTable) Attempts(t testing.TB, key string) []int {
	t.Helper()
	return queryColumn[int](t, e.db, `SELECT attempt FROM `+e.Name+` WHERE msg_key = $1 ORDER BY id`, key)
}

// Notes returns the notes of the committed rows of key, in insertion order.
func (e effectsTable) Notes(t testing.TB, key string) []string {
	t.Helper()
	return queryColumn[string](t, e.db, `SELECT note FROM `+e.Name+` WHERE msg_key = $1 ORDER BY id`, key)
}

// queryColumn runs a query of one column and returns its values in order.
func queryColumn[T any](t testing.TB, db wsql.ContextExecutor, query string, args ...any) []T {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	rows, err := db.QueryContext(ctx, query, args...)
	require.NoError(t, err, query)
	var out []T
	for rows.Next() {
		var v T
		require.NoError(t, rows.Scan(&v))
		out = append(out, v)
	}
	require.NoError(t, seam.Close(rows))
	return out
}

// ---------------------------------------------------------------------------
// Inbox and outbox inspection

// inboxStore returns the operator's inbox store on db.
func inboxStore(t testing.TB, db sqlschema.DB) *inbox.Store {
	t.Helper()
	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	return store
}

// inboxRecord returns the inbox record of (consumer, key); it fails the test
// if there is none.
func inboxRecord(t testing.TB, db sqlschema.DB, consumer, key string) inbox.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	rec, err := inboxStore(t, db).Get(ctx, consumer, key)
	require.NoError(t, err)
	return rec
}

// inboxStats returns the inbox statistics of consumer.
func inboxStats(t testing.TB, db sqlschema.DB, consumer string) inbox.Stats {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	st, err := inboxStore(t, db).Stats(ctx, consumer)
	require.NoError(t, err)
	return st
}

// outboxPending returns outbox.PendingStats' count of unrelayed rows.
func outboxPending(t testing.TB, db sqlschema.DB) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	p, err := testenv.OutboxStore(t, db).Pending(ctx)
	require.NoError(t, err)
	return p.Count
}

// outboxRow is one unrelayed outbox row.
type outboxRow struct {
	Topic, UUID string
}

// outboxRows returns the unrelayed outbox rows in the order they were
// written.
func outboxRows(t testing.TB, db sqlschema.DB) []outboxRow {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	rows, err := db.Conn.QueryContext(ctx, `SELECT topic, uuid FROM `+db.Outbox()+` ORDER BY id`)
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

// newRelay returns outbox.NewRelay(cfg), silent unless cfg.Logger is set.
func newRelay(t testing.TB, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	relay, err := outbox.NewRelay(cfg)
	require.NoError(t, err)
	return relay
}

// relayAll runs relay batch after batch until db's outbox is empty
// (bounded by waitTimeout), requiring every batch to succeed, and returns
// the number of messages it relayed.
func relayAll(t testing.TB, relay *outbox.Relay, db sqlschema.DB) int {
	t.Helper()
	ctx := testCtx(t)
	total := 0
	for ctx.Err() == nil {
		n, err := relay.Flush(ctx)
		require.NoError(t, err)
		total += n
		if n > 0 {
			continue
		}
		p, err := testenv.OutboxStore(t, db).Pending(ctx)
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
	t.Fatalf("outbox not empty after %s", waitTimeout)
	return total
}

// relayOutbox relays db's outbox to RabbitMQ (a watermill-amqp publisher
// with confirms) until it is empty (relayAll) and returns the number of
// messages relayed. When it returns, RabbitMQ has confirmed every one.
func relayOutbox(t testing.TB, db sqlschema.DB) int {
	t.Helper()
	return relayAll(t, newRelay(t, outbox.RelayConfig{DB: db, Publisher: testenv.AMQPPublisher(t)}), db)
}

// requireExactlyOneOutput relays the outbox to RabbitMQ and checks that
// exactly one message, with UUID want, arrives on the output queue out:
// the relay sends one message, the downstream consumer receives it, and once
// that consumer stopped nothing else is left in the queue.
func requireExactlyOneOutput(t testing.TB, db sqlschema.DB, out, want string) {
	t.Helper()
	c := collect(t, out)
	require.Equal(t, 1, relayOutbox(t, db), "relayed messages")
	require.Zero(t, outboxPending(t, db), "outbox rows left after the relay")
	c.WaitFor(t, 1)
	c.Stop(t)
	require.Equal(t, []string{want}, c.UUIDs(), "messages received downstream")
	requireQueueDrained(t, out)
}

// ---------------------------------------------------------------------------
// Middleware observation

// eventLog records every middleware event with the time it was observed;
// its Observe method fits exactlyonce.Config.OnEvent. It also keeps
// testenv.Counters.
type eventLog struct {
	testenv.Counters

	mu     sync.Mutex
	events []timedEvent
}

// timedEvent is an event and the time OnEvent received it (after the
// middleware finished with the message, before the router acks or nacks).
type timedEvent struct {
	exactlyonce.Event
	At time.Time
}

// Observe records e; safe for concurrent use.
func (l *eventLog) Observe(e exactlyonce.Event) {
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

// Of returns the recorded events of outcome o whose error wraps sentinel
// (whatever their error when sentinel is nil), in order.
func (l *eventLog) Of(o exactlyonce.Outcome, sentinel error) []timedEvent {
	var out []timedEvent
	for _, ev := range l.Events() {
		if ev.Outcome == o && (sentinel == nil || errors.Is(ev.Err, sentinel)) {
			out = append(out, ev)
		}
	}
	return out
}

// OfKey returns the recorded events of key, in order.
func (l *eventLog) OfKey(key string) []timedEvent {
	var out []timedEvent
	for _, ev := range l.Events() {
		if ev.Key == key {
			out = append(out, ev)
		}
	}
	return out
}

// Settled is the number of deliveries the middleware acked as processed or
// duplicate.
func (l *eventLog) Settled() int64 {
	return l.Processed.Load() + l.Duplicates.Load()
}

// Acked is the number of deliveries the middleware acked: processed,
// parked or duplicate.
func (l *eventLog) Acked() int64 {
	return l.Processed.Load() + l.Parked.Load() + l.Duplicates.Load()
}

// waitSettled waits until log has seen want acked deliveries
// (processed + duplicates), and fails if it sees more.
func waitSettled(t testing.TB, log *eventLog, want int64) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, func() bool { return log.Settled() >= want },
		"expected %d processed+duplicate deliveries", want)
	require.Equal(t, want, log.Settled(), "more deliveries settled than expected")
}

// deliveryLog is a router middleware recording every delivery that reaches
// it: added before (outside) the exactly-once middleware, it records what
// the broker delivered (retries of Watermill's Retry middleware excluded
// when that is added after it). Safe for concurrent use.
type deliveryLog struct {
	mu          sync.Mutex
	seen        map[string]int
	redelivered []bool
	n           int
}

// Middleware fits router.AddMiddleware.
func (d *deliveryLog) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d.mu.Lock()
		if d.seen == nil {
			d.seen = map[string]int{}
		}
		d.seen[msg.UUID]++
		d.redelivered = append(d.redelivered, wamqp.IsMessageRedelivered(msg))
		d.n++
		d.mu.Unlock()
		return h(msg)
	}
}

// Total is the number of deliveries seen.
func (d *deliveryLog) Total() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return int64(d.n)
}

// Seen returns a copy of the deliveries per message UUID.
func (d *deliveryLog) Seen() map[string]int {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[string]int, len(d.seen))
	for k, v := range d.seen {
		out[k] = v
	}
	return out
}

// Redelivered returns, for each delivery in order, whether RabbitMQ marked
// it redelivered.
func (d *deliveryLog) Redelivered() []bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]bool(nil), d.redelivered...)
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

// topicMetadataKey is the metadata key under which the middleware carries
// SetDestination's topic to the outbox; it must never reach the broker.
const topicMetadataKey = "_exactlyonce_topic"

// ---------------------------------------------------------------------------
// Routers

// newRouter returns a Watermill router with a bounded close timeout and no
// logs (the tests provoke errors on purpose; their outcome is asserted, not
// logged). Start it with testenv.StartRouter, which also closes it at
// cleanup.
func newRouter(t testing.TB) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: waitTimeout}, watermill.NopLogger{})
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
// messages h returns. The router's own publisher is outboxOnly: with the
// middleware in place the router must never publish.
func addHandler(t testing.TB, r *message.Router, name, in, out string, h message.HandlerFunc) *message.Handler {
	t.Helper()
	return r.AddHandler(name, in, testenv.AMQPSubscriber(t, 0), out, outboxOnly(t), h)
}

// outboxOnly is the router-side publisher of the handlers under test:
// exactlyonce.OutboxOnly, which refuses whatever the router publishes, and
// fails the test when that happens. The exactly-once middleware writes the
// handler's outputs to the outbox and returns none to the router, so any
// Publish is a failure (of the design's trap 1: outputs published by the
// router after the commit).
func outboxOnly(t testing.TB) message.Publisher {
	return outboxOnlyPublisher{t: t, Publisher: exactlyonce.OutboxOnly()}
}

type outboxOnlyPublisher struct {
	t testing.TB
	message.Publisher
}

func (p outboxOnlyPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.t.Errorf("the router published %d message(s) to %q: outputs must go through the outbox", len(msgs), topic)
	return p.Publisher.Publish(topic, msgs...)
}

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

// publishRaw publishes p (persistent) to queue with amqp091 directly, like
// a producer that is not Watermill, and waits for the broker's confirm.
func publishRaw(t testing.TB, conn *amqp.Connection, queue string, p amqp.Publishing) {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	require.NoError(t, ch.Confirm(false))
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	p.DeliveryMode = amqp.Persistent
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, p)
	require.NoError(t, err)
	ok, err := dc.WaitContext(ctx)
	require.NoError(t, err)
	require.True(t, ok, "broker nacked the publish")
}

// declareQueue declares a durable queue (deleted by the test's
// testenv.Queue cleanup when named <queue>_poison).
func declareQueue(t testing.TB, conn *amqp.Connection, queue string) {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	_, err = ch.QueueDeclare(queue, true, false, false, false, nil)
	require.NoError(t, err)
}

// queueState returns the number of ready messages and of consumers of a
// queue, as RabbitMQ reports them (QueueDeclarePassive). Messages delivered
// but not yet acked are not "ready": close the consumers first to have
// them requeued.
func queueState(t testing.TB, conn *amqp.Connection, queue string) (messages, consumers int) {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	return q.Messages, q.Consumers
}

// queueReady is queueState's number of ready messages.
func queueReady(t testing.TB, conn *amqp.Connection, queue string) int {
	t.Helper()
	n, _ := queueState(t, conn, queue)
	return n
}

// waitConsumers waits until queue has n consumers attached.
func waitConsumers(t testing.TB, conn *amqp.Connection, queue string, n int) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, func() bool {
		ch, err := conn.Channel()
		if err != nil {
			return false
		}
		defer func() { _ = ch.Close() }()
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		return err == nil && q.Consumers == n
	}, "queue %s never had %d consumers", queue, n)
}

// drainQueue takes every ready message off queue (acking them) and returns
// them; it stops at the first empty Get.
func drainQueue(t testing.TB, conn *amqp.Connection, queue string) []amqp.Delivery {
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

// uuidOf returns the Watermill UUID header of a raw delivery.
func uuidOf(d amqp.Delivery) string {
	s, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
	return s
}

// requireQueueSettled waits until queue has no consumer left (so every
// delivery that was not acked is back in the queue) and then requires it to
// hold exactly want ready messages.
func requireQueueSettled(t testing.TB, conn *amqp.Connection, queue string, want int) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, func() bool {
		_, consumers := queueState(t, conn, queue)
		return consumers == 0
	}, "queue %s still has a consumer", queue)
	// A requeued delivery is visible as soon as its consumer is gone.
	msgs, _ := queueState(t, conn, queue)
	require.Equal(t, want, msgs, "ready messages in queue %s", queue)
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
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	if msgs, _ := queueState(t, conn, queue); msgs == 0 {
		return
	}
	left := drainQueue(t, conn, queue)
	for _, d := range left {
		require.True(t, d.Redelivered, "queue %s holds a message that was never delivered", queue)
		t.Logf("queue %s: a delivery requeued at the router's close (ack in flight) was drained: headers %v", queue, d.Headers)
	}
	require.LessOrEqual(t, len(left), 2, "queue %s still held %d messages: some deliveries were not acked", queue, len(left))
}

// collector is a downstream consumer of an output queue: it acks every
// message and keeps it (UUID, payload, metadata), in arrival order.
type collector struct {
	sub  message.Subscriber
	done chan struct{}

	mu   sync.Mutex
	msgs []*message.Message
}

// collect starts consuming queue (declared by testenv.Queue).
func collect(t testing.TB, queue string) *collector {
	t.Helper()
	c := &collector{sub: testenv.AMQPSubscriber(t, 0), done: make(chan struct{})}
	msgs, err := c.sub.Subscribe(context.Background(), queue)
	require.NoError(t, err)
	go func() {
		defer close(c.done)
		for msg := range msgs {
			c.mu.Lock()
			c.msgs = append(c.msgs, msg)
			c.mu.Unlock()
			msg.Ack()
		}
	}()
	t.Cleanup(func() { c.Stop(t) })
	return c
}

// Count returns the number of messages received so far.
func (c *collector) Count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.msgs)
}

// UUIDs returns the UUIDs received so far, in arrival order.
func (c *collector) UUIDs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]string, 0, len(c.msgs))
	for _, m := range c.msgs {
		out = append(out, m.UUID)
	}
	return out
}

// Get returns the messages received with uuid.
func (c *collector) Get(uuid string) []*message.Message {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*message.Message
	for _, m := range c.msgs {
		if m.UUID == uuid {
			out = append(out, m)
		}
	}
	return out
}

// WaitFor waits until at least n messages arrived.
func (c *collector) WaitFor(t testing.TB, n int) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, func() bool { return c.Count() >= n },
		"expected %d message(s) on the output queue", n)
}

// Stop closes the subscriber and waits until the collecting goroutine ended:
// afterwards the messages are final and nothing is left unacked. Calling it
// again (it also runs at cleanup) is harmless.
func (c *collector) Stop(t testing.TB) {
	t.Helper()
	if err := c.sub.Close(); err != nil {
		t.Errorf("closing the output collector: %v", err)
	}
	select {
	case <-c.done:
	case <-time.After(waitTimeout):
		t.Errorf("output collector did not stop within %s", waitTimeout)
	}
}

// waitClosed waits, bounded by waitTimeout, until ch is closed.
func waitClosed(t testing.TB, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(waitTimeout):
		require.FailNow(t, "timed out waiting for "+what)
	}
}

// ---------------------------------------------------------------------------
// Worker subprocesses: a test re-executes its own test binary with
// -test.run selecting a worker test and workerEnvKey set, so that the worker
// can die for real (os.Exit, SIGKILL) in the middle of its work while the
// parent test survives to check what the crash left behind.

// workerEnvKey selects the worker role in the subprocess; worker tests
// return at once when it is unset.
const workerEnvKey = "EXACTLYONCE_FAULT_WORKER"

// isWorker reports whether this process is the worker subprocess for
// testName.
func isWorker(testName string) bool {
	return os.Getenv(workerEnvKey) == testName
}

// workerEnv reads a variable the parent passed to a worker.
func workerEnv(t testing.TB, key string) string {
	t.Helper()
	v := os.Getenv(key)
	require.NotEmpty(t, v, "worker needs %s", key)
	return v
}

// worker is a running worker subprocess.
type worker struct {
	cmd    *exec.Cmd
	out    bytes.Buffer // read only after exited is closed
	exited chan struct{}
}

// startWorker runs the test binary's test named testName as a worker
// subprocess with env added. At cleanup a worker still running is killed
// and awaited.
func startWorker(t testing.TB, testName string, env map[string]string) *worker {
	t.Helper()
	w := &worker{exited: make(chan struct{})}
	w.cmd = exec.Command(os.Args[0], "-test.run=^"+testName+"$", "-test.v", "-test.count=1", "-test.timeout=80s")
	w.cmd.Env = append(os.Environ(), workerEnvKey+"="+testName)
	for k, v := range env {
		w.cmd.Env = append(w.cmd.Env, k+"="+v)
	}
	w.cmd.Stdout = &w.out
	w.cmd.Stderr = &w.out
	require.NoError(t, w.cmd.Start())
	go func() {
		_ = w.cmd.Wait()
		close(w.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-w.exited:
			return
		default:
		}
		_ = w.cmd.Process.Kill()
		select {
		case <-w.exited:
		case <-time.After(waitTimeout):
			t.Errorf("worker pid %d did not exit after SIGKILL", w.cmd.Process.Pid)
		}
	})
	return w
}

// runWorker runs the worker testName with env (startWorker), waits for it
// to exit (bounded), and returns its exit code and combined output.
func runWorker(t testing.TB, testName string, env map[string]string) (int, string) {
	t.Helper()
	w := startWorker(t, testName, env)
	select {
	case <-w.exited:
	case <-time.After(90 * time.Second):
		_ = w.cmd.Process.Kill()
		<-w.exited
		t.Fatalf("worker %s did not exit in time; output:\n%s", testName, w.Output())
	}
	return w.cmd.ProcessState.ExitCode(), w.Output()
}

// Output returns the worker's combined output; only after it exited.
func (w *worker) Output() string {
	select {
	case <-w.exited:
		return w.out.String()
	default:
		return "(worker still running)"
	}
}

// KillAndWait sends SIGKILL to the worker, waits for it to exit, and
// requires that it died of that signal (not of its own accord).
func (w *worker) KillAndWait(t testing.TB) {
	t.Helper()
	require.NoError(t, w.cmd.Process.Kill())
	select {
	case <-w.exited:
	case <-time.After(waitTimeout):
		t.Fatalf("worker pid %d did not exit within %s of SIGKILL", w.cmd.Process.Pid, waitTimeout)
	}
	ws, ok := w.cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok, "wait status of type %T", w.cmd.ProcessState.Sys())
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL,
		"the worker must die of SIGKILL, got %s; output:\n%s", w.cmd.ProcessState, w.Output())
}
