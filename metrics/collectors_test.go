package metrics_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/metrics"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// writeOutbox commits msgs to db's outbox table for topic.
func writeOutbox(t testing.TB, ctx context.Context, db sqlschema.DB, topic string, uuids ...string) {
	t.Helper()
	tx, err := db.Conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback()
	w, err := outbox.NewWriter(db)
	require.NoError(t, err)
	pub, err := w.Publisher(tx)
	require.NoError(t, err)
	for _, u := range uuids {
		require.NoError(t, pub.Publish(topic, message.NewMessage(u, []byte("{}"))))
	}
	require.NoError(t, tx.Commit())
}

// seedOutbox inserts rows of topic and ordering key ("" for none) into
// b's outbox table, as a writer would have (created now).
func seedOutbox(t testing.TB, b *testenv.Bundle, topic, key string, uuids ...string) {
	t.Helper()
	for _, u := range uuids {
		b.Exec(t, `INSERT INTO `+b.DB.Outbox()+b.SQL(
			` (topic, uuid, payload, metadata, created_at, ordering_key) VALUES ($1, $2, '{}', '{}', now(), NULLIF($3, ''))`,
			` (topic, uuid, payload, metadata, created_at, ordering_key) VALUES (?, ?, '{}', '{}', UTC_TIMESTAMP(6), NULLIF(?, ''))`),
			topic, u, key)
	}
}

func TestWatchOutbox(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		db := b.DB
		now := b.SQL("now()", "UTC_TIMESTAMP(6)")
		ago := func(pg, mysql string) string {
			return b.SQL("now() - interval '"+pg+"'", "UTC_TIMESTAMP(6) - INTERVAL "+mysql)
		}
		m, reg := newMetrics(t, metrics.Config{})
		require.NoError(t, m.WatchOutbox(db))

		empty := map[string]float64{
			"exactlyonce_outbox_pending_rows":               0,
			"exactlyonce_outbox_failing_rows":               0,
			"exactlyonce_outbox_quarantined_rows":           0,
			"exactlyonce_outbox_blocked_keys":               0,
			"exactlyonce_outbox_blocked_rows":               0,
			"exactlyonce_outbox_oldest_pending_age_seconds": 0,
			"exactlyonce_outbox_scrape_errors_total":        0,
		}
		require.Equal(t, empty, withPrefix(scrape(t, reg), "exactlyonce_outbox_"))

		// Four rows: the oldest ten minutes old, one failing, one quarantined
		// (older still, but not part of the lag).
		seedOutbox(t, b, "t", "", "o-1", "o-2", "o-3", "o-4")
		b.Exec(t, "UPDATE "+db.Outbox()+" SET created_at = "+ago("10 minutes", "10 MINUTE")+" WHERE uuid = 'o-1'")
		b.Exec(t, "UPDATE "+db.Outbox()+" SET failures = 2 WHERE uuid = 'o-2'")
		b.Exec(t, "UPDATE "+db.Outbox()+" SET quarantined_at = "+now+", failures = 5, created_at = "+ago("1 hour", "1 HOUR")+" WHERE uuid = 'o-3'")
		s := withPrefix(scrape(t, reg), "exactlyonce_outbox_")
		age := s["exactlyonce_outbox_oldest_pending_age_seconds"]
		require.GreaterOrEqual(t, age, 600.0)
		require.Less(t, age, 660.0, "the quarantined row is not the lag")
		delete(s, "exactlyonce_outbox_oldest_pending_age_seconds")
		require.Equal(t, map[string]float64{
			"exactlyonce_outbox_pending_rows":        4,
			"exactlyonce_outbox_failing_rows":        1,
			"exactlyonce_outbox_quarantined_rows":    1,
			"exactlyonce_outbox_blocked_keys":        0,
			"exactlyonce_outbox_blocked_rows":        0,
			"exactlyonce_outbox_scrape_errors_total": 0,
		}, s)

		// Rows of ordering key A behind a quarantined row of A are blocked
		// (the rows above have no key: they block nothing).
		seedOutbox(t, b, "t", "A", "a-1", "a-2", "a-3")
		b.Exec(t, "UPDATE "+db.Outbox()+" SET quarantined_at = "+now+", failures = 1 WHERE uuid = 'a-1'")
		s = withPrefix(scrape(t, reg), "exactlyonce_outbox_")
		require.Equal(t, 7.0, s["exactlyonce_outbox_pending_rows"])
		require.Equal(t, 2.0, s["exactlyonce_outbox_quarantined_rows"])
		require.Equal(t, 1.0, s["exactlyonce_outbox_blocked_keys"])
		require.Equal(t, 2.0, s["exactlyonce_outbox_blocked_rows"], "a-2 and a-3 wait behind a-1")
		b.Exec(t, "DELETE FROM "+db.Outbox()+" WHERE uuid LIKE 'a-%'")

		// A query that fails: counted, and no made-up value for the gauges.
		m2, reg2 := newMetrics(t, metrics.Config{})
		require.NoError(t, m2.WatchOutbox(sqlschema.DB{Conn: db.Conn, Dialect: db.Dialect, Schema: testenv.Unique(t, "nm_")}))
		require.Equal(t, map[string]float64{"exactlyonce_outbox_scrape_errors_total": 1}, withPrefix(scrape(t, reg2), "exactlyonce_outbox_"))
		require.Equal(t, map[string]float64{"exactlyonce_outbox_scrape_errors_total": 2}, withPrefix(scrape(t, reg2), "exactlyonce_outbox_"))
		// Watching another db replaces it.
		require.NoError(t, m2.WatchOutbox(db))
		require.Equal(t, float64(4), scrape(t, reg2)["exactlyonce_outbox_pending_rows"])

		require.ErrorContains(t, m.WatchOutbox(sqlschema.DB{}), "DB.Conn is nil")
		require.ErrorContains(t, m.WatchOutbox(sqlschema.DB{Conn: db.Conn, Dialect: db.Dialect, OutboxTable: "no such"}), "DB.OutboxTable")
	})
}

// flaky is a publisher that refuses the messages of one topic.
type flaky struct {
	mu      sync.Mutex
	refuse  string
	publish int
}

func (p *flaky) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if topic == p.refuse {
		return errors.New("broker refuses this topic (test)")
	}
	p.publish += len(msgs)
	return nil
}

func (p *flaky) Close() error { return nil }

func TestWatchRelay(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testWatchRelay)
}

func testWatchRelay(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m, reg := newMetrics(t, metrics.Config{})
	pub := &flaky{refuse: "refused"}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: pub, Logger: watermill.NopLogger{}, ErrorBackoff: time.Millisecond, MaxErrorBackoff: time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, m.WatchRelay(relay))
	require.NoError(t, m.WatchRelay(relay), "watching a relay twice counts it once")

	zero := map[string]float64{
		"exactlyonce_relay_relayed_total":          0,
		"exactlyonce_relay_batches_total":          0,
		"exactlyonce_relay_failed_batches_total":   0,
		"exactlyonce_relay_failed_publishes_total": 0,
		"exactlyonce_relay_quarantined_total":      0,
		"exactlyonce_relay_listening":              0,
	}
	require.Equal(t, zero, withPrefix(scrape(t, reg), "exactlyonce_relay_"))

	// Three rows relayed, one refused, one whose metadata cannot be decoded
	// (quarantined at once).
	writeOutbox(t, ctx, db, "ok", "r-1", "r-2", "r-3")
	writeOutbox(t, ctx, db, "refused", "r-4")
	writeOutbox(t, ctx, db, "ok", "r-5")
	b.Exec(t, "UPDATE "+db.Outbox()+` SET metadata = '{"a": [1]}' WHERE uuid = 'r-5'`)
	n, err := relay.Flush(ctx)
	require.Error(t, err)
	require.Equal(t, 3, n)

	st := relay.Stats()
	require.Equal(t, int64(3), st.Relayed)
	require.Equal(t, map[string]float64{
		"exactlyonce_relay_relayed_total":          3,
		"exactlyonce_relay_batches_total":          float64(st.Batches),
		"exactlyonce_relay_failed_batches_total":   1,
		"exactlyonce_relay_failed_publishes_total": float64(st.FailedPublishes),
		"exactlyonce_relay_quarantined_total":      1,
		"exactlyonce_relay_listening":              0,
	}, withPrefix(scrape(t, reg), "exactlyonce_relay_"))
	require.Equal(t, int64(1), st.Batches)
	require.Positive(t, st.FailedPublishes)

	// Run follows: once the topic is accepted, the refused row goes out,
	// and the counters follow the Relay at each scrape.
	pub.mu.Lock()
	pub.refuse = ""
	pub.mu.Unlock()
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(runCtx) }()
	testenv.Eventually(t, 30*time.Second, func() bool {
		return scrape(t, reg)["exactlyonce_relay_relayed_total"] == 4
	}, "the fourth message relayed")
	if b.MySQL() {
		require.Zero(t, scrape(t, reg)["exactlyonce_relay_listening"], "no LISTEN on MySQL: the relay polls")
	} else {
		testenv.Eventually(t, 10*time.Second, func() bool {
			return scrape(t, reg)["exactlyonce_relay_listening"] == 1
		}, "a running relay listens (wake-on-commit)")
	}
	stop()
	require.NoError(t, <-done)
	require.Zero(t, scrape(t, reg)["exactlyonce_relay_listening"], "a stopped relay does not")

	// A second relay's counters are added.
	relay2, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: pub, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	require.NoError(t, m.WatchRelay(relay2))
	writeOutbox(t, ctx, db, "ok", "r-6", "r-7")
	n, err = relay2.Flush(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, float64(6), scrape(t, reg)["exactlyonce_relay_relayed_total"])
}

func TestWatchInbox(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testWatchInbox)
}

func testWatchInbox(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m, reg := newMetrics(t, metrics.Config{InboxInterval: time.Hour})
	store, err := inbox.NewStore(db)
	require.NoError(t, err)

	// Records through the middleware: "orders" with two done and one
	// parked, "sms" with one done.
	deliver := func(consumer, uuid string, herr error) {
		eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Consumer: consumer, OnEvent: m.OnEvent, Logger: watermill.NopLogger{}})
		require.NoError(t, err)
		msg := message.NewMessage(uuid, nil)
		msg.SetContext(ctx)
		_, err = eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, herr })(msg)
		require.NoError(t, err)
	}
	deliver("orders", "k-1", nil)
	deliver("orders", "k-2", nil)
	deliver("orders", "k-3", exactlyonce.Permanent(errors.New("never")))
	deliver("sms", "k-1", nil)

	require.Empty(t, withPrefix(scrape(t, reg), "exactlyonce_inbox_rows"), "nothing watched yet")
	require.NoError(t, m.WatchInbox(store, "orders", "sms", "nobody"))
	require.Equal(t, map[string]float64{
		`exactlyonce_inbox_rows{consumer="orders",status="done"}`:       2,
		`exactlyonce_inbox_rows{consumer="orders",status="parked"}`:     1,
		`exactlyonce_inbox_rows{consumer="orders",status="failed"}`:     0,
		`exactlyonce_inbox_rows{consumer="orders",status="discarded"}`:  0,
		`exactlyonce_inbox_rows{consumer="orders",status="processing"}`: 0,
		`exactlyonce_inbox_rows{consumer="sms",status="done"}`:          1,
		`exactlyonce_inbox_rows{consumer="sms",status="parked"}`:        0,
		`exactlyonce_inbox_rows{consumer="sms",status="failed"}`:        0,
		`exactlyonce_inbox_rows{consumer="sms",status="discarded"}`:     0,
		`exactlyonce_inbox_rows{consumer="sms",status="processing"}`:    0,
		`exactlyonce_inbox_rows{consumer="nobody",status="done"}`:       0,
		`exactlyonce_inbox_rows{consumer="nobody",status="parked"}`:     0,
		`exactlyonce_inbox_rows{consumer="nobody",status="failed"}`:     0,
		`exactlyonce_inbox_rows{consumer="nobody",status="discarded"}`:  0,
		`exactlyonce_inbox_rows{consumer="nobody",status="processing"}`: 0,
		`exactlyonce_inbox_scrape_errors_total`:                         0,
	}, withPrefix(scrape(t, reg), "exactlyonce_inbox_rows", "exactlyonce_inbox_scrape"))

	// Within the interval a scrape does not query: a new record shows
	// only after it.
	deliver("sms", "k-2", nil)
	require.Equal(t, float64(1), scrape(t, reg)[`exactlyonce_inbox_rows{consumer="sms",status="done"}`], "cached")

	// The whole table, refreshed at every scrape with a short interval.
	m2, reg2 := newMetrics(t, metrics.Config{InboxInterval: time.Nanosecond})
	require.NoError(t, m2.WatchInbox(store))
	s := withPrefix(scrape(t, reg2), "exactlyonce_inbox_rows")
	require.Equal(t, map[string]float64{
		`exactlyonce_inbox_rows{consumer="",status="done"}`:       4,
		`exactlyonce_inbox_rows{consumer="",status="parked"}`:     1,
		`exactlyonce_inbox_rows{consumer="",status="failed"}`:     0,
		`exactlyonce_inbox_rows{consumer="",status="discarded"}`:  0,
		`exactlyonce_inbox_rows{consumer="",status="processing"}`: 0,
	}, s)
	deliver("sms", "k-3", nil)
	require.Equal(t, float64(5), scrape(t, reg2)[`exactlyonce_inbox_rows{consumer="",status="done"}`])

	// Retention: the rows a purge removed, reported through ObservePurge.
	b.Exec(t, "UPDATE "+db.Inbox()+b.SQL(" SET processed_at = now() - interval '2 days' WHERE status = 'done'",
		" SET processed_at = UTC_TIMESTAMP(6) - INTERVAL 2 DAY WHERE status = 'done'"))
	n, err := store.Purge(ctx, inbox.PurgeOptions{OlderThan: 24 * time.Hour})
	require.NoError(t, err)
	require.Equal(t, int64(5), n)
	m2.ObservePurge(n)
	s = scrape(t, reg2)
	require.Equal(t, float64(5), s["exactlyonce_inbox_purged_rows_total"])
	require.Contains(t, s, "exactlyonce_inbox_last_purge_timestamp_seconds")
	require.Equal(t, float64(0), s[`exactlyonce_inbox_rows{consumer="",status="done"}`])

	// A query that fails: counted, the gauges left out, and not retried
	// before the interval passed.
	m3, reg3 := newMetrics(t, metrics.Config{InboxInterval: time.Hour})
	bad, err := inbox.NewStore(sqlschema.DB{Dialect: db.Dialect, Conn: db.Conn, Schema: testenv.Unique(t, "nm_")})
	require.NoError(t, err)
	require.NoError(t, m3.WatchInbox(bad))
	require.Equal(t, map[string]float64{"exactlyonce_inbox_scrape_errors_total": 1, "exactlyonce_inbox_purged_rows_total": 0},
		withPrefix(scrape(t, reg3), "exactlyonce_inbox_"))
	require.Equal(t, map[string]float64{"exactlyonce_inbox_scrape_errors_total": 1, "exactlyonce_inbox_purged_rows_total": 0},
		withPrefix(scrape(t, reg3), "exactlyonce_inbox_"), "not queried again within the interval")
	// Watching a store that works queries at once.
	require.NoError(t, m3.WatchInbox(store, "orders"))
	require.Equal(t, float64(1), scrape(t, reg3)[`exactlyonce_inbox_rows{consumer="orders",status="parked"}`])
}
