package outbox_test

import (
	"context"
	stdsql "database/sql"
	"errors"
	"maps"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// bundle is what a test of one driver works with: db is the driver, tables
// the migrated schema (whose Conn schema() replaces with db), w the Writer
// of its outbox (see newBundle).
type bundle struct {
	ctx    context.Context
	db     wsql.Beginner
	tables sqlschema.DB
	w      *outbox.Writer
}

// newBundle returns the bundle of db and tables, with a Writer of tables'
// outbox that all its writes share (as a service's would: one NOTIFY
// debounce).
func newBundle(t testing.TB, ctx context.Context, db wsql.Beginner, tables sqlschema.DB) bundle {
	t.Helper()
	w, err := outbox.NewWriter(tables)
	require.NoError(t, err)
	return bundle{ctx: ctx, db: db, tables: tables, w: w}
}

// schema is the bundle's tables reached through its driver: the
// sqlschema.DB a relay and the operator functions take.
func (b bundle) schema() sqlschema.DB {
	return testenv.WithConn(b.tables, b.db)
}

// eachDriver runs f once per driver (testenv.ForEachDriver), each with its
// own migrated schema.
func eachDriver(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	testenv.ForEachDriver(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		tables := testenv.Schema(t)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		t.Cleanup(cancel)
		f(t, newBundle(t, ctx, d.DB, tables))
	})
}

// eachEngine runs f once per driver of either engine
// (testenv.ForEachEngine: PostgreSQL's drivers and MariaDB), each with its
// own migrated schema (on MySQL, a database).
func eachEngine(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	testenv.EachEngine(t, func(t *testing.T, tb *testenv.Bundle) {
		f(t, newBundle(t, tb.Ctx, tb.Driver.DB, tb.DB))
	})
}

// mysql is true for a bundle on MySQL/MariaDB.
func (b bundle) mysql() bool { return b.tables.Dialect == sqlschema.MySQL }

// sql returns pg or mysql: a test's own statement in the bundle's dialect.
func (b bundle) sql(pg, mysql string) string {
	if b.mysql() {
		return mysql
	}
	return pg
}

// count counts the outbox rows db sees (the bundle's driver, or a
// transaction) with a plain count(*), on either engine.
func (b bundle) count(t testing.TB, db wsql.ContextExecutor) int64 {
	t.Helper()
	return testenv.Count(t, db, "SELECT count(*) FROM "+b.tables.Outbox())
}

// write writes msgs to topic through tx (writeTo), which must succeed.
func (b bundle) write(t testing.TB, tx wsql.ContextExecutor, topic string, msgs ...*message.Message) {
	t.Helper()
	require.NoError(t, b.writeTo(tx, topic, msgs...))
}

// writeTo writes msgs to topic through tx with the bundle's Writer.
func (b bundle) writeTo(tx wsql.ContextExecutor, topic string, msgs ...*message.Message) error {
	pub, err := b.w.Publisher(tx)
	if err != nil {
		return err
	}
	return pub.Publish(topic, msgs...)
}

// begin starts a transaction that is rolled back at cleanup if the test did
// not end it.
func (b bundle) begin(t testing.TB) wsql.Tx {
	t.Helper()
	tx, err := b.db.BeginTx(b.ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// publish writes msgs to topic in a transaction of its own and commits it.
func (b bundle) publish(t testing.TB, topic string, msgs ...*message.Message) {
	t.Helper()
	tx := b.begin(t)
	b.write(t, tx, topic, msgs...)
	require.NoError(t, tx.Commit())
}

func (b bundle) exec(t testing.TB, q string, args ...any) int64 {
	t.Helper()
	res, err := b.db.ExecContext(b.ctx, q, args...)
	require.NoError(t, err)
	n, err := res.RowsAffected()
	require.NoError(t, err)
	return n
}

// pending counts the outbox rows db sees: the bundle's driver, or a
// transaction (see txConn).
func (b bundle) pending(t testing.TB, db wsql.ContextExecutor) int64 {
	t.Helper()
	conn, ok := db.(wsql.Beginner)
	if !ok {
		conn = txConn{db}
	}
	p, err := mustStore(t, testenv.WithConn(b.tables, conn)).Pending(b.ctx)
	require.NoError(t, err)
	return p.Count
}

// txConn lets PendingStats read through an open transaction (its queries
// run in it, so it sees the transaction's own rows); it cannot begin
// another.
type txConn struct{ wsql.ContextExecutor }

func (txConn) BeginTx(context.Context, *stdsql.TxOptions) (wsql.Tx, error) {
	return nil, errors.New("txConn: already in a transaction")
}

// row is an outbox row as stored.
type row struct {
	ID       int64
	Topic    string
	UUID     string
	Payload  []byte
	Metadata string
}

func (b bundle) rows(t testing.TB) []row {
	t.Helper()
	rs, err := b.db.QueryContext(b.ctx, b.sql("SELECT id, topic, uuid, payload, metadata::text FROM ", "SELECT id, topic, uuid, payload, metadata FROM ")+b.tables.Outbox()+" ORDER BY id")
	require.NoError(t, err)
	var out []row
	for rs.Next() {
		var r row
		require.NoError(t, rs.Scan(&r.ID, &r.Topic, &r.UUID, &r.Payload, &r.Metadata))
		out = append(out, r)
	}
	require.NoError(t, seam.Close(rs))
	return out
}

// delivered is one message as a publisher received it.
type delivered struct {
	Topic    string
	UUID     string
	Payload  string
	Metadata map[string]string
}

// recorder is a message.Publisher that records what it is given, and fails
// for one topic while failTopic is set. It stands in for the broker when
// testing the relay's own logic.
type recorder struct {
	mu        sync.Mutex
	got       []delivered
	failTopic string
	failUUID  string // a message the "broker" can never take
	calls     int
}

var (
	errBrokerDown    = errors.New("broker down (test)")
	errUnpublishable = errors.New("message too large for the broker (test)")
)

func (r *recorder) Publish(topic string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	if r.failTopic != "" && topic == r.failTopic {
		return errBrokerDown
	}
	for _, m := range msgs {
		if r.failUUID != "" && m.UUID == r.failUUID {
			return errUnpublishable
		}
	}
	for _, m := range msgs {
		r.got = append(r.got, delivered{Topic: topic, UUID: m.UUID, Payload: string(m.Payload), Metadata: maps.Clone(m.Metadata)})
	}
	return nil
}

func (r *recorder) Close() error { return nil }

func (r *recorder) setFailTopic(topic string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failTopic = topic
}

func (r *recorder) delivered() []delivered {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]delivered(nil), r.got...)
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got)
}

// runRelay runs relay.Run in the background and returns a stop function
// that cancels it and requires it to return nil within 10s.
func runRelay(t *testing.T, relay *outbox.Relay) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				require.NoError(t, err, "Run returns nil after its context is cancelled")
			case <-time.After(10 * time.Second):
				t.Error("Relay.Run did not return within 10s after cancel")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// mustStore is outbox.NewStore(db), which must succeed.
func mustStore(t testing.TB, db sqlschema.DB) *outbox.Store {
	t.Helper()
	s, err := outbox.NewStore(db)
	require.NoError(t, err)
	return s
}

// txWriter publishes through one transaction with writeTo: the Writer's
// Publisher on PostgreSQL, the test's own statements on MySQL.
type txWriter struct {
	b  bundle
	tx wsql.ContextExecutor
}

// Publish writes msgs to topic (bundle.writeTo).
func (w txWriter) Publish(topic string, msgs ...*message.Message) error {
	return w.b.writeTo(w.tx, topic, msgs...)
}

// publisher is b.w.Publisher(tx) on either engine (txWriter).
func (b bundle) publisher(tx wsql.ContextExecutor) (txWriter, error) {
	return txWriter{b, tx}, nil
}
