package metrics_test

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/metrics"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// events keeps the events a hook saw, beside the metrics' own hook: the
// way a user combines OnEvent with a hook of theirs.
type events struct {
	mu  sync.Mutex
	all []exactlyonce.Event
}

func (e *events) hook(m *metrics.Metrics) func(exactlyonce.Event) {
	return func(ev exactlyonce.Event) {
		m.OnEvent(ev)
		e.mu.Lock()
		e.all = append(e.all, ev)
		e.mu.Unlock()
	}
}

// claims counts the events with a claim time, by consumer.
func (e *events) claims() map[string]float64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := map[string]float64{}
	for _, ev := range e.all {
		if ev.ClaimDuration > 0 {
			out[`exactlyonce_claim_duration_seconds_count{consumer="`+ev.Consumer+`"}`]++
		}
	}
	return out
}

// TestMiddlewareEvents runs the real middleware on either engine through
// each kind of delivery and checks what the metrics counted.
func TestMiddlewareEvents(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testMiddlewareEvents)
}

func testMiddlewareEvents(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	m, reg := newMetrics(t, metrics.Config{})
	var seen events
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	mw := func(cfg exactlyonce.Config) *exactlyonce.Guard {
		cfg.OnEvent = seen.hook(m)
		cfg.NackDelay = -1
		cfg.Logger = watermill.NopLogger{}
		eo, err := exactlyonce.New(cfg)
		require.NoError(t, err)
		return eo
	}
	deliver := func(h message.HandlerFunc, uuid string) error {
		msg := message.NewMessage(uuid, []byte("{}"))
		msg.SetContext(ctx)
		_, err := h(msg)
		return err
	}

	// Transactional mode: processed, duplicate, a handler error, a panic,
	// a permanent error (parked now, then parked earlier), an output
	// without a topic, an invalid key.
	tx := mw(exactlyonce.Config{DB: db, Consumer: "orders"})
	h := tx.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		switch msg.UUID {
		case "fail":
			return nil, errors.New("provider said no")
		case "panic":
			panic("boom")
		case "permanent":
			return nil, exactlyonce.Permanent(errors.New("invalid phone number"))
		case "output":
			return []*message.Message{message.NewMessage("out-1", nil)}, nil
		}
		return nil, nil
	})
	require.NoError(t, deliver(h, "ok-1"))
	require.NoError(t, deliver(h, "ok-2"))
	require.NoError(t, deliver(h, "ok-1"))
	require.Error(t, deliver(h, "fail"))
	require.Error(t, deliver(h, "panic"))
	require.NoError(t, deliver(h, "permanent"))
	require.NoError(t, deliver(h, "permanent"))
	require.ErrorIs(t, deliver(h, "output"), exactlyonce.ErrNoDestination)
	require.ErrorIs(t, deliver(h, ""), exactlyonce.ErrInvalidKey)

	// Tables never migrated: a claim failure. A database that cannot be
	// reached: db_unavailable, or a fail-open run.
	notMigrated := sqlschema.DB{Dialect: db.Dialect, Conn: db.Conn, Schema: testenv.Unique(t, "nm_")}
	require.ErrorIs(t, deliver(mw(exactlyonce.Config{DB: notMigrated, Consumer: "orders"}).Middleware(noop), "x"), exactlyonce.ErrClaimFailed)
	var unreachable sqlschema.DB
	if b.MySQL() {
		down, err := stdsql.Open("mysql", "root@tcp(127.0.0.1:1)/test?parseTime=true&timeout=2s")
		require.NoError(t, err)
		defer down.Close()
		unreachable = sqlschema.DB{Dialect: sqlschema.MySQL, Conn: wsql.BeginnerFromStdSQL(down)}
	} else {
		down, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/test?connect_timeout=2")
		require.NoError(t, err)
		defer down.Close()
		unreachable = sqlschema.DB{Conn: wsql.BeginnerFromPgx(down)}
	}
	require.ErrorIs(t, deliver(mw(exactlyonce.Config{DB: unreachable, Consumer: "orders"}).Middleware(noop), "y"), exactlyonce.ErrDBUnavailable)
	require.NoError(t, deliver(mw(exactlyonce.Config{DB: unreachable, Consumer: "orders", FailOpen: true}).Middleware(noop), "z"))

	// Lease mode: a held lease, a takeover after the lease expired, and
	// the first attempt's completion refused (lease lost).
	lease := mw(exactlyonce.Config{DB: db, Consumer: "sms", Lease: &exactlyonce.LeaseConfig{Duration: time.Minute}})
	started, release := make(chan struct{}), make(chan struct{})
	var first sync.Once
	lh := lease.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		blocked := false
		first.Do(func() { blocked = true })
		if blocked {
			close(started)
			<-release
		}
		return nil, nil
	})
	firstErr := make(chan error, 1)
	go func() { firstErr <- deliver(lh, "sms-1") }()
	<-started
	require.ErrorIs(t, deliver(lh, "sms-1"), exactlyonce.ErrLeaseHeld)
	b.Exec(t, "UPDATE "+db.Inbox()+b.SQL(" SET lease_until = now() - interval '1 second' WHERE message_key = 'sms-1'",
		" SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE message_key = 'sms-1'"))
	require.NoError(t, deliver(lh, "sms-1"), "the takeover runs and completes")
	close(release)
	require.ErrorIs(t, <-firstErr, exactlyonce.ErrLeaseLost)

	s := scrape(t, reg)
	require.Equal(t, map[string]float64{
		`exactlyonce_deliveries_total{consumer="orders",outcome="processed"}`: 2,
		`exactlyonce_deliveries_total{consumer="orders",outcome="duplicate"}`: 1,
		`exactlyonce_deliveries_total{consumer="orders",outcome="parked"}`:    2,
		`exactlyonce_deliveries_total{consumer="orders",outcome="nacked"}`:    6,
		`exactlyonce_deliveries_total{consumer="orders",outcome="fail_open"}`: 1,
		`exactlyonce_deliveries_total{consumer="sms",outcome="processed"}`:    1,
		`exactlyonce_deliveries_total{consumer="sms",outcome="nacked"}`:       2,
	}, withPrefix(s, "exactlyonce_deliveries_total"))
	require.Equal(t, map[string]float64{
		`exactlyonce_delivery_errors_total{consumer="orders",reason="handler_error"}`:  1,
		`exactlyonce_delivery_errors_total{consumer="orders",reason="panic"}`:          1,
		`exactlyonce_delivery_errors_total{consumer="orders",reason="no_destination"}`: 1,
		`exactlyonce_delivery_errors_total{consumer="orders",reason="invalid_key"}`:    1,
		`exactlyonce_delivery_errors_total{consumer="orders",reason="claim_failed"}`:   1,
		`exactlyonce_delivery_errors_total{consumer="orders",reason="db_unavailable"}`: 1,
		`exactlyonce_delivery_errors_total{consumer="sms",reason="lease_held"}`:        1,
		`exactlyonce_delivery_errors_total{consumer="sms",reason="lease_lost"}`:        1,
	}, withPrefix(s, "exactlyonce_delivery_errors_total"))
	require.Equal(t, map[string]float64{`exactlyonce_keys_parked_total{consumer="orders"}`: 1}, withPrefix(s, "exactlyonce_keys_parked_total"))
	require.Equal(t, map[string]float64{`exactlyonce_lease_takeovers_total{consumer="sms"}`: 1}, withPrefix(s, "exactlyonce_lease_takeovers_total"))
	require.Equal(t, float64(2), s[`exactlyonce_delivery_duration_seconds_count{consumer="orders",outcome="processed"}`])
	require.Positive(t, s[`exactlyonce_delivery_duration_seconds_sum{consumer="orders",outcome="processed"}`])
	// One observation per event that reported a claim time.
	require.Equal(t, seen.claims(), withPrefix(s, "exactlyonce_claim_duration_seconds_count"))
}

func noop(*message.Message) ([]*message.Message, error) { return nil, nil }

// TestRouter runs the middleware under a real Watermill router, with the
// consumer named after the handler, and the metrics hook combined with
// another.
func TestRouter(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testRouter)
}

func testRouter(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	m, reg := newMetrics(t, metrics.Config{})
	var seen events
	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, OnEvent: seen.hook(m), Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubsub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(eo.Middleware)
	router.AddConsumerHandler("charge", "orders", pubsub, func(*message.Message) error { return nil })
	testenv.StartRouter(t, router)

	for _, uuid := range []string{"o-1", "o-2", "o-1", "o-3", "o-2", "o-1"} {
		require.NoError(t, pubsub.Publish("orders", message.NewMessage(uuid, nil)))
	}
	testenv.Eventually(t, 30*time.Second, func() bool {
		s := scrape(t, reg)
		return s[`exactlyonce_deliveries_total{consumer="charge",outcome="processed"}`] == 3 &&
			s[`exactlyonce_deliveries_total{consumer="charge",outcome="duplicate"}`] == 3
	}, "3 processed and 3 duplicates counted")
	s := scrape(t, reg)
	require.Len(t, withPrefix(s, "exactlyonce_deliveries_total"), 2)
	require.Empty(t, withPrefix(s, "exactlyonce_delivery_errors_total"))
	require.Equal(t, float64(6), s[`exactlyonce_delivery_duration_seconds_count{consumer="charge",outcome="processed"}`]+
		s[`exactlyonce_delivery_duration_seconds_count{consumer="charge",outcome="duplicate"}`])
	require.Equal(t, seen.claims(), withPrefix(s, "exactlyonce_claim_duration_seconds_count"))
}

// exactlyonce_batch_size shows that group commit batches: observed once
// per batch, its sum is the number of deliveries and its count the number
// of batches.
func TestBatchSize(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testBatchSize)
}

func testBatchSize(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	m, reg := newMetrics(t, metrics.Config{})
	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, OnEvent: m.OnEvent, Logger: watermill.NopLogger{},
		Batch: &exactlyonce.BatchConfig{MaxSize: 16, MaxWait: 100 * time.Millisecond}})
	require.NoError(t, err)
	pubsub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	defer pubsub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(eo.Middleware)
	router.AddConsumerHandler("charge", "orders", exactlyonce.ConcurrentSubscriber(pubsub, 16), func(*message.Message) error { return nil })
	testenv.StartRouter(t, router)

	const n = 64
	for i := range n {
		require.NoError(t, pubsub.Publish("orders", message.NewMessage(fmt.Sprintf("o-%d", i), nil)))
	}
	// ConcurrentSubscriber subscribes 16 times to the Go channel, which
	// hands every message to each subscription: 16 deliveries of each
	// message, one processed and the others duplicates, in batches too.
	// Read once every one of them is counted: a batch's size is observed
	// with one of its deliveries' events, the others are counted as their
	// own events come (read while the last batch's events came in, CI saw
	// 992 in batches against 976 counted).
	total := func(s map[string]float64) float64 {
		var d float64
		for _, v := range withPrefix(s, "exactlyonce_deliveries_total") {
			d += v
		}
		return d
	}
	testenv.Eventually(t, 30*time.Second, func() bool { return total(scrape(t, reg)) == 16*n }, "every delivery counted")
	s := scrape(t, reg)
	require.Equal(t, float64(n), s[`exactlyonce_deliveries_total{consumer="charge",outcome="processed"}`])
	deliveries := total(s)
	require.Equal(t, deliveries, s[`exactlyonce_batch_size_sum{consumer="charge"}`], "every delivery is in one batch")
	batches := s[`exactlyonce_batch_size_count{consumer="charge"}`]
	require.Positive(t, batches)
	require.Less(t, batches, deliveries/2, "deliveries were batched")
}
