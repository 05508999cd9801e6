package exactlyonce_test

// Group commit (Config.Batch). Most tests drive the wrapped handler
// directly from N goroutines (Config.Consumer set, no router), with
// BatchConfig.MaxSize = N and a MaxWait far longer than the test: the batch
// then runs only once all N deliveries joined it, so a test that returns in
// time proves they shared it.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// forever is a MaxWait no test waits for: a batch runs when it is full.
const forever = 10 * time.Minute

// eventLog records the middleware's events (Config.OnEvent).
type eventLog struct {
	mu     sync.Mutex
	events []exactlyonce.Event
}

func (l *eventLog) observe(e exactlyonce.Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, e)
}

// of returns the events of the deliveries of key, in the order they ended.
func (l *eventLog) of(key string) []exactlyonce.Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []exactlyonce.Event
	for _, e := range l.events {
		if e.Key == key {
			out = append(out, e)
		}
	}
	return out
}

// outcomes returns the outcomes of key's deliveries, sorted.
func (l *eventLog) outcomes(key string) []exactlyonce.Outcome {
	var out []exactlyonce.Outcome
	for _, e := range l.of(key) {
		out = append(out, e.Outcome)
	}
	slices.Sort(out)
	return out
}

func (l *eventLog) count(o exactlyonce.Outcome) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, e := range l.events {
		if e.Outcome == o {
			n++
		}
	}
	return n
}

// newBatchEO returns the middleware with group commit for consumer "c".
func newBatchEO(t *testing.T, db sqlschema.DB, batch exactlyonce.BatchConfig, log *eventLog, opts ...func(*exactlyonce.Config)) *exactlyonce.Guard {
	t.Helper()
	cfg := exactlyonce.Config{DB: db, Consumer: "c", PublishTopic: "out", Batch: &batch, NackDelay: -1,
		OnEvent: log.observe, Logger: testenv.Logger(t)}
	for _, o := range opts {
		o(&cfg)
	}
	eo, err := exactlyonce.New(cfg)
	require.NoError(t, err)
	return eo
}

type delivery struct {
	err  error
	took time.Duration
}

// deliver runs h for every message at once, each in its own goroutine as
// the router would, and returns what each returned, in the messages' order.
func deliver(t *testing.T, h message.HandlerFunc, msgs ...*message.Message) []delivery {
	t.Helper()
	out := make([]delivery, len(msgs))
	var wg sync.WaitGroup
	for i, msg := range msgs {
		wg.Go(func() {
			start := time.Now()
			_, err := h(msg)
			out[i] = delivery{err: err, took: time.Since(start)}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("deliveries did not return within 2 minutes")
	}
	return out
}

// msgs returns new messages whose UUIDs (keys) are the given keys.
func msgs(keys ...string) []*message.Message {
	out := make([]*message.Message, len(keys))
	for i, k := range keys {
		out[i] = message.NewMessage(k, []byte("{}"))
	}
	return out
}

func keyRange(prefix string, n int) []string {
	out := make([]string, n)
	for i := range n {
		out[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return out
}

// requireOneBatch: with MaxWait forever, returning at all means the batch
// was full: every delivery joined it.
func requireOneBatch(t *testing.T, ds []delivery) {
	t.Helper()
	for _, d := range ds {
		require.Less(t, d.took, time.Minute, "the deliveries should have filled one batch")
	}
}

func pgCode(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// sqlCode is err's SQLSTATE on PostgreSQL, its error number on MySQL.
func sqlCode(err error) string {
	if n, ok := pgerr.MySQLNumber(err); ok {
		return strconv.Itoa(int(n))
	}
	return pgCode(err)
}

// deadlockCode is sqlCode of a deadlock in the bundle's dialect.
func deadlockCode(b *testenv.Bundle) string { return b.SQL("40P01", "1213") }

func storeMax(v *atomic.Int64, n int64) {
	for {
		cur := v.Load()
		if n <= cur || v.CompareAndSwap(cur, n) {
			return
		}
	}
}

// inboxCount counts consumer "c"'s inbox rows of status for keys.
func inboxCount(t *testing.T, b *testenv.Bundle, status string, keys ...string) int64 {
	t.Helper()
	if b.MySQL() {
		args := []any{status}
		for _, k := range keys {
			args = append(args, k)
		}
		in := strings.TrimSuffix(strings.Repeat("?, ", len(keys)), ", ")
		return b.Count(t, "SELECT count(*) FROM "+b.DB.Inbox()+" WHERE consumer = 'c' AND status = ? AND message_key IN ("+in+")", args...)
	}
	return b.Count(t, "SELECT count(*) FROM "+b.DB.Inbox()+" WHERE consumer = 'c' AND status = $1 AND message_key = ANY($2)", status, keys)
}

// mysqlTxID identifies the session's current transaction on MariaDB
// without information_schema.innodb_trx (a cache up to 0.1s old): the
// connection, and how many transactions it ended before this one (its
// COMMIT and ROLLBACK statements).
const mysqlTxID = "SELECT connection_id() * 1000000 + (SELECT CAST(SUM(VARIABLE_VALUE) AS SIGNED) FROM information_schema.SESSION_STATUS " +
	"WHERE VARIABLE_NAME IN ('COM_COMMIT', 'COM_ROLLBACK'))"

// TestBatchOneTransaction: N deliveries in flight at once share one
// transaction (one txid for the handlers, the inbox rows and the outbox
// rows), handlers run in turn, and MaxSize bounds a batch.
func TestBatchOneTransaction(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		effects := b.Table("effects")
		b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL, txid bigint NOT NULL)")
		var inHandler, maxInHandler atomic.Int64
		h := func(msg *message.Message) ([]*message.Message, error) {
			storeMax(&maxInHandler, inHandler.Add(1))
			defer inHandler.Add(-1)
			var txid int64
			if err := testenv.QueryRow(msg.Context(), b.SQL("SELECT txid_current()", mysqlTxID), nil, &txid); err != nil {
				return nil, err
			}
			if err := testenv.Exec(msg.Context(), b.Q("INSERT INTO "+effects+" (id, txid) VALUES ($1, $2)"), msg.UUID, txid); err != nil {
				return nil, err
			}
			time.Sleep(time.Millisecond) // a second handler in parallel would show
			return []*message.Message{message.NewMessage("out-"+msg.UUID, []byte("{}"))}, nil
		}

		// MaxSize 10, 10 deliveries: one transaction.
		var log eventLog
		keys := keyRange("one-", 10)
		ds := deliver(t, newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 10, MaxWait: forever}, &log).Middleware(h), msgs(keys...)...)
		requireOneBatch(t, ds)
		for i, d := range ds {
			require.NoError(t, d.err, keys[i])
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed}, log.outcomes(keys[i]))
		}
		require.Equal(t, int64(10), b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id LIKE 'one-%'"))
		require.Equal(t, int64(1), b.Count(t, "SELECT count(DISTINCT txid) FROM "+effects+" WHERE id LIKE 'one-%'"), "one transaction")
		require.Equal(t, int64(1), maxInHandler.Load(), "handlers of a batch run in turn")
		if !b.MySQL() {
			// The inbox rows and the outbox rows were written by that
			// transaction (xmin: PostgreSQL's; on MySQL the batch's
			// statements all run in the transaction the handlers saw).
			require.Equal(t, int64(10), b.Count(t, "SELECT count(*) FROM "+b.DB.Inbox()+" i JOIN "+effects+
				" e ON e.id = i.message_key WHERE i.consumer = 'c' AND i.status = 'done' AND i.xmin::text::bigint = e.txid % 4294967296"))
			require.Equal(t, int64(10), b.Count(t, "SELECT count(*) FROM "+b.DB.Outbox()+" o JOIN "+effects+
				" e ON o.uuid = 'out-' || e.id WHERE o.xmin::text::bigint = e.txid % 4294967296"))
		}
		require.Equal(t, int64(10), b.Count(t, "SELECT count(*) FROM "+b.DB.Outbox()))

		// MaxSize 4, 10 deliveries: at least 3 transactions, none of more than 4.
		log = eventLog{}
		keys = keyRange("four-", 10)
		ds = deliver(t, newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 4, MaxWait: 200 * time.Millisecond}, &log).Middleware(h), msgs(keys...)...)
		for i, d := range ds {
			require.NoError(t, d.err, keys[i])
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed}, log.outcomes(keys[i]))
		}
		require.Equal(t, int64(10), b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id LIKE 'four-%'"))
		require.GreaterOrEqual(t, b.Count(t, "SELECT count(DISTINCT txid) FROM "+effects+" WHERE id LIKE 'four-%'"), int64(3))
		require.LessOrEqual(t, b.Count(t, "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM "+effects+" WHERE id LIKE 'four-%' GROUP BY txid) x"), int64(4),
			"no transaction holds more than MaxSize messages")
	})
}

// TestBatchFailureCostsOnlyItsMessage: in a batch of 10, a handler error, a
// panic, a failing statement (which aborts the transaction) or a Permanent
// error costs only its own message: the others commit exactly once
// (effect, inbox row, outbox row), the failed ones are nacked with their
// error and leave nothing; the Permanent one is parked and acked.
func TestBatchFailureCostsOnlyItsMessage(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		effects, taken := b.Table("effects"), b.Table("taken")
		b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL)")
		b.Exec(t, "CREATE TABLE "+taken+" (id "+b.KeyText()+" PRIMARY KEY)")
		b.Exec(t, "INSERT INTO "+taken+" VALUES ('taken')")
		behaviour := map[string]string{"a-3": "error", "a-6": "panic", "b-5": "abort", "c-2": "permanent"}
		h := func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if err := testenv.Exec(ctx, b.Q("INSERT INTO "+effects+" (id) VALUES ($1)"), msg.UUID); err != nil {
				return nil, err
			}
			switch behaviour[msg.UUID] {
			case "error":
				return nil, errors.New("handler failed: " + msg.UUID)
			case "panic":
				panic("handler panicked: " + msg.UUID)
			case "abort":
				if err := testenv.Exec(ctx, "INSERT INTO "+taken+" (id) VALUES ('taken')"); err != nil {
					return nil, err
				}
				return nil, errors.New("the unique violation did not happen")
			case "permanent":
				return nil, exactlyonce.Permanent(errors.New("invalid phone number"))
			}
			return []*message.Message{message.NewMessage("out-"+msg.UUID, []byte("{}"))}, nil
		}
		var log eventLog
		handler := newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 10, MaxWait: forever}, &log).Middleware(h)

		for _, prefix := range []string{"a-", "b-", "c-"} {
			keys := keyRange(prefix, 10)
			ds := deliver(t, handler, msgs(keys...)...)
			requireOneBatch(t, ds)
			var good []string
			for i, k := range keys {
				evs := log.of(k)
				require.Len(t, evs, 1, k)
				ev, err := evs[0], ds[i].err
				switch behaviour[k] {
				case "error":
					require.ErrorContains(t, err, "handler failed: "+k)
					require.Equal(t, exactlyonce.Nacked, ev.Outcome)
					require.Equal(t, err, ev.Err)
				case "panic":
					requirePanic(t, err, "handler panicked: "+k)
					require.Equal(t, exactlyonce.Nacked, ev.Outcome)
				case "abort":
					require.Error(t, err)
					require.Equal(t, b.SQL("23505", "1062"), sqlCode(err), "the statement's own error: %v", err)
					require.Equal(t, exactlyonce.Nacked, ev.Outcome)
				case "permanent":
					require.NoError(t, err, "a Permanent error parks the key and acks")
					require.Equal(t, exactlyonce.Parked, ev.Outcome)
					require.ErrorContains(t, ev.Err, "invalid phone number")
					require.Equal(t, int64(1), inboxCount(t, b, inboxdb.StatusParked, k))
				default:
					require.NoError(t, err, k)
					require.Equal(t, exactlyonce.Processed, ev.Outcome, k)
					good = append(good, k)
					continue
				}
				require.Zero(t, b.Count(t, b.Q("SELECT count(*) FROM "+effects+" WHERE id = $1"), k), "%s: its effect is rolled back", k)
				require.Zero(t, inboxCount(t, b, inboxdb.StatusDone, k), "%s: not recorded done", k)
			}
			failing := 0
			for _, k := range keys {
				if behaviour[k] != "" {
					failing++
				}
			}
			require.Len(t, good, 10-failing)
			for _, k := range good {
				require.Equal(t, int64(1), b.Count(t, b.Q("SELECT count(*) FROM "+effects+" WHERE id = $1"), k), "%s: one effect", k)
				require.Equal(t, int64(1), b.Count(t, b.Q("SELECT count(*) FROM "+b.DB.Outbox()+" WHERE uuid = $1"), "out-"+k), "%s: one output", k)
			}
			require.Equal(t, int64(len(good)), inboxCount(t, b, inboxdb.StatusDone, good...))
		}
		require.Equal(t, int64(1), b.Count(t, "SELECT count(*) FROM "+taken), "the aborted statement left nothing")

		// Redelivered, the committed ones are duplicates; the failed ones run.
		behaviour = map[string]string{}
		handler = newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 5, MaxWait: forever}, &log).Middleware(h)
		ds := deliver(t, handler, msgs("a-0", "a-3", "a-6", "b-5", "c-2")...)
		requireOneBatch(t, ds)
		for _, d := range ds {
			require.NoError(t, d.err)
		}
		require.Equal(t, exactlyonce.Duplicate, log.of("a-0")[1].Outcome)
		require.Equal(t, exactlyonce.Processed, log.of("a-3")[1].Outcome)
		require.Equal(t, exactlyonce.Processed, log.of("a-6")[1].Outcome)
		require.Equal(t, exactlyonce.Processed, log.of("b-5")[1].Outcome)
		require.Equal(t, exactlyonce.Parked, log.of("c-2")[1].Outcome, "a parked key stays parked")
		require.Equal(t, int64(29), b.Count(t, "SELECT count(*) FROM "+effects))
	})
}

// batchTracer counts the pgx batches (pipelines) a pool sends, and the
// statements in each.
type batchTracer struct {
	mu      sync.Mutex
	batches []int
	current map[*pgx.Conn]int
}

func (*batchTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (*batchTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (tr *batchTracer) TraceBatchStart(ctx context.Context, c *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.current[c] = 0
	return ctx
}
func (tr *batchTracer) TraceBatchQuery(_ context.Context, c *pgx.Conn, _ pgx.TraceBatchQueryData) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.current[c]++
}
func (tr *batchTracer) TraceBatchEnd(_ context.Context, c *pgx.Conn, _ pgx.TraceBatchEndData) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.batches = append(tr.batches, tr.current[c])
	delete(tr.current, c)
}

func (tr *batchTracer) take() []int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	out := tr.batches
	tr.batches = nil
	return out
}

// TestBatchExec: statements handlers give exactlyonce.Exec are
// applied with the batch. With pgx they are deferred: sent after the last
// handler ran, all in one pipeline (one round trip): no handler sees
// another's deferred write. With database/sql Exec runs the statement at
// once. A deferred statement that fails (a unique violation) fails only
// its own message.
func TestBatchExec(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		effects := b.Table("effects")
		b.Exec(t, "CREATE TABLE "+effects+" (id "+b.KeyText()+" PRIMARY KEY)")
		pgxDriver := b.Driver.Name == "pgxpool"
		db := b.DB
		tracer := &batchTracer{current: map[*pgx.Conn]int{}}
		if pgxDriver {
			cfg, err := pgxpool.ParseConfig(testenv.DatabaseURL())
			require.NoError(t, err)
			cfg.ConnConfig.Tracer = tracer
			cfg.MaxConns = 4
			pool, err := pgxpool.NewWithConfig(b.Ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			db = testenv.WithConn(db, wsql.BeginnerFromPgx(pool))
		}
		var mu sync.Mutex
		var seen []int64
		h := func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if err := exactlyonce.Exec(ctx, b.Q("INSERT INTO "+effects+" (id) VALUES ($1)"), msg.UUID); err != nil {
				return nil, err
			}
			var n int64
			if err := testenv.QueryRow(ctx, b.Q("SELECT count(*) FROM "+effects+" WHERE id LIKE $1"), []any{msg.UUID[:2] + "%"}, &n); err != nil {
				return nil, err
			}
			mu.Lock()
			seen = append(seen, n)
			mu.Unlock()
			return nil, nil
		}
		var log eventLog
		handler := newBatchEO(t, db, exactlyonce.BatchConfig{MaxSize: 10, MaxWait: forever}, &log).Middleware(h)

		keys := keyRange("q-", 10)
		ds := deliver(t, handler, msgs(keys...)...)
		requireOneBatch(t, ds)
		for i, d := range ds {
			require.NoError(t, d.err, keys[i])
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed}, log.outcomes(keys[i]))
		}
		require.Equal(t, int64(10), b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id LIKE 'q-%'"), "every queued write committed")
		slices.Sort(seen)
		if pgxDriver {
			require.Equal(t, make([]int64, 10), seen, "pgx: queued writes are sent after the last handler ran")
			require.Equal(t, []int{10}, tracer.take(), "pgx: the batch's queued writes travel in one pipeline")
		} else {
			require.Equal(t, []int64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, seen, "database/sql: Exec runs the statement at once")
		}

		// A queued write that fails: only its message is nacked.
		b.Exec(t, "INSERT INTO "+effects+" (id) VALUES ('r-dup')")
		keys = append(keyRange("r-", 9), "r-dup")
		ds = deliver(t, handler, msgs(keys...)...)
		requireOneBatch(t, ds)
		for i, k := range keys {
			if k == "r-dup" {
				require.Error(t, ds[i].err)
				require.Equal(t, b.SQL("23505", "1062"), sqlCode(ds[i].err), "the statement's own error: %v", ds[i].err)
				require.Equal(t, []exactlyonce.Outcome{exactlyonce.Nacked}, log.outcomes(k))
				continue
			}
			require.NoError(t, ds[i].err, k)
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed}, log.outcomes(k))
		}
		require.Equal(t, int64(10), b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id LIKE 'r-%'"))
		require.Equal(t, int64(9), inboxCount(t, b, inboxdb.StatusDone, keys...))
		if pgxDriver {
			got := tracer.take()
			require.Len(t, got, 2, "the pipeline with the failing write, then the batch again without it")
			require.Equal(t, 9, got[1])
		}

		require.Error(t, exactlyonce.Exec(context.Background(), "SELECT 1"), "Exec outside the middleware")
	})
}

// TestBatchDuplicatesInOneBatch: two copies of one key in the same batch:
// the handler runs once, one copy is processed and the other a duplicate;
// when the first copy's handler fails, the other copy is nacked too.
func TestBatchDuplicatesInOneBatch(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		effects := b.Table("effects")
		b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL)")
		var mu sync.Mutex
		runs := map[string]int{}
		h := func(msg *message.Message) ([]*message.Message, error) {
			mu.Lock()
			runs[msg.UUID]++
			mu.Unlock()
			if err := testenv.Exec(msg.Context(), b.Q("INSERT INTO "+effects+" (id) VALUES ($1)"), msg.UUID); err != nil {
				return nil, err
			}
			if strings.HasPrefix(msg.UUID, "f-") {
				return nil, errors.New("handler failed: " + msg.UUID)
			}
			return nil, nil
		}
		var log eventLog
		handler := newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 4, MaxWait: forever}, &log).Middleware(h)

		ds := deliver(t, handler, msgs("d-1", "d-1", "d-2", "d-3")...)
		requireOneBatch(t, ds)
		for _, d := range ds {
			require.NoError(t, d.err)
		}
		require.Equal(t, []exactlyonce.Outcome{exactlyonce.Duplicate, exactlyonce.Processed}, log.outcomes("d-1"))
		require.Equal(t, 1, runs["d-1"])
		require.Equal(t, int64(1), b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id = 'd-1'"))

		// Two copies of a key already done: both duplicates.
		ds = deliver(t, handler, msgs("d-1", "d-4", "d-1", "d-5")...)
		requireOneBatch(t, ds)
		for _, d := range ds {
			require.NoError(t, d.err)
		}
		require.Equal(t, []exactlyonce.Outcome{exactlyonce.Duplicate, exactlyonce.Duplicate, exactlyonce.Duplicate, exactlyonce.Processed}, log.outcomes("d-1"))
		require.Equal(t, 1, runs["d-1"])

		// The first copy fails: the other copy is nacked, not acked.
		ds = deliver(t, handler, msgs("f-1", "d-6", "f-1", "d-7")...)
		requireOneBatch(t, ds)
		require.Error(t, ds[0].err)
		require.Error(t, ds[2].err)
		require.NoError(t, ds[1].err)
		require.NoError(t, ds[3].err)
		require.Equal(t, []exactlyonce.Outcome{exactlyonce.Nacked, exactlyonce.Nacked}, log.outcomes("f-1"))
		require.Equal(t, 1, runs["f-1"], "the copy does not run on its own in the same batch")
		require.Zero(t, b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id = 'f-1'"))
		require.Zero(t, b.Count(t, "SELECT count(*) FROM "+b.DB.Inbox()+" WHERE message_key = 'f-1'"))
		require.Equal(t, int64(7), b.Count(t, "SELECT count(*) FROM "+effects), "d-1..d-7 once each")
	})
}

// dedicatedDatabase creates a database of its own for the test (dropped at
// cleanup), so that pg_stat_database counts only the test's deadlocks, and
// returns its name.
func dedicatedDatabase(t *testing.T) string {
	t.Helper()
	admin := testenv.PoolFor(t, testenv.DirectDatabaseURL())
	name := testenv.Unique(t, "eo_db_")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
		if err != nil {
			t.Errorf("dropping database %s: %v", name, err)
			return
		}
		defer func() { _ = c.Close(ctx) }()
		if _, err := c.Exec(ctx, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("dropping database %s: %v", name, err)
		}
	})
	return name
}

func withDatabase(t *testing.T, rawURL, database string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	u.Path = "/" + database
	return u.String()
}

// deadlocks returns the deadlocks PostgreSQL detected in database so far.
func deadlocks(t *testing.T, database string) int64 {
	t.Helper()
	c, err := pgx.Connect(context.Background(), testenv.DirectDatabaseURL())
	require.NoError(t, err)
	defer func() { _ = c.Close(context.Background()) }()
	var n int64
	require.NoError(t, c.QueryRow(context.Background(), "SELECT coalesce(deadlocks, 0) FROM pg_stat_database WHERE datname = $1", database).Scan(&n))
	return n
}

// innodbDeadlocks is the deadlocks the MySQL server detected since it
// started (Innodb_deadlocks, all databases).
func innodbDeadlocks(t *testing.T, b *testenv.Bundle) int64 {
	t.Helper()
	return b.Count(t, "SELECT CAST(VARIABLE_VALUE AS SIGNED) FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'INNODB_DEADLOCKS'")
}

// TestBatchTwoInstancesRace: two instances (two middlewares, two pools),
// one consumer name, receive the same 10 keys at the same moment, in
// opposite orders, 20 rounds: each key has one effect, one delivery
// processed and the other acked as a duplicate, no delivery nacked, and
// PostgreSQL detected no deadlock (the claims take their locks in key
// order; on MariaDB the count is the server's, logged). Then both receive 50 done keys again at once, counting the
// duplicates on the same rows. Under a REPEATABLE READ default too: a claim
// that meets the other batch's commit (40001) is retried, never nacked.
func TestBatchTwoInstancesRace(t *testing.T) {
	t.Parallel()
	for _, iso := range []string{testenv.ReadCommitted, testenv.RepeatableRead} {
		t.Run(strings.ReplaceAll(iso, " ", "-"), func(t *testing.T) {
			t.Parallel()
			database := dedicatedDatabase(t)
			base := testenv.DirectDatabaseURL()
			if iso != testenv.ReadCommitted {
				base = testenv.DatabaseURLWithIsolation(t, iso)
			}
			dbURL := withDatabase(t, base, database)
			for _, driver := range testenv.DriverNames {
				t.Run(driver, func(t *testing.T) {
					open := func() wsql.Beginner {
						if driver == "pgxpool" {
							return wsql.BeginnerFromPgx(testenv.PoolFor(t, dbURL))
						}
						return wsql.BeginnerFromStdSQL(testenv.StdDBFor(t, dbURL))
					}
					connA, connB := open(), open()
					// Created by the test's own user: the role of the
					// isolation level must own nothing here when it is
					// dropped.
					admin := wsql.BeginnerFromPgx(testenv.PoolFor(t, withDatabase(t, testenv.DirectDatabaseURL(), database)))
					schema := "eo_" + strings.ReplaceAll(driver, "-", "_")
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					require.NoError(t, sqlschema.Migrate(ctx, sqlschema.DB{Conn: admin, Schema: schema}))
					tables := sqlschema.DB{Conn: connA, Schema: schema}
					effects := pgx.Identifier{tables.Schema, "effects"}.Sanitize()
					_, err := admin.ExecContext(ctx, "CREATE TABLE "+effects+" (id text NOT NULL, instance text NOT NULL)")
					require.NoError(t, err)
					if iso != testenv.ReadCommitted {
						var got string
						require.NoError(t, seam.QueryRow(ctx, connB, "SHOW transaction_isolation", nil, &got))
						require.Equal(t, iso, got)
					}

					twoInstancesRace(t, tables, connB, effects, "INSERT INTO "+effects+" (id, instance) VALUES ($1, $2)")
				})
			}
			t.Run(testenv.MariaDB, func(t *testing.T) {
				// Two pools whose sessions default to iso; the deadlocks
				// InnoDB counts are the server's (shared with other
				// tests), so they are logged, not asserted.
				b := testenv.NewBundle(t, testenv.MySQLDriverWithIsolation(t, iso))
				connB := testenv.MySQLDriverWithIsolation(t, iso).DB
				var got string
				require.NoError(t, seam.QueryRow(b.Ctx, connB, "SELECT @@tx_isolation", nil, &got))
				require.Equal(t, strings.ToUpper(strings.ReplaceAll(iso, " ", "-")), got)
				effects := b.Table("effects")
				b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL, instance text NOT NULL)")
				before := innodbDeadlocks(t, b)
				twoInstancesRace(t, b.DB, connB, effects, b.Q("INSERT INTO "+effects+" (id, instance) VALUES ($1, $2)"))
				t.Logf("InnoDB deadlocks on the server during the test: %d", innodbDeadlocks(t, b)-before)
			})
			// The subtests ended and closed their connections, which
			// flushes their statistics.
			var n int64
			deadline := time.Now().Add(time.Second)
			for n == 0 && time.Now().Before(deadline) {
				n = deadlocks(t, database)
				time.Sleep(100 * time.Millisecond)
			}
			require.Zero(t, n, "PostgreSQL detected deadlocks between the batches (retried, but each cost deadlock_timeout): the claims must lock keys in one order")
		})
	}
}

// twoInstancesRace runs the rounds of TestBatchTwoInstancesRace: instance
// a on tables (its Conn), instance b through connB; insert writes an effect
// (id, instance) in the tables' dialect.
func twoInstancesRace(t *testing.T, tables sqlschema.DB, connB wsql.Beginner, effects, insert string) {
	t.Helper()
	connA := tables.Conn
	var log eventLog
	handler := func(instance string) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			return nil, testenv.Exec(msg.Context(), insert, msg.UUID, instance)
		}
	}
	batch := exactlyonce.BatchConfig{MaxSize: 10, MaxWait: forever}
	hA := newBatchEO(t, tables, batch, &log).Middleware(handler("a"))
	hB := newBatchEO(t, testenv.WithConn(tables, connB), batch, &log).Middleware(handler("b"))

	const rounds = 20
	var all []string
	for r := range rounds + 5 {
		keys := keyRange(fmt.Sprintf("r%02d-k", r), 10)
		if r >= rounds {
			// Both instances receive done keys again at once:
			// both count the duplicates on the same rows.
			keys = keyRange(fmt.Sprintf("r%02d-k", r-rounds), 10)
		} else {
			all = append(all, keys...)
		}
		reversed := slices.Clone(keys)
		slices.Reverse(reversed)
		var wg sync.WaitGroup
		var dsA, dsB []delivery
		// Each instance receives the keys one after the other, in
		// its order.
		for _, side := range []struct {
			h    message.HandlerFunc
			keys []string
			out  *[]delivery
		}{{hA, keys, &dsA}, {hB, reversed, &dsB}} {
			wg.Go(func() {
				*side.out = make([]delivery, len(side.keys))
				var inner sync.WaitGroup
				for i, k := range side.keys {
					inner.Go(func() {
						start := time.Now()
						_, err := side.h(message.NewMessage(k, nil))
						(*side.out)[i] = delivery{err: err, took: time.Since(start)}
					})
					time.Sleep(time.Millisecond)
				}
				inner.Wait()
			})
		}
		wg.Wait()
		for _, d := range append(dsA, dsB...) {
			require.NoError(t, d.err, "round %d: no delivery is nacked", r)
		}
	}
	for i, k := range all {
		want := []exactlyonce.Outcome{exactlyonce.Duplicate, exactlyonce.Processed}
		if i < 50 {
			want = []exactlyonce.Outcome{exactlyonce.Duplicate, exactlyonce.Duplicate, exactlyonce.Duplicate, exactlyonce.Processed}
		}
		require.Equal(t, want, log.outcomes(k), k)
	}
	require.Equal(t, int64(len(all)+2*50), testenv.Count(t, connA, "SELECT coalesce(sum(duplicates), 0) FROM "+tables.Inbox()+" WHERE consumer = 'c'"),
		"every duplicate counted once")
	require.Equal(t, int64(len(all)), testenv.Count(t, connA, "SELECT count(*) FROM "+effects))
	require.Equal(t, int64(len(all)), testenv.Count(t, connA, "SELECT count(DISTINCT id) FROM "+effects))
	t.Logf("effects by instance: a %d, b %d", testenv.Count(t, connA, "SELECT count(*) FROM "+effects+" WHERE instance = 'a'"),
		testenv.Count(t, connA, "SELECT count(*) FROM "+effects+" WHERE instance = 'b'"))
}

// TestBatchCommitFails: a deferred constraint that one handler's write
// violates fails the batch's COMMIT. No message may be acked whose effect
// did not commit; and redelivered together, as a broker redelivers them,
// the good messages must commit (the bad one must not keep failing them).
func TestBatchCommitFails(t *testing.T) {
	t.Parallel()
	testenv.EachDriver(t, func(t *testing.T, b *testenv.Bundle) {
		effects := b.Table("effects")
		b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL, CONSTRAINT effects_id_unique UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)")
		b.Exec(t, "INSERT INTO "+effects+" (id) VALUES ('taken')")
		h := func(msg *message.Message) ([]*message.Message, error) {
			id := msg.UUID
			if id == "c-4" {
				id = "taken" // violates the constraint at COMMIT only
			}
			return nil, testenv.Exec(msg.Context(), "INSERT INTO "+effects+" (id) VALUES ($1)", id)
		}
		var log eventLog
		handler := newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 10, MaxWait: 300 * time.Millisecond}, &log).Middleware(h)

		keys := keyRange("c-", 10)
		pending := keys
		for round := 1; round <= 4 && len(pending) > 0; round++ {
			ds := deliver(t, handler, msgs(pending...)...)
			var next []string
			for i, k := range pending {
				evs := log.of(k)
				ev := evs[len(evs)-1]
				committed := b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id = $1", k)
				if ds[i].err != nil {
					require.Equal(t, exactlyonce.Nacked, ev.Outcome)
					require.Zero(t, committed, "round %d: %s nacked, its effect must not have committed", round, k)
					next = append(next, k)
					continue
				}
				require.Contains(t, []exactlyonce.Outcome{exactlyonce.Processed, exactlyonce.Duplicate}, ev.Outcome)
				require.Equal(t, int64(1), committed, "round %d: %s acked, its effect must have committed", round, k)
			}
			t.Logf("round %d: %d of %d deliveries nacked", round, len(next), len(pending))
			if round == 1 {
				require.Contains(t, next, "c-4")
				require.Equal(t, "23505", pgCode(ds[slices.Index(pending, "c-4")].err), "the COMMIT's error")
			}
			pending = next
		}
		require.Equal(t, []string{"c-4"}, pending,
			"redelivered together, the messages that can commit must commit: a deferred constraint violated by one handler must not fail its batch on every redelivery")
		require.Equal(t, int64(10), b.Count(t, "SELECT count(*) FROM "+effects), "taken and the 9 good ones, once each")
	})
}

// cutProxy is a TCP proxy to PostgreSQL that, when armed, forwards the next
// write of any client (the batch's COMMIT), then drops the server's answer
// and closes the client's connection: the commit happened, the client
// cannot know.
type cutProxy struct {
	ln     net.Listener
	target string
	armed  atomic.Bool
	cuts   atomic.Int64
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

func newCutProxy(t *testing.T, target string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &cutProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		p.closed = true
		for c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *cutProxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *cutProxy) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		if !p.track(client, server) {
			_ = client.Close()
			_ = server.Close()
			return
		}
		var cut atomic.Bool
		p.wg.Go(func() { // client -> server
			buf := make([]byte, 64<<10)
			for {
				n, err := client.Read(buf)
				if n > 0 {
					if p.armed.CompareAndSwap(true, false) {
						cut.Store(true)
						_, _ = server.Write(buf[:n])
						p.cuts.Add(1)
						time.Sleep(300 * time.Millisecond) // the server commits
						_ = client.Close()
						_ = server.Close()
						return
					}
					if _, err := server.Write(buf[:n]); err != nil {
						break
					}
				}
				if err != nil {
					break
				}
			}
			_ = client.Close()
			_ = server.Close()
		})
		p.wg.Go(func() { // server -> client
			buf := make([]byte, 64<<10)
			for {
				n, err := server.Read(buf)
				if n > 0 && !cut.Load() {
					if _, err := client.Write(buf[:n]); err != nil {
						break
					}
				}
				if err != nil {
					break
				}
			}
			if !cut.Load() {
				_ = client.Close()
			}
			_, _ = io.Copy(io.Discard, server)
		})
	}
}

// TestBatchCommitOutcomeUnknown: the connection is lost at the batch's
// COMMIT, before it reached the server (the proxy refuses: nothing
// committed) or after (the answer is lost: everything committed). Either
// way every message of the batch is nacked, and redelivering them all
// gives exactly one effect each: processed now, or duplicates.
func TestBatchCommitOutcomeUnknown(t *testing.T) {
	t.Parallel()
	for _, committed := range []bool{false, true} {
		name := map[bool]string{false: "lost before the commit", true: "commit applied, answer lost"}[committed]
		t.Run(strings.ReplaceAll(name, " ", "_"), func(t *testing.T) {
			t.Parallel()
			testenv.EachDriver(t, func(t *testing.T, b *testenv.Bundle) {
				u, err := url.Parse(testenv.DatabaseURL())
				require.NoError(t, err)
				target := u.Host
				if u.Port() == "" {
					target = net.JoinHostPort(u.Hostname(), "5432")
				}
				var refusing *testenv.Proxy
				var cutting *cutProxy
				var proxied string
				if committed {
					cutting = newCutProxy(t, target)
					u.Host = cutting.ln.Addr().String()
					proxied = u.String()
				} else {
					refusing = testenv.NewProxy(t, target)
					proxied = refusing.RewriteURL(testenv.DatabaseURL())
				}
				var conn wsql.Beginner
				if b.Driver.Name == "pgxpool" {
					conn = wsql.BeginnerFromPgx(testenv.PoolFor(t, proxied))
				} else {
					conn = wsql.BeginnerFromStdSQL(testenv.StdDBFor(t, proxied))
				}
				effects := b.Table("effects")
				b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL)")
				var runs atomic.Int64
				var cut atomic.Bool
				cut.Store(true)
				h := func(msg *message.Message) ([]*message.Message, error) {
					if err := testenv.Exec(msg.Context(), "INSERT INTO "+effects+" (id) VALUES ($1)", msg.UUID); err != nil {
						return nil, err
					}
					if runs.Add(1) == 10 && cut.Load() {
						// The last handler of the batch: the next thing the
						// batch sends is its COMMIT.
						if committed {
							cutting.armed.Store(true)
						} else {
							refusing.Refuse()
						}
					}
					return nil, nil
				}
				var log eventLog
				handler := newBatchEO(t, testenv.WithConn(b.DB, conn), exactlyonce.BatchConfig{MaxSize: 10, MaxWait: forever}, &log).Middleware(h)
				keys := keyRange("u-", 10)
				ds := deliver(t, handler, msgs(keys...)...)
				requireOneBatch(t, ds)
				for i, k := range keys {
					require.Error(t, ds[i].err, "%s: the commit's outcome is unknown: nack", k)
					require.Equal(t, []exactlyonce.Outcome{exactlyonce.Nacked}, log.outcomes(k))
				}
				if committed {
					require.Equal(t, int64(1), cutting.cuts.Load())
					require.Equal(t, int64(10), inboxCount(t, b, inboxdb.StatusDone, keys...), "the COMMIT reached the server")
				} else {
					require.Zero(t, inboxCount(t, b, inboxdb.StatusDone, keys...), "the COMMIT never reached the server")
					refusing.Allow()
				}

				// Redelivered: exactly one effect each.
				cut.Store(false)
				ds = deliver(t, handler, msgs(keys...)...)
				requireOneBatch(t, ds)
				want := []exactlyonce.Outcome{exactlyonce.Nacked, exactlyonce.Processed}
				if committed {
					want = []exactlyonce.Outcome{exactlyonce.Duplicate, exactlyonce.Nacked}
				}
				for i, k := range keys {
					require.NoError(t, ds[i].err, k)
					require.Equal(t, want, log.outcomes(k), "%s: sorted outcomes", k)
					require.Equal(t, int64(1), b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id = $1", k), "%s: one effect", k)
				}
			})
		})
	}
}

// TestBatchContextCancelledWhileQueued: a delivery whose context ends while
// it waits for its batch is nacked with the context's error without running
// the handler; the others are processed.
func TestBatchContextCancelledWhileQueued(t *testing.T) {
	t.Parallel()
	b := testenv.NewBundle(t, testenv.DriverNamed(t, "pgxpool"))
	var mu sync.Mutex
	ran := map[string]bool{}
	h := func(msg *message.Message) ([]*message.Message, error) {
		mu.Lock()
		ran[msg.UUID] = true
		mu.Unlock()
		return nil, nil
	}
	var log eventLog
	handler := newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 10, MaxWait: time.Second}, &log).Middleware(h)
	ms := msgs(keyRange("x-", 5)...)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ms[2].SetContext(ctx)
	time.AfterFunc(200*time.Millisecond, cancel)
	ds := deliver(t, handler, ms...)
	for i, m := range ms {
		if i == 2 {
			require.ErrorIs(t, ds[i].err, context.Canceled)
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Nacked}, log.outcomes(m.UUID))
			require.False(t, ran[m.UUID], "the handler does not run for a delivery whose context ended")
			continue
		}
		require.NoError(t, ds[i].err)
		require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed}, log.outcomes(m.UUID))
	}
	require.Equal(t, int64(4), inboxCount(t, b, inboxdb.StatusDone, keyRange("x-", 5)...))
	require.Zero(t, inboxCount(t, b, inboxdb.StatusDone, "x-2"))
}

// TestBatchShutdownMidBatch: a router closed while batches are collecting
// or running (every batch waits 300 ms for more deliveries than are in
// flight); after a restart with a fresh router every message is processed
// exactly once and the queue is drained. On either engine.
func TestBatchShutdownMidBatch(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		db := b.DB
		effects := b.Table("effects")
		b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL)")
		insert := b.Q("INSERT INTO " + effects + " (id) VALUES ($1)")
		q := testenv.Queue(t, "batch_shutdown_")
		const n = 300

		start := func(log *eventLog) *message.Router {
			eo, err := exactlyonce.New(exactlyonce.Config{DB: db, NackDelay: -1, OnEvent: log.observe, Logger: testenv.Logger(t),
				Batch: &exactlyonce.BatchConfig{MaxSize: 64, MaxWait: 300 * time.Millisecond}})
			require.NoError(t, err)
			r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, testenv.Logger(t))
			require.NoError(t, err)
			r.AddMiddleware(eo.Middleware)
			r.AddConsumerHandler("batch-shutdown", q, exactlyonce.ConcurrentSubscriber(testenv.AMQPSubscriber(t, 1), 16), func(msg *message.Message) error {
				time.Sleep(2 * time.Millisecond)
				return testenv.Exec(msg.Context(), insert, msg.UUID)
			})
			testenv.StartRouter(t, r)
			return r
		}
		pub := testenv.AMQPPublisher(t)
		for i := range n {
			require.NoError(t, pub.Publish(q, message.NewMessage(fmt.Sprintf("s-%03d", i), nil)))
		}

		var first eventLog
		r := start(&first)
		testenv.Eventually(t, time.Minute, func() bool { return first.count(exactlyonce.Processed) >= 40 }, "the first router processed some")
		closed := make(chan error, 1)
		go func() { closed <- r.Close() }()
		select {
		case err := <-closed:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Fatal("the router did not close within 30s")
		}
		processed := first.count(exactlyonce.Processed)
		t.Logf("first router: %d processed, %d nacked at the shutdown", processed, first.count(exactlyonce.Nacked))
		require.Less(t, processed, n, "the shutdown should have come before the end")

		var second eventLog
		start(&second)
		testenv.Eventually(t, 2*time.Minute, func() bool {
			return testenv.Count(t, db.Conn, "SELECT count(DISTINCT id) FROM "+effects) >= n
		}, "every message processed after the restart")
		time.Sleep(500 * time.Millisecond) // a repeat would show
		require.Equal(t, int64(n), testenv.Count(t, db.Conn, "SELECT count(*) FROM "+effects), "no message processed twice")
		require.Equal(t, int64(n), testenv.Count(t, db.Conn, "SELECT count(*) FROM "+db.Inbox()+" WHERE status = 'done'"))
		require.Equal(t, n, processed+second.count(exactlyonce.Processed))
	})
}

// TestBatchClaimFailures: the claim of a batch fails for all of it when the
// database is unreachable (ErrDBUnavailable, after NackDelay) or the tables
// are not migrated (ErrClaimFailed, sqlschema.ErrNotMigrated); a lease-mode
// record of one key fails only that key's message (ErrClaimFailed wrapping
// inboxdb.ErrNotDone), the others are processed.
func TestBatchClaimFailures(t *testing.T) {
	t.Parallel()
	testenv.EachDriver(t, func(t *testing.T, b *testenv.Bundle) {
		var ran atomic.Int64
		h := func(msg *message.Message) ([]*message.Message, error) {
			ran.Add(1)
			return nil, nil
		}
		const nackDelay = 300 * time.Millisecond
		withDelay := func(c *exactlyonce.Config) { c.NackDelay = nackDelay }
		batch := exactlyonce.BatchConfig{MaxSize: 5, MaxWait: forever}

		// Unreachable.
		proxy := testenv.NewProxy(t, func() string {
			u, err := url.Parse(testenv.DatabaseURL())
			require.NoError(t, err)
			if u.Port() == "" {
				return net.JoinHostPort(u.Hostname(), "5432")
			}
			return u.Host
		}())
		proxied := proxy.RewriteURL(testenv.DatabaseURL())
		var conn wsql.Beginner
		if b.Driver.Name == "pgxpool" {
			conn = wsql.BeginnerFromPgx(testenv.PoolFor(t, proxied))
		} else {
			conn = wsql.BeginnerFromStdSQL(testenv.StdDBFor(t, proxied))
		}
		proxy.Refuse()
		var log eventLog
		keys := keyRange("u-", 5)
		ds := deliver(t, newBatchEO(t, testenv.WithConn(b.DB, conn), batch, &log, withDelay).Middleware(h), msgs(keys...)...)
		requireOneBatch(t, ds)
		for i, k := range keys {
			require.ErrorIs(t, ds[i].err, exactlyonce.ErrDBUnavailable, k)
			require.NotErrorIs(t, ds[i].err, exactlyonce.ErrClaimFailed)
			require.GreaterOrEqual(t, ds[i].took, nackDelay, "returned after NackDelay")
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Nacked}, log.outcomes(k))
		}
		require.Zero(t, ran.Load())

		// Not migrated.
		log = eventLog{}
		missing := sqlschema.DB{Conn: b.Driver.DB, Schema: b.DB.Schema, InboxTable: "no_such_inbox"}
		ds = deliver(t, newBatchEO(t, missing, batch, &log, withDelay).Middleware(h), msgs(keys...)...)
		requireOneBatch(t, ds)
		for i, k := range keys {
			require.ErrorIs(t, ds[i].err, exactlyonce.ErrClaimFailed, k)
			require.ErrorIs(t, ds[i].err, sqlschema.ErrNotMigrated)
			require.NotErrorIs(t, ds[i].err, exactlyonce.ErrDBUnavailable)
			require.GreaterOrEqual(t, ds[i].took, nackDelay, "returned after NackDelay")
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Nacked}, log.outcomes(k))
		}
		require.Zero(t, ran.Load())

		// A lease-mode record of one key.
		b.Exec(t, "INSERT INTO "+b.DB.Inbox()+` (consumer, message_key, status, attempts, lease_until, lease_token)
VALUES ('c', 'l-2', 'processing', 1, now() + interval '1 hour', gen_random_uuid())`)
		log = eventLog{}
		keys = keyRange("l-", 5)
		ds = deliver(t, newBatchEO(t, b.DB, batch, &log, withDelay).Middleware(h), msgs(keys...)...)
		requireOneBatch(t, ds)
		for i, k := range keys {
			if k == "l-2" {
				require.ErrorIs(t, ds[i].err, exactlyonce.ErrClaimFailed)
				require.ErrorIs(t, ds[i].err, inboxdb.ErrNotDone)
				require.GreaterOrEqual(t, ds[i].took, nackDelay, "a configuration error: returned after NackDelay")
				require.Equal(t, []exactlyonce.Outcome{exactlyonce.Nacked}, log.outcomes(k))
				continue
			}
			require.NoError(t, ds[i].err, k)
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed}, log.outcomes(k))
		}
		require.Equal(t, int64(4), ran.Load())
		require.Equal(t, int64(4), inboxCount(t, b, inboxdb.StatusDone, keys...))
		require.Equal(t, int64(1), inboxCount(t, b, inboxdb.StatusProcessing, "l-2"), "the lease-mode record is left alone")
	})
}

// TestBatchConfig: group commit is transactional mode's alone (New refuses
// it with Lease or FailOpen), and MaxSize and MaxWait are checked.
func TestBatchConfig(t *testing.T) {
	t.Parallel()
	db := sqlschema.DB{Conn: testenv.Drivers(t)[0].DB}
	for _, c := range []struct {
		name  string
		cfg   exactlyonce.Config
		error string
	}{
		{"with Lease", exactlyonce.Config{Batch: &exactlyonce.BatchConfig{}, Lease: &exactlyonce.LeaseConfig{}}, "Lease"},
		{"with FailOpen", exactlyonce.Config{Batch: &exactlyonce.BatchConfig{}, FailOpen: true}, "FailOpen"},
		{"MaxSize negative", exactlyonce.Config{Batch: &exactlyonce.BatchConfig{MaxSize: -1}}, "MaxSize"},
		{"MaxSize over 1000", exactlyonce.Config{Batch: &exactlyonce.BatchConfig{MaxSize: 1001}}, "MaxSize"},
		{"MaxWait negative", exactlyonce.Config{Batch: &exactlyonce.BatchConfig{MaxWait: -time.Second}}, "MaxWait"},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.DB = db
			_, err := exactlyonce.New(c.cfg)
			require.Error(t, err)
			require.ErrorContains(t, err, c.error)
			require.True(t, strings.HasPrefix(err.Error(), "exactlyonce: "), err.Error())
		})
	}
	for _, size := range []int{0, 1, 1000} {
		_, err := exactlyonce.New(exactlyonce.Config{DB: db, Batch: &exactlyonce.BatchConfig{MaxSize: size}})
		require.NoError(t, err, "MaxSize %d", size)
	}
	require.Equal(t, 64, exactlyonce.BatchConfig{}.WithDefaults().MaxSize)
	require.Equal(t, 64, exactlyonce.Config{Batch: &exactlyonce.BatchConfig{}}.WithDefaults().Batch.MaxSize)
}

// TestBatchThroughRabbitMQ: 400 distinct messages, each published twice,
// through a RabbitMQ queue with 32 deliveries in flight under group commit
// with the defaults (no MaxWait): one effect row per message, half the
// deliveries duplicates, handlers of a batch in turn.
func TestBatchThroughRabbitMQ(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t)
	pool := testenv.Pool(t)
	effects := pgx.Identifier{db.Schema, "effects"}.Sanitize()
	_, err := pool.Exec(context.Background(), "CREATE TABLE "+effects+" (id text PRIMARY KEY)")
	require.NoError(t, err)

	var counters testenv.Counters
	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Batch: &exactlyonce.BatchConfig{}, OnEvent: counters.Observe, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	q := testenv.Queue(t, "batch_smoke_")
	r, err := message.NewRouter(message.RouterConfig{}, testenv.Logger(t))
	require.NoError(t, err)
	r.AddMiddleware(eo.Middleware)
	var maxSeen, inHandler atomic.Int64
	r.AddConsumerHandler("batch-smoke", q, exactlyonce.ConcurrentSubscriber(testenv.AMQPSubscriber(t, 1), 32), func(msg *message.Message) error {
		storeMax(&maxSeen, inHandler.Add(1))
		defer inHandler.Add(-1)
		return exactlyonce.Exec(msg.Context(), "INSERT INTO "+effects+" (id) VALUES ($1)", msg.UUID)
	})
	testenv.StartRouter(t, r)
	pub := testenv.AMQPPublisher(t)
	for i := range 400 {
		for range 2 {
			require.NoError(t, pub.Publish(q, message.NewMessage(fmt.Sprintf("m-%d", i), nil)))
		}
	}
	testenv.Eventually(t, 60*time.Second, func() bool {
		return counters.Processed.Load()+counters.Duplicates.Load() >= 800
	}, "all deliveries settled")
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), "SELECT count(*) FROM "+effects).Scan(&n))
	require.Equal(t, 400, n)
	require.Equal(t, int64(400), counters.Processed.Load())
	require.Equal(t, int64(400), counters.Duplicates.Load())
	require.Zero(t, counters.Failed.Load()+counters.ClaimFailed.Load())
	// Handlers of one batch run in turn (TestBatchOneTransaction checks it
	// inside one batch); two batches of a handler may run at once.
	require.LessOrEqual(t, maxSeen.Load(), int64(2), "at most two batches of a handler at once, each running its handlers in turn")
	p, err := testenv.OutboxStore(t, db).Pending(context.Background())
	require.NoError(t, err)
	require.Zero(t, p.Count)
}

// TestBatchHandlerIgnoresFailedStatement: one handler of a batch of 7 runs a
// statement that fails and ignores its error (the "a unique violation means
// it is already there" pattern). That aborts the batch's transaction: the
// statements after it fail with 25P02, and PostgreSQL answers the COMMIT
// with ROLLBACK (pgx.ErrTxCommitRollback, which has no SQLSTATE). Neither
// is an unknown outcome: nothing committed, so the batch runs again one
// message per transaction, and in the first round the 6 healthy messages
// are processed (one effect each) and only the one that ignored its error
// is nacked. The abort is met by the COMMIT (the healthy handlers run no
// statement), by the healthy handlers' own statements (they insert their
// effect and return its error), or by the statements they deferred (Exec:
// with pgx, sent in one round trip before the COMMIT).
//
// The same handler without group commit: the 6 are processed, the bad one
// is nacked on each delivery. In lease mode: the 6 are processed, and the
// bad one's completion fails with 25P02, which repeats: its key is parked
// (acked, interrupted) with the reason.
func TestBatchHandlerIgnoresFailedStatement(t *testing.T) {
	t.Parallel()
	const bad = "x-3"
	for _, healthy := range []string{"no statement", "exec", "queue"} {
		healthyWrites := healthy != "no statement"
		t.Run(strings.ReplaceAll(healthy, " ", "_"), func(t *testing.T) {
			t.Parallel()
			testenv.EachDriver(t, func(t *testing.T, b *testenv.Bundle) {
				effects, taken := b.Table("effects"), b.Table("taken")
				b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL)")
				b.Exec(t, "CREATE TABLE "+taken+" (id text PRIMARY KEY)")
				b.Exec(t, "INSERT INTO "+taken+" VALUES ('taken')")
				h := func(msg *message.Message) ([]*message.Message, error) {
					if msg.UUID == bad {
						// Already there: fine, says the handler.
						_ = testenv.Exec(msg.Context(), "INSERT INTO "+taken+" (id) VALUES ('taken')")
						return nil, nil
					}
					switch healthy {
					case "exec":
						return nil, testenv.Exec(msg.Context(), "INSERT INTO "+effects+" (id) VALUES ($1)", msg.UUID)
					case "queue":
						return nil, exactlyonce.Exec(msg.Context(), "INSERT INTO "+effects+" (id) VALUES ($1)", msg.UUID)
					}
					return nil, nil
				}
				keys := keyRange("x-", 7)
				check := func(t *testing.T, mode string, log *eventLog, ds []delivery, badOutcome exactlyonce.Outcome) {
					t.Helper()
					nacked := 0
					for i, k := range keys {
						if k == bad {
							require.Equal(t, []exactlyonce.Outcome{badOutcome}, log.outcomes(k), "%s: %s", mode, k)
							continue
						}
						if ds[i].err != nil {
							nacked++
							t.Logf("%s: healthy %s nacked: %v", mode, k, ds[i].err)
							continue
						}
						require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed}, log.outcomes(k), "%s: %s", mode, k)
					}
					require.Zero(t, nacked, "%s: of 6 healthy messages, %d nacked in the first round", mode, nacked)
				}
				effectsOnce := func(t *testing.T, consumer string) {
					t.Helper()
					for _, k := range keys {
						want := int64(1)
						if k == bad {
							want = 0
						}
						if healthyWrites {
							require.Equal(t, want, b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id = $1", k), "%s: %s's effects", consumer, k)
						}
						require.Equal(t, want, b.Count(t, "SELECT count(*) FROM "+b.DB.Inbox()+" WHERE consumer = $1 AND message_key = $2 AND status = 'done'", consumer, k),
							"%s: %s recorded done", consumer, k)
					}
					b.Exec(t, "DELETE FROM "+effects)
				}

				// Group commit: one batch of 7.
				var log eventLog
				handler := newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 7, MaxWait: forever}, &log).Middleware(h)
				ds := deliver(t, handler, msgs(keys...)...)
				requireOneBatch(t, ds)
				check(t, "group commit", &log, ds, exactlyonce.Nacked)
				badErr := ds[slices.Index(keys, bad)].err
				require.Error(t, badErr)
				require.True(t, errors.Is(badErr, pgx.ErrTxCommitRollback) || pgCode(badErr) == "25P02", "%v", badErr)
				effectsOnce(t, "c")

				// One transaction per message.
				log = eventLog{}
				eo, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Consumer: "per-message", NackDelay: -1, OnEvent: log.observe, Logger: testenv.Logger(t)})
				require.NoError(t, err)
				ds = deliver(t, eo.Middleware(h), msgs(keys...)...)
				check(t, "per message", &log, ds, exactlyonce.Nacked)
				effectsOnce(t, "per-message")

				// Lease mode: the bad one's completion can never commit.
				log = eventLog{}
				eo, err = exactlyonce.New(exactlyonce.Config{DB: b.DB, Consumer: "lease", Lease: &exactlyonce.LeaseConfig{Duration: time.Minute},
					NackDelay: -1, OnEvent: log.observe, Logger: testenv.Logger(t)})
				require.NoError(t, err)
				ds = deliver(t, eo.Middleware(h), msgs(keys...)...)
				check(t, "lease", &log, ds, exactlyonce.Parked)
				require.NoError(t, ds[slices.Index(keys, bad)].err, "lease: parked and acked")
				require.ErrorContains(t, log.of(bad)[0].Err, "25P02")
				effectsOnce(t, "lease")
			})
		})
	}
}

// TestBatchDisjointKeysDoNotWait: while one instance's batch is running
// (its handler waits), another instance's batch of other keys of the same
// consumer, sorting before or after them, claims, runs and commits: a
// batch's claim locks its own records, not the gaps around them. On
// MariaDB under REPEATABLE READ (its default) the batch claim's locking read
// (ClaimBatchLock, a range scan of the IN list) took next-key locks, and
// the other batch's INSERT waited for the first one's COMMIT (with three
// keys or more; two keys were locked one by one).
func TestBatchDisjointKeysDoNotWait(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		for _, other := range [][]string{{"b-1", "b-2", "b-3"}, {"0-1", "0-2", "0-3"}} {
			release, held := make(chan struct{}), make(chan struct{})
			var once sync.Once
			var logA, logB eventLog
			hA := newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 3, MaxWait: forever}, &logA).Middleware(
				func(*message.Message) ([]*message.Message, error) {
					once.Do(func() { close(held) })
					<-release
					return nil, nil
				})
			hB := newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 3, MaxWait: forever}, &logB).Middleware(
				func(*message.Message) ([]*message.Message, error) { return nil, nil })
			run := func(h message.HandlerFunc, keys []string) chan error {
				errs := make(chan error, len(keys))
				for _, k := range keys {
					go func() { _, err := h(message.NewMessage(k, nil)); errs <- err }()
				}
				return errs
			}
			keysA := []string{"a-1", "a-2", "a-3"}
			if other[0] == "0-1" {
				keysA = []string{"a-4", "a-5", "a-6"}
			}
			errsA := run(hA, keysA)
			select {
			case <-held:
			case <-time.After(30 * time.Second):
				close(release)
				t.Fatal("the first batch's handler never ran")
			}
			errsB := run(hB, other)
			var blocked bool
			for range other {
				select {
				case err := <-errsB:
					require.NoError(t, err)
				case <-time.After(10 * time.Second):
					blocked = true
				}
				if blocked {
					break
				}
			}
			close(release)
			for range keysA {
				require.NoError(t, <-errsA)
			}
			require.False(t, blocked, "keys %v waited for the running batch of %v", other, keysA)
			require.Equal(t, 3, logB.count(exactlyonce.Processed))
		}
	})
}
