package main

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// writeOutbox writes n messages to topic through outbox.Publisher in one
// committed transaction, as a service would; it returns their UUIDs.
func writeOutbox(t *testing.T, db sqlschema.DB, topic string, n int) []string {
	t.Helper()
	ctx := testCtx(t)
	tx, err := db.Conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback() //nolint:errcheck // after Commit: a no-op
	w, err := outbox.NewWriter(db)
	require.NoError(t, err)
	pub, err := w.Publisher(tx)
	require.NoError(t, err)
	var uuids []string
	for i := range n {
		id := fmt.Sprintf("%s-%03d", topic, i)
		msg := message.NewMessage(id, []byte("payload "+strconv.Itoa(i)))
		msg.Metadata.Set("seq", strconv.Itoa(i))
		msg.SetContext(ctx)
		require.NoError(t, pub.Publish(topic, msg))
		uuids = append(uuids, id)
	}
	require.NoError(t, tx.Commit())
	return uuids
}

type outboxStatsJSON struct {
	Pending          int64   `json:"pending"`
	OldestCreatedAt  *string `json:"oldest_created_at"`
	OldestAgeSeconds float64 `json:"oldest_age_seconds"`
	Failing          int64   `json:"failing"`
	Quarantined      int64   `json:"quarantined"`
	BlockedKeys      int64   `json:"blocked_keys"`
	BlockedRows      int64   `json:"blocked_rows"`
}

type outboxPendingJSON struct {
	Count int          `json:"count"`
	Limit int          `json:"limit"`
	Rows  []pendingRow `json:"rows"`
}

// outbox stats, pending (all, --quarantined, --failing) and requeue-failed
// on real rows: one quarantined, one failing in its backoff, the others
// ready.
func TestOutboxCommands(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testOutboxCommands)
}

func testOutboxCommands(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := engineEnv(b)

	var st outboxStatsJSON
	decode(t, cli(t, env, "outbox", "stats", "--json"), &st)
	require.Equal(t, outboxStatsJSON{}, st)
	r := cli(t, env, "outbox", "pending")
	requireOK(t, r)
	require.Equal(t, "No rows.\n", r.stdout)

	uuids := writeOutbox(t, db, "orders.charged", 4)
	ctx := testCtx(t)
	_, err := db.Conn.ExecContext(ctx, b.SQL(`UPDATE `+db.Outbox()+` SET failures = 6, attempts = 5, quarantined_at = now(),
 last_error = 'Exception (406) PRECONDITION_FAILED - message size larger than max' WHERE uuid = $1`,
		`UPDATE `+db.Outbox()+` SET failures = 6, attempts = 5, quarantined_at = UTC_TIMESTAMP(6),
 last_error = 'Exception (406) PRECONDITION_FAILED - message size larger than max' WHERE uuid = ?`), uuids[1])
	require.NoError(t, err)
	_, err = db.Conn.ExecContext(ctx, b.SQL(`UPDATE `+db.Outbox()+` SET failures = 2, attempts = 0, next_attempt_at = now() + interval '1 hour',
 last_error = 'NO_ROUTE' WHERE uuid = $1`, `UPDATE `+db.Outbox()+` SET failures = 2, attempts = 0, next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR,
 last_error = 'NO_ROUTE' WHERE uuid = ?`), uuids[2])
	require.NoError(t, err)

	decode(t, cli(t, env, "outbox", "stats", "--json"), &st)
	require.Equal(t, int64(4), st.Pending)
	require.Equal(t, int64(1), st.Failing)
	require.Equal(t, int64(1), st.Quarantined)
	require.NotNil(t, st.OldestCreatedAt)
	require.Less(t, st.OldestAgeSeconds, 60.0)
	r = cli(t, env, "outbox", "stats")
	requireOK(t, r)
	require.Regexp(t, `pending +4 `, r.stdout)
	require.Regexp(t, `quarantined +1 `, r.stdout)
	require.Contains(t, r.stdout, "exactlyonce outbox pending --quarantined")

	var p outboxPendingJSON
	decode(t, cli(t, env, "outbox", "pending", "--json"), &p)
	require.Equal(t, 4, p.Count)
	require.Equal(t, 50, p.Limit)
	for i, row := range p.Rows {
		require.Equal(t, uuids[i], row.UUID, "oldest first")
		require.Equal(t, "orders.charged", row.Topic)
		require.Equal(t, int64(len("payload 0")), row.PayloadBytes)
		require.NotNil(t, row.CreatedAt)
	}
	require.Equal(t, []string{"ready", "quarantined", "failing", "ready"},
		[]string{p.Rows[0].State, p.Rows[1].State, p.Rows[2].State, p.Rows[3].State})
	require.Equal(t, 6, p.Rows[1].Failures)
	require.Equal(t, 5, p.Rows[1].PermanentFailures)
	require.NotNil(t, p.Rows[1].QuarantinedAt)
	require.Contains(t, p.Rows[1].LastError, "PRECONDITION_FAILED")
	require.NotNil(t, p.Rows[2].NextAttemptAt)

	decode(t, cli(t, env, "outbox", "pending", "--json", "--quarantined"), &p)
	require.Len(t, p.Rows, 1)
	require.Equal(t, uuids[1], p.Rows[0].UUID)
	decode(t, cli(t, env, "outbox", "pending", "--json", "--failing"), &p)
	require.Len(t, p.Rows, 1)
	require.Equal(t, uuids[2], p.Rows[0].UUID)
	decode(t, cli(t, env, "outbox", "pending", "--json", "--limit", "2"), &p)
	require.Equal(t, 2, p.Count)

	r = cli(t, env, "outbox", "pending", "--limit", "3")
	requireOK(t, r)
	require.Regexp(t, `orders.charged +orders.charged-001 +\S+ +quarantined +6 \(5 permanent\) +Exception \(406\) PRECONDITION_FAILED`, r.stdout)
	require.Regexp(t, `orders.charged-002 +\S+ +retry in (5\dm\S*|1h) +2 \(0 permanent\) +NO_ROUTE`, r.stdout)
	require.Contains(t, r.stdout, "The first 3 rows")

	var rq struct {
		Requeued int64 `json:"requeued"`
	}
	decode(t, cli(t, env, "outbox", "requeue-failed", "--json"), &rq)
	require.Equal(t, int64(2), rq.Requeued)
	decode(t, cli(t, env, "outbox", "stats", "--json"), &st)
	require.Equal(t, int64(4), st.Pending)
	require.Zero(t, st.Failing)
	require.Zero(t, st.Quarantined)
	r = cli(t, env, "outbox", "requeue-failed")
	requireOK(t, r)
	require.Contains(t, r.stdout, "nothing to requeue")
}

type relaySummaryJSON struct {
	Relayed         int64   `json:"relayed"`
	Batches         int64   `json:"batches"`
	FailedBatches   int64   `json:"failed_batches"`
	FailedPublishes int64   `json:"failed_publishes"`
	Quarantined     int64   `json:"quarantined"`
	LastError       string  `json:"last_error"`
	Seconds         float64 `json:"seconds"`
	Outbox          *struct {
		Pending          int64   `json:"pending"`
		OldestAgeSeconds float64 `json:"oldest_age_seconds"`
		Failing          int64   `json:"failing"`
		Quarantined      int64   `json:"quarantined"`
		BlockedKeys      int64   `json:"blocked_keys"`
		BlockedRows      int64   `json:"blocked_rows"`
	} `json:"outbox"`
}

// readQueue takes n messages from queue (acking them) and returns them by
// message_id.
func readQueue(t *testing.T, queue string, n int) map[string]amqp091.Delivery {
	t.Helper()
	ch, err := testenv.AMQPConn(t).Channel()
	require.NoError(t, err)
	defer ch.Close()
	got := map[string]amqp091.Delivery{}
	deadline := time.Now().Add(15 * time.Second)
	for len(got) < n {
		d, ok, err := ch.Get(queue, true)
		require.NoError(t, err)
		if !ok {
			require.True(t, time.Now().Before(deadline), "%d of %d messages in queue %s", len(got), n, queue)
			time.Sleep(20 * time.Millisecond)
			continue
		}
		require.NotContains(t, got, d.MessageId, "a message twice")
		got[d.MessageId] = d
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	require.Zero(t, q.Messages, "nothing more in the queue")
	return got
}

// uniqueQueue is a queue for the test, declared durable as the relay
// declares it (so that the test can read it before the relay's first
// publish), and deleted at cleanup.
func uniqueQueue(t *testing.T) string {
	t.Helper()
	name := testenv.Unique(t, "cli_q_")
	ch, err := testenv.AMQPConn(t).Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(name, true, false, false, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.Close())
	t.Cleanup(func() {
		conn, err := amqp091.Dial(testenv.AMQPURL())
		if err != nil {
			t.Errorf("deleting queue %s: %v", name, err)
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("deleting queue %s: %v", name, err)
			return
		}
		_, _ = ch.QueueDelete(name, false, false, false)
	})
	return name
}

// outbox relay --once against real RabbitMQ: every row reaches the queue
// named like its topic, with its UUID, payload and metadata, and the outbox
// is empty; then a broker that cannot be reached: exit status 1, the rows
// kept and counted as failing.
func TestRelayOnce(t *testing.T) {
	t.Parallel()
	requireRabbitMQ(t)
	testenv.EachEngine(t, testRelayOnce)
}

func testRelayOnce(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	queue := uniqueQueue(t)
	env := append(engineEnv(b), envAMQPURL+"="+testenv.AMQPURL())
	uuids := writeOutbox(t, db, queue, 25)

	r := cli(t, env, "outbox", "relay", "--once", "--json", "--batch-size", "10", "--workers", "2")
	requireOK(t, r)
	var sum relaySummaryJSON
	decode(t, r, &sum)
	require.Equal(t, int64(25), sum.Relayed)
	require.GreaterOrEqual(t, sum.Batches, int64(3))
	require.Zero(t, sum.FailedPublishes)
	require.Empty(t, sum.LastError)
	require.NotNil(t, sum.Outbox)
	require.Zero(t, sum.Outbox.Pending)
	require.Contains(t, r.stderr, `"msg":"outbox relay stopped"`, "logs are JSON with --json")

	got := readQueue(t, queue, 25)
	var ids []string
	for id, d := range got {
		ids = append(ids, id)
		seq := d.Headers["seq"]
		require.Equal(t, "payload "+fmt.Sprint(seq), string(d.Body), id)
		require.Equal(t, id, d.Headers["_watermill_message_uuid"])
	}
	sort.Strings(ids)
	require.Equal(t, uuids, ids)

	p, err := testenv.OutboxStore(t, db).Pending(testCtx(t))
	require.NoError(t, err)
	require.Zero(t, p.Count)

	r = cli(t, env, "outbox", "relay", "--once")
	requireOK(t, r)
	require.Contains(t, r.stdout, "Relayed 0 messages")

	// The broker is down: the rows stay, with their failure recorded.
	writeOutbox(t, db, queue, 3)
	down := append(engineEnv(b), envAMQPURL+"=amqp://guest:guest@127.0.0.1:1/")
	r = cli(t, down, "outbox", "relay", "--once")
	require.Equal(t, exitFailed, r.code, "%s", r)
	require.Contains(t, r.stdout, "Relayed 0 messages")
	require.Contains(t, r.stdout, "Outbox now: 3 pending, 3 failing, 0 quarantined.")
	require.Contains(t, r.stderr, "exactlyonce: outbox relay --once: 3 publishes failed")
	require.Contains(t, r.stderr, "connection refused")
	p, err = testenv.OutboxStore(t, db).Pending(testCtx(t))
	require.NoError(t, err)
	require.Equal(t, int64(3), p.Count)
	require.Equal(t, int64(3), p.Failing)
}

// syncBuffer is a bytes.Buffer safe for the command's output goroutines and
// the test reading it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// outbox relay without --once relays rows committed while it runs, and on
// SIGTERM stops cleanly: exit status 0 and the summary.
// The relay runs until SIGTERM, waking on commit: with a poll interval of an
// hour, the rows arrive because their commits woke it.
func TestRelayRunsUntilSignal(t *testing.T) {
	t.Parallel()
	requireRabbitMQ(t)
	testenv.EachEngine(t, testRelayRunsUntilSignal)
}

func testRelayRunsUntilSignal(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	queue := uniqueQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// PostgreSQL: rows committed by another process wake the relay
	// (LISTEN), it need not poll. MySQL has no LISTEN: it polls.
	poll := b.SQL("1h", "200ms")
	cmd := exec.CommandContext(ctx, binary, "outbox", "relay", "--poll-interval", poll, "--workers", "2")
	cmd.Env = append(cleanEnv(), append(engineEnv(b), envAMQPURL+"="+testenv.AMQPURL())...)
	var stdout, stderr syncBuffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	uuids := writeOutbox(t, db, queue, 10)
	got := readQueue(t, queue, 10)
	for _, id := range uuids {
		require.Contains(t, got, id)
	}

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-exited:
		require.NoError(t, err, "exit status 0 after SIGTERM\nstdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	case <-time.After(20 * time.Second):
		require.FailNow(t, "the relay did not stop within 20s of SIGTERM", "stderr:\n%s", stderr.String())
	}
	require.Contains(t, stdout.String(), "Relayed 10 messages")
	require.Contains(t, stdout.String(), "Outbox now: 0 pending")
	require.Contains(t, stderr.String(), "outbox relay stopping")
	require.Contains(t, stderr.String(), b.SQL("wake-on-commit is on", "not available on MySQL"))
	require.NotContains(t, stderr.String(), "level=ERROR")
}
