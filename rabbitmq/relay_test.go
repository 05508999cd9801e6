package rabbitmq_test

// The outbox relay through the windowed Publisher, against the real
// PostgreSQL and RabbitMQ.

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// schema returns a fresh migrated schema (dropped at cleanup), skipping the
// test when PostgreSQL is unreachable, or failing it when CI=true.
func schema(t testing.TB) sqlschema.DB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, testenv.DatabaseURL())
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL unreachable (DATABASE_URL or the loopback default): %v", err)
		}
		t.Skipf("PostgreSQL unreachable (set DATABASE_URL, or run `docker compose up -d`): %v", err)
	}
	_ = conn.Close(ctx)
	return testenv.Schema(t)
}

// writeRows writes n rows alternating between the topics, in transactions
// of 500 through an outbox.Writer, and returns topic/uuid of each.
func writeRows(t testing.TB, ctx context.Context, db sqlschema.DB, prefix string, n int, topics ...string) []string {
	t.Helper()
	var keys []string
	w, err := outbox.NewWriter(db)
	require.NoError(t, err)
	for start := 0; start < n; start += 500 {
		tx, err := db.Conn.BeginTx(ctx, nil)
		require.NoError(t, err)
		pub, err := w.Publisher(tx)
		require.NoError(t, err)
		for i := start; i < min(start+500, n); i++ {
			topic := topics[i%len(topics)]
			m := message.NewMessage(fmt.Sprintf("%s-%05d", prefix, i), []byte(fmt.Sprintf(`{"i":%d}`, i)))
			m.Metadata.Set("i", fmt.Sprint(i))
			require.NoError(t, pub.Publish(topic, m))
			keys = append(keys, topic+"/"+m.UUID)
		}
		require.NoError(t, tx.Commit())
	}
	return keys
}

func pending(t testing.TB, db sqlschema.DB) outbox.Pending {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := testenv.OutboxStore(t, db).Pending(ctx)
	require.NoError(t, err)
	return p
}

// runRelay runs relay.Run until the test ends (or stop is called).
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
				require.NoError(t, err)
			case <-time.After(20 * time.Second):
				t.Error("Relay.Run did not return within 20s after cancel")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// countArrived consumes the queues and counts topic/uuid.
func countArrived(t *testing.T, amqpURL string, queues ...string) map[string]int {
	t.Helper()
	got := map[string]int{}
	for _, q := range queues {
		for uuid, n := range queueUUIDs(t, amqpURL, q) {
			got[q+"/"+uuid] += n
		}
	}
	return got
}

// Rows written through an outbox.Writer are relayed by outbox.Relay through
// rabbitmq.Publisher (each batch one PublishBatch call) while the connection
// to RabbitMQ is cut in the middle: every row arrives, with its UUID, and
// the outbox ends empty. A row arrives twice only if its confirm was lost in
// the cut (at most the messages in flight then).
func TestRelayThroughPublisherAcrossAConnectionCut(t *testing.T) {
	amqpURL := amqpURL(t)
	db := schema(t)
	ctx := testContext(t)
	qa, qb := uniqueQueue(t, amqpURL, "relay-a"), uniqueQueue(t, amqpURL, "relay-b")
	proxy, viaProxy := proxied(t, amqpURL)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: viaProxy})

	const (
		rows      = 6000
		batchSize = 250
		workers   = 2
	)
	want := writeRows(t, ctx, db, "r", rows, qa, qb)
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: db, Publisher: pub, Logger: testenv.Logger(t), BatchSize: batchSize, Workers: workers,
		PollInterval: 10 * time.Millisecond, ErrorBackoff: 50 * time.Millisecond, MaxErrorBackoff: 200 * time.Millisecond,
	})
	require.NoError(t, err)
	stop := runRelay(t, relay)

	conn, err := amqp091.Dial(amqpURL)
	require.NoError(t, err)
	defer conn.Close()
	depth := func(q string) int { // a fresh channel each time: a passive declaration of a missing queue closes it
		ch, err := conn.Channel()
		require.NoError(t, err)
		defer ch.Close()
		if st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil); err == nil {
			return st.Messages
		}
		return 0
	}
	testenv.Eventually(t, 30*time.Second, func() bool { return depth(qa)+depth(qb) >= rows/5 }, "the relay got going")
	proxy.Refuse()
	left := pending(t, db).Count
	time.Sleep(300 * time.Millisecond)
	proxy.Allow()
	t.Logf("connection cut with %d rows left", left)
	require.Positive(t, left, "the relay was done before the cut: nothing was tested")

	testenv.Eventually(t, 60*time.Second, func() bool { return pending(t, db).Count == 0 }, "the outbox is emptied")
	stop()
	st := relay.Stats()
	require.Positive(t, st.Failures, "the cut made batches fail")
	require.Zero(t, st.Quarantined)

	got := countArrived(t, amqpURL, qa, qb)
	dups := 0
	for _, k := range want {
		require.Positive(t, got[k], "row %s never arrived", k)
		dups += got[k] - 1
		delete(got, k)
	}
	require.Empty(t, got, "messages that are no row")
	t.Logf("%d rows, %d relayed (Stats), %d failed batches, %d duplicates", rows, st.Relayed, st.Failures, dups)
	require.LessOrEqual(t, dups, workers*batchSize, "only messages in flight at the cut may arrive twice")
	require.Equal(t, int64(rows), st.Relayed, "each row deleted once, after its confirm")
}

// A row the broker closes the channel for, among rows that flow: it fails
// alone (the messages in flight with it are published again), each failure
// is permanent (the broker refused the message itself), and it is
// quarantined after MaxAttempts; no other row is, and every other row
// arrives.
func TestRelayQuarantinesARowTheBrokerClosesTheChannelFor(t *testing.T) {
	amqpURL := amqpURL(t)
	db := schema(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "relay-poison")
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL, Marshaler: expiringMarshaler{}})
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: db, Publisher: pub, Logger: testenv.Logger(t), BatchSize: 50, MaxAttempts: 3,
		ErrorBackoff: time.Millisecond, MaxErrorBackoff: 5 * time.Millisecond,
	})
	require.NoError(t, err)

	want := writeRows(t, ctx, db, "before", 20, q)
	tx, err := db.Conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	w, err := outbox.NewWriter(db)
	require.NoError(t, err)
	op, err := w.Publisher(tx)
	require.NoError(t, err)
	poison := message.NewMessage("poison", []byte("{}"))
	poison.Metadata.Set("expiration", "not-a-number")
	require.NoError(t, op.Publish(q, poison))
	require.NoError(t, tx.Commit())

	for round := 0; pending(t, db).Quarantined == 0 && round < 50; round++ {
		want = append(want, writeRows(t, ctx, db, fmt.Sprint("r", round), 20, q)...)
		time.Sleep(6 * time.Millisecond) // the poison row is due again
		_, err := relay.Flush(ctx)
		if err != nil {
			require.ErrorContains(t, err, "PRECONDITION_FAILED")
		}
	}
	p := pending(t, db)
	require.Equal(t, int64(1), p.Quarantined, "the poison row is quarantined")
	require.Equal(t, int64(1), relay.Stats().Quarantined)
	for pending(t, db).Count > 1 {
		_, err := relay.Flush(ctx)
		require.NoError(t, err)
	}
	got := countArrived(t, amqpURL, q)
	require.Zero(t, got[q+"/poison"])
	for _, k := range want {
		require.Positive(t, got[k], "row %s never arrived", k)
	}
}
