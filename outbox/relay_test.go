package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// mixedMessages returns n messages spread over three topics, with each
// message's topic, in the order they are published.
func mixedMessages(n int) []delivered {
	topics := []string{"orders", "payments", "orders", "audit", "audit"}
	out := make([]delivered, n)
	for i := range out {
		out[i] = delivered{
			Topic:    topics[i%len(topics)],
			UUID:     fmt.Sprintf("msg-%04d", i),
			Payload:  fmt.Sprintf(`{"i":%d}`, i),
			Metadata: map[string]string{"i": fmt.Sprint(i), "source": "test"},
		}
	}
	return out
}

// publishAll writes want to the outbox in one transaction, one Publish call
// per message, so that topics interleave.
func (b bundle) publishAll(t testing.TB, want []delivered) {
	t.Helper()
	tx := b.begin(t)
	for _, d := range want {
		m := message.NewMessage(d.UUID, []byte(d.Payload))
		for k, v := range d.Metadata {
			m.Metadata.Set(k, v)
		}
		b.write(t, tx, d.Topic, m)
	}
	require.NoError(t, tx.Commit())
}

func TestFlushDeliversInOrder(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		want := mixedMessages(250)
		b.publishAll(t, want)

		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, Logger: testenv.Logger(t), BatchSize: 40})
		require.NoError(t, err)

		var sizes []int
		for {
			n, err := relay.Flush(b.ctx)
			require.NoError(t, err)
			if n == 0 {
				break
			}
			sizes = append(sizes, n)
			require.Less(t, len(sizes), 100, "Flush does not converge")
		}
		require.Equal(t, []int{40, 40, 40, 40, 40, 40, 10}, sizes)

		// Every message arrives once, with its topic, UUID, payload and
		// metadata, in id order (hence in order per topic).
		require.Equal(t, want, rec.delivered())
		require.Zero(t, b.pending(t, b.db), "relayed rows are deleted")

		st := relay.Stats()
		require.Equal(t, outbox.RelayStats{Relayed: 250, Batches: 7}, st)

		n, err := relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		require.Equal(t, int64(7), relay.Stats().Batches, "an empty poll is not a batch")
	})
}

func TestRelayGroupsConsecutiveTopics(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		var want []delivered
		for i, topic := range []string{"a", "a", "a", "b", "a", "a"} {
			want = append(want, delivered{Topic: topic, UUID: fmt.Sprint("u", i), Payload: "{}", Metadata: map[string]string{}})
		}
		b.publishAll(t, want)
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		n, err := relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 6, n)
		require.Equal(t, want, rec.delivered())
		require.Equal(t, 3, rec.calls, "one Publish per run of one topic: a,a,a | b | a,a")
	})
}

func TestRelayWithGoChannel(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
		t.Cleanup(func() { require.NoError(t, pubSub.Close()) })
		subCtx, cancel := context.WithCancel(b.ctx)
		t.Cleanup(cancel)
		orders, err := pubSub.Subscribe(subCtx, "orders")
		require.NoError(t, err)

		var want []delivered
		for _, d := range mixedMessages(50) {
			if d.Topic == "orders" {
				want = append(want, d)
			}
		}
		b.publishAll(t, want)

		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: pubSub, Logger: testenv.Logger(t), BatchSize: 7, PollInterval: 10 * time.Millisecond})
		require.NoError(t, err)
		stop := runRelay(t, relay)

		got := map[string]delivered{}
		timeout := time.After(15 * time.Second)
		for len(got) < len(want) {
			select {
			case m := <-orders:
				got[m.UUID] = delivered{Topic: "orders", UUID: m.UUID, Payload: string(m.Payload), Metadata: m.Metadata}
				m.Ack()
			case <-timeout:
				t.Fatalf("received %d of %d messages within 15s", len(got), len(want))
			}
		}
		for _, d := range want {
			require.Equal(t, d, got[d.UUID])
		}
		testenv.Eventually(t, 10*time.Second, func() bool {
			return b.pending(t, b.db) == 0 && relay.Stats().Relayed == int64(len(want))
		}, "relayed rows should be deleted")
		stop()
	})
}

func TestRelayPublisherFailure(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayPublisherFailure(asIs))
}

// relayPublisherFailure is the scenario of TestRelayPublisherFailure, its publisher wrapped by wrap.
func relayPublisherFailure(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		var want []delivered
		for i := range 10 {
			topic := "a"
			if i >= 5 {
				topic = "b"
			}
			want = append(want, delivered{Topic: topic, UUID: fmt.Sprint("u-", i), Payload: "{}", Metadata: map[string]string{"i": fmt.Sprint(i)}})
		}
		b.publishAll(t, want)

		rec := &recorder{failTopic: "b"}
		const backoff = 300 * time.Millisecond
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: wrap(rec), Logger: testenv.Logger(t), ErrorBackoff: backoff})
		require.NoError(t, err)

		polledAt := time.Now()
		n, err := relay.Flush(b.ctx)
		failedAt := time.Now()
		require.ErrorIs(t, err, errBrokerDown)
		require.Contains(t, err.Error(), `"b"`)
		require.Equal(t, 5, n, "the rows of topic a were handed over before b failed")
		require.Equal(t, int64(5), b.pending(t, b.db), "only the rows handed over are deleted; topic b's stay")
		require.Equal(t, want[:5], rec.delivered())
		st := relay.Stats()
		require.Equal(t, int64(1), st.Failures)
		require.Equal(t, int64(5), st.Relayed)
		require.Equal(t, int64(1), st.Batches)
		require.ErrorIs(t, st.LastError, errBrokerDown)
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		if _, batched := wrap(rec).(outbox.BatchPublisher); batched {
			require.Equal(t, int64(5), p.Failing, "topic b's rows were in the call: each failed")
		} else {
			require.Equal(t, int64(2), p.Failing, "two of topic b's rows failed alone: its other rows were left untried")
		}
		require.Zero(t, p.Quarantined)
		require.Zero(t, b.permanentFailures(t), "the broker's failures are not the messages' own")

		// The failed rows wait out their backoff, and topic b its pause,
		// instead of being retried at once: this poll begins within them.
		require.Less(t, time.Since(polledAt), backoff, "the machine is too slow for this check")
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Zero(t, n)

		// Recovery sends the rest; nothing handed over before is sent again.
		rec.setFailTopic("")
		time.Sleep(time.Until(failedAt.Add(backoff + 50*time.Millisecond)))
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 5, n)
		require.Equal(t, want, rec.delivered())
		require.Zero(t, b.pending(t, b.db))
		st = relay.Stats()
		require.Equal(t, int64(1), st.Failures)
		require.Equal(t, int64(10), st.Relayed)
		require.Equal(t, int64(2), st.Batches)
		require.ErrorIs(t, st.LastError, errBrokerDown, "LastError keeps the latest failure")
	}
}

func TestRelayRunRetriesFailures(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayRunRetriesFailures(asIs))
}

// relayRunRetriesFailures is the scenario of TestRelayRunRetriesFailures, its publisher wrapped by wrap.
func relayRunRetriesFailures(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		b.publishAll(t, mixedMessages(5)) // orders, payments, orders, audit, audit
		rec := &recorder{failTopic: "payments"}
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: wrap(rec), Logger: testenv.Logger(t),
			PollInterval: 5 * time.Millisecond, ErrorBackoff: 5 * time.Millisecond, MaxErrorBackoff: 20 * time.Millisecond,
		})
		require.NoError(t, err)
		stop := runRelay(t, relay)

		testenv.Eventually(t, 10*time.Second, func() bool { return relay.Stats().Failures >= 3 },
			"Run should keep retrying a failing batch")
		require.Equal(t, int64(1), b.pending(t, b.db), "the rows of the other topics were relayed and deleted")
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(1), p.Failing, "the payments row is failing, retried after its backoff")
		require.Zero(t, p.Quarantined, "its failures alone prove nothing after the other rows went out")

		rec.setFailTopic("")
		testenv.Eventually(t, 10*time.Second, func() bool { return b.pending(t, b.db) == 0 && relay.Stats().Relayed == 5 },
			"Run should relay the rest once the publisher recovers")
		want := mixedMessages(5)
		require.Equal(t, []delivered{want[0], want[2], want[3], want[4], want[1]}, rec.delivered(),
			"every row delivered once; the failing one after the others")
		stop()
	}
}

// A row whose metadata cannot be decoded is a defect no retry fixes: it is
// quarantined at once with the reason, and the rows behind it are relayed.
func TestRelayUnreadableMetadata(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.exec(t, "INSERT INTO "+b.tables.Outbox()+b.sql(` (topic, uuid, payload, metadata) VALUES ('t', 'u', '\x7b7d', '[1, 2]')`,
			` (topic, uuid, payload, metadata, created_at) VALUES ('t', 'u', X'7b7d', '[1, 2]', UTC_TIMESTAMP(6))`))
		want := mixedMessages(3)
		b.publishAll(t, want)
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		n, err := relay.Flush(b.ctx)
		require.Error(t, err)
		require.Contains(t, err.Error(), "unreadable metadata")
		require.Equal(t, 3, n, "the rows behind the unreadable one are relayed")
		require.Equal(t, want, rec.delivered())
		require.Equal(t, int64(1), b.pending(t, b.db))
		require.Equal(t, []string{"t/u"}, b.quarantined(t), "quarantined at once")
		var lastErr string
		require.NoError(t, seam.QueryRow(b.ctx, b.db, "SELECT last_error FROM "+b.tables.Outbox(), nil, &lastErr))
		require.Contains(t, lastErr, "unreadable metadata")
		require.Equal(t, int64(1), relay.Stats().Failures)
		require.Equal(t, int64(1), relay.Stats().Quarantined)
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, outbox.Pending{Count: 1, Quarantined: 1}, p)

		n, err = relay.Flush(b.ctx)
		require.NoError(t, err, "the quarantined row is skipped")
		require.Zero(t, n)
	})
}

func TestRelaysConcurrentlyNeverPublishTwice(t *testing.T) {
	t.Parallel()
	eachEngine(t, relaysConcurrently)
}

// relaysConcurrently runs two relays of 4 workers each on 2,000 rows and
// requires every row published once, and no batch failed.
func relaysConcurrently(t *testing.T, b bundle) {
	const n = 2000
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("c-%04d", i), []byte("{}"))
	}
	b.publish(t, "events", msgs...)

	rec := &recorder{}
	cfg := outbox.RelayConfig{DB: b.schema(), Publisher: rec, Logger: testenv.Logger(t), BatchSize: 25, Workers: 4, PollInterval: 5 * time.Millisecond}
	r1, err := outbox.NewRelay(cfg)
	require.NoError(t, err)
	r2, err := outbox.NewRelay(cfg)
	require.NoError(t, err)
	stop1 := runRelay(t, r1)
	stop2 := runRelay(t, r2)

	// Counters are read before stopping: a stop can interrupt an empty
	// poll, or the return of a commit the server already made, and that
	// is counted as a failed batch (see the report on Relay shutdown).
	testenv.Eventually(t, 30*time.Second, func() bool {
		return rec.count() >= n && b.pending(t, b.db) == 0 && r1.Stats().Relayed+r2.Stats().Relayed >= n
	}, "two relays should deliver all %d rows", n)
	require.Zero(t, r1.Stats().Failures+r2.Stats().Failures, "no batch failed: %v %v", r1.Stats().LastError, r2.Stats().LastError)
	relayed1, relayed2 := r1.Stats().Relayed, r2.Stats().Relayed
	stop1()
	stop2()

	seen := map[string]int{}
	for _, d := range rec.delivered() {
		seen[d.UUID]++
	}
	require.Len(t, seen, n, "every row is delivered")
	for uuid, c := range seen {
		require.Equal(t, 1, c, "row %s published %d times", uuid, c)
	}
	require.Equal(t, n, rec.count())
	require.Equal(t, int64(n), relayed1+relayed2)
	t.Logf("relay 1: %d rows, relay 2: %d rows", relayed1, relayed2)
}

// repeatableReadDB opens the driver named name as a role whose default
// isolation level is REPEATABLE READ (ALTER ROLE ... SET
// default_transaction_isolation, as shops set it).
func repeatableReadDB(t *testing.T, name string) wsql.Beginner {
	t.Helper()
	dbURL := testenv.DatabaseURLWithIsolation(t, testenv.RepeatableRead)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var db wsql.Beginner
	switch name {
	case "pgxpool":
		db = wsql.BeginnerFromPgx(testenv.PoolFor(t, dbURL))
	default:
		db = wsql.BeginnerFromStdSQL(testenv.StdDBFor(t, dbURL))
	}
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	var level string
	require.NoError(t, seam.QueryRow(ctx, tx, "SHOW transaction_isolation", nil, &level))
	require.NoError(t, tx.Rollback())
	require.Equal(t, "repeatable read", level, "the sessions' default isolation level")
	return db
}

// Under a database whose default isolation level is REPEATABLE READ, two
// relays working concurrently still never fail or publish a row twice: the
// relay's transactions are READ COMMITTED whatever the default (under
// REPEATABLE READ, SKIP LOCKED meeting a row another relay deleted after the
// snapshot fails with a serialization error).
func TestRelaysConcurrentlyUnderRepeatableReadDefault(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		name := "database-sql"
		if strings.HasSuffix(t.Name(), "/pgxpool") {
			name = "pgxpool"
		}
		b.db = repeatableReadDB(t, name)
		relaysConcurrently(t, b)
	})
}

func TestRelayRun(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, Logger: testenv.Logger(t), PollInterval: 5 * time.Millisecond, Workers: 2})
		require.NoError(t, err)

		// With nothing to do, Run returns promptly once cancelled.
		stop := runRelay(t, relay)
		b.publish(t, "t", message.NewMessage("first", nil))
		// Wait for the commit too (the row is gone), not just the publish:
		// a stop between the two would roll the batch back and re-send it.
		testenv.Eventually(t, 10*time.Second, func() bool { return rec.count() == 1 && b.pending(t, b.db) == 0 },
			"Run should relay a new row")

		// A running Relay refuses a second Run.
		err = relay.Run(b.ctx)
		require.Error(t, err)
		require.Contains(t, err.Error(), "already running")
		stop()

		// Once stopped, it can run again.
		stop = runRelay(t, relay)
		b.publish(t, "t", message.NewMessage("second", nil))
		testenv.Eventually(t, 10*time.Second, func() bool { return rec.count() == 2 && b.pending(t, b.db) == 0 },
			"a restarted Run should relay")
		stop()
		require.Equal(t, []string{"first", "second"}, []string{rec.delivered()[0].UUID, rec.delivered()[1].UUID})

		// A Run whose context is already done returns nil at once.
		cancelled, cancel := context.WithCancel(b.ctx)
		cancel()
		require.NoError(t, relay.Run(cancelled))
	})
}

// Close ends a running Run and waits for it: Run returns nil, and its
// LISTEN connection is gone when Close returns. A second Close is a no-op;
// a closed Relay's Run returns nil at once and relays nothing, while Flush
// still relays. Running is closed once Run relays, and stays closed.
func TestRelayClose(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, Logger: testenv.Logger(t), PollInterval: 5 * time.Millisecond, Workers: 2,
			ListenConnString: testenv.ListenConnString()})
		require.NoError(t, err)
		select {
		case <-relay.Running():
			t.Fatal("Running is closed before Run")
		default:
		}

		done := make(chan error, 1)
		go func() { done <- relay.Run(context.Background()) }()
		select {
		case <-relay.Running():
		case <-time.After(10 * time.Second):
			t.Fatal("Running was not closed within 10s of Run")
		}
		b.publish(t, "t", message.NewMessage("first", nil))
		testenv.Eventually(t, 10*time.Second, func() bool { return rec.count() == 1 && b.pending(t, b.db) == 0 }, "Run should relay a new row")
		if b.mysql() {
			require.False(t, relay.Stats().Listening, "no LISTEN on MySQL")
		} else {
			waitListening(t, relay)
		}

		require.NoError(t, relay.Close())
		require.False(t, relay.Stats().Listening, "Close returned while Run still listened")
		select {
		case err := <-done:
			require.NoError(t, err, "Run returns nil after Close")
		case <-time.After(10 * time.Second):
			t.Fatal("Run did not return within 10s of Close")
		}
		require.NoError(t, relay.Close(), "a second Close")
		<-relay.Running() // still closed

		b.publish(t, "t", message.NewMessage("second", nil))
		returnsAtOnce(t, relay)
		require.Equal(t, 1, rec.count(), "a closed Relay's Run relays nothing")
		n, err := relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n, "Flush relays after Close")
		require.Equal(t, []string{"first", "second"}, []string{rec.delivered()[0].UUID, rec.delivered()[1].UUID})
	})
}

// Close before Run: Run returns nil at once and relays nothing, Running
// is never closed; Close while Run starts ends it too.
func TestRelayCloseBeforeRun(t *testing.T) {
	t.Parallel()
	b := newBundle(t, context.Background(), testenv.Drivers(t)[0].DB, testenv.Schema(t))
	b.publish(t, "t", message.NewMessage("pending", nil))
	rec := &recorder{}
	newRelay := func() *outbox.Relay {
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, Logger: testenv.Logger(t), PollInterval: 5 * time.Millisecond})
		require.NoError(t, err)
		return relay
	}

	relay := newRelay()
	require.NoError(t, relay.Close())
	require.NoError(t, relay.Close())
	returnsAtOnce(t, relay)
	select {
	case <-relay.Running():
		t.Fatal("Running is closed, but Run never relayed")
	default:
	}
	require.Zero(t, rec.count())

	relay = newRelay()
	done := make(chan error, 1)
	go func() { done <- relay.Run(context.Background()) }()
	require.NoError(t, relay.Close())
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return within 10s of a Close made while it started")
	}
}

// returnsAtOnce requires relay.Run to return nil within 10s.
func returnsAtOnce(t *testing.T, relay *outbox.Relay) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- relay.Run(context.Background()) }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run of a closed Relay did not return within 10s")
	}
}

func TestNewRelayConfig(t *testing.T) {
	t.Parallel()
	db := sqlschema.DB{Conn: testenv.Drivers(t)[0].DB}
	rec := &recorder{}
	base := outbox.RelayConfig{DB: db, Publisher: rec}

	_, err := outbox.NewRelay(base)
	require.NoError(t, err, "defaults are valid")
	d := base.WithDefaults()
	require.Equal(t, 100, d.BatchSize)
	require.Equal(t, 1, d.Workers)
	require.Equal(t, 100*time.Millisecond, d.PollInterval)
	require.Equal(t, 500*time.Millisecond, d.ErrorBackoff)
	require.Equal(t, 15*time.Second, d.MaxErrorBackoff)
	require.Equal(t, 5, d.MaxAttempts)
	require.NotNil(t, d.Logger)
	require.Equal(t, "watermill_outbox", d.DB.OutboxTable)
	require.Equal(t, sqlschema.DB{}.WithDefaults().OutboxTable, d.DB.OutboxTable)
	require.Equal(t, db.Conn, d.DB.Conn, "WithDefaults keeps the connection")
	require.Zero(t, base.BatchSize, "WithDefaults returns a copy")

	for _, tc := range []struct {
		name  string
		edit  func(*outbox.RelayConfig)
		field string
	}{
		{"no DB", func(c *outbox.RelayConfig) { c.DB = sqlschema.DB{} }, "DB.Conn"},
		{"no DB.Conn", func(c *outbox.RelayConfig) { c.DB.Conn = nil }, "DB.Conn"},
		{"no Publisher", func(c *outbox.RelayConfig) { c.Publisher = nil }, "Publisher"},
		{"negative BatchSize", func(c *outbox.RelayConfig) { c.BatchSize = -1 }, "BatchSize"},
		{"huge BatchSize", func(c *outbox.RelayConfig) { c.BatchSize = 10001 }, "BatchSize"},
		{"negative Workers", func(c *outbox.RelayConfig) { c.Workers = -2 }, "Workers"},
		{"negative PollInterval", func(c *outbox.RelayConfig) { c.PollInterval = -time.Second }, "PollInterval"},
		{"negative ErrorBackoff", func(c *outbox.RelayConfig) { c.ErrorBackoff = -time.Second }, "ErrorBackoff"},
		{"MaxErrorBackoff below ErrorBackoff", func(c *outbox.RelayConfig) {
			c.ErrorBackoff = time.Minute
			c.MaxErrorBackoff = time.Second
		}, "MaxErrorBackoff"},
		{"bad table", func(c *outbox.RelayConfig) { c.DB.OutboxTable = `x"; DROP TABLE y; --` }, "DB.OutboxTable"},
		{"MaxAttempts below 1", func(c *outbox.RelayConfig) { c.MaxAttempts = -1 }, "MaxAttempts"},
	} {
		cfg := base
		tc.edit(&cfg)
		_, err := outbox.NewRelay(cfg)
		require.Error(t, err, tc.name)
		require.Contains(t, err.Error(), tc.field, "%s: the error names the field", tc.name)
		require.True(t, strings.HasPrefix(err.Error(), "outbox: RelayConfig"), err.Error())
	}
	_, err = outbox.NewRelay(outbox.RelayConfig{DB: sqlschema.DB{Conn: db.Conn, Schema: "1x"}, Publisher: rec})
	require.ErrorContains(t, err, "invalid SQL identifier")
	require.ErrorContains(t, err, "DB.Schema")
}

// cancellingPublisher accepts the messages, and meanwhile the process is
// asked to stop (SIGTERM arrives while the broker confirms).
type cancellingPublisher struct{ cancel context.CancelFunc }

func (p cancellingPublisher) Publish(string, ...*message.Message) error { p.cancel(); return nil }
func (p cancellingPublisher) Close() error                              { return nil }

func TestRelayShutdownAfterPublishStillDeletes(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.publish(t, "t", message.NewMessage("m1", nil))
		ctx, cancel := context.WithCancel(b.ctx)
		defer cancel()
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: cancellingPublisher{cancel}, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		n, err := relay.Flush(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Zero(t, b.pending(t, b.db), "the broker has the batch: it must be deleted, not re-sent after a restart")
		require.Zero(t, relay.Stats().Failures, "a shutdown is not a failure")
		require.Equal(t, int64(1), relay.Stats().Relayed)

		// A cancelled context before the poll: an error, not counted.
		_, err = relay.Flush(ctx)
		require.ErrorIs(t, err, context.Canceled)
		require.Zero(t, relay.Stats().Failures)
	})
}

// A message the broker can never take fails on its own, without blocking the
// rows behind it. Its publisher does not say the failure is the message's
// own: the row is retried with its backoff and reported as failing, never
// quarantined. With RelayConfig.IsPermanent recognising the error, it is
// quarantined after MaxAttempts failures, and the rows behind it go out.
func TestRelayQuarantinesUnpublishableRow(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayQuarantinesUnpublishableRow(asIs))
}

// relayQuarantinesUnpublishableRow is the scenario of TestRelayQuarantinesUnpublishableRow, its publisher wrapped by wrap.
func relayQuarantinesUnpublishableRow(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		msgs := mixedMessages(3)
		b.publishAll(t, msgs[:1])
		rec := &recorder{failUUID: msgs[0].UUID}
		cfg := outbox.RelayConfig{
			DB: b.schema(), Publisher: wrap(rec), Logger: testenv.Logger(t), MaxAttempts: 3, BatchSize: 10,
			ErrorBackoff: time.Microsecond, MaxErrorBackoff: time.Microsecond, // due again at once
		}
		relay, err := outbox.NewRelay(cfg)
		require.NoError(t, err)

		// Nothing says the error is the message's own: retried, reported as
		// failing, never quarantined.
		for range 4 {
			_, err := relay.Flush(b.ctx)
			require.ErrorIs(t, err, errUnpublishable)
		}
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(1), p.Failing)
		require.Zero(t, p.Quarantined)
		require.Zero(t, b.permanentFailures(t))

		// The user's predicate says it is: each failure counts, and the
		// third quarantines it, while a good row goes out in every batch.
		cfg.IsPermanent = func(err error) bool { return errors.Is(err, errUnpublishable) }
		relay, err = outbox.NewRelay(cfg)
		require.NoError(t, err)
		for i := range 3 {
			b.publishAll(t, []delivered{{Topic: "orders", UUID: fmt.Sprint("good-", i), Payload: "{}", Metadata: map[string]string{}}})
			n, err := relay.Flush(b.ctx)
			require.ErrorIs(t, err, errUnpublishable)
			require.Equal(t, 1, n)
			require.Equal(t, int64(i+1), b.permanentFailures(t), "batch %d", i)
			if i < 2 {
				require.Empty(t, b.quarantined(t), "batch %d", i)
			}
		}
		require.Equal(t, []string{"orders/" + msgs[0].UUID}, b.quarantined(t))
		require.Equal(t, int64(1), relay.Stats().Quarantined)
		n, err := relay.Flush(b.ctx)
		require.NoError(t, err, "quarantined: skipped")
		require.Zero(t, n)
		p, err = mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(1), p.Count)
		require.Zero(t, p.Failing, "a quarantined row is not counted as failing")
		require.Equal(t, int64(1), p.Quarantined)
		require.Nil(t, p.OldestCreatedAt, "the lag is that of the live stream")
		var lastErr string
		var failures int
		require.NoError(t, seam.QueryRow(b.ctx, b.db, "SELECT last_error, failures FROM "+b.tables.Outbox(), nil, &lastErr, &failures))
		require.Contains(t, lastErr, "too large for the broker")
		require.Equal(t, 7, failures)

		// Fixed: requeue, and it goes out.
		rec.mu.Lock()
		rec.failUUID = ""
		rec.mu.Unlock()
		requeued, err := mustStore(t, b.schema()).RequeueFailed(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(1), requeued)
		p, err = mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, outbox.Pending{Count: 1, OldestCreatedAt: p.OldestCreatedAt, OldestAge: p.OldestAge}, p, "nothing failing or quarantined")
		require.Zero(t, b.permanentFailures(t))
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Zero(t, b.pending(t, b.db))
	}
}
