package tests

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The outbox relay dies in the middle of a batch: some of the batch's
// messages are already with the broker, the batch's rows are not deleted.
// The restarted relay sends those again (at-least-once towards the broker),
// each with its original UUID, and the next consumer's inbox drops the
// repeats: every effect applied exactly once.

const (
	relayCrashRows      = 500
	relayCrashBatchSize = 100
	// relayCrashAfter messages published, the worker dies: the first batch
	// is committed (deleted), the second is 30 messages in.
	relayCrashAfter = 130
	// relayCrashExitCode is the worker's exit code when it dies mid-batch.
	relayCrashExitCode = 4

	relayCrashEnvDriver = "FAULT_RELAY_CRASH_DRIVER"
	relayCrashEnvSchema = "FAULT_RELAY_CRASH_SCHEMA"
	relayCrashEnvAfter  = "FAULT_RELAY_CRASH_AFTER"
)

// crashingPublisher publishes one message at a time through its inner
// publisher and kills the process once `after` messages were published (and
// confirmed by the broker).
type crashingPublisher struct {
	inner message.Publisher
	after int64
	n     atomic.Int64
}

func (p *crashingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if err := p.inner.Publish(topic, m); err != nil {
			return err
		}
		if p.n.Add(1) == p.after {
			os.Exit(relayCrashExitCode)
		}
	}
	return nil
}

func (p *crashingPublisher) Close() error { return p.inner.Close() }

// TestRelayCrashWorkerProcess is the worker of TestRelayCrashMidBatch, run in
// a subprocess. It does nothing in a normal test run.
func TestRelayCrashWorkerProcess(t *testing.T) {
	if !isWorker(t.Name()) {
		return
	}
	d := testenv.DriverNamed(t, workerEnv(t, relayCrashEnvDriver))
	db := sqlschema.DB{Conn: d.DB, Schema: workerEnv(t, relayCrashEnvSchema)}
	after, err := strconv.Atoi(workerEnv(t, relayCrashEnvAfter))
	require.NoError(t, err)

	pub := &crashingPublisher{inner: testenv.AMQPPublisher(t), after: int64(after)}
	relay := newRelay(t, outbox.RelayConfig{DB: db, Publisher: pub, BatchSize: relayCrashBatchSize})
	ctx := testCtx(t)
	for range relayCrashRows {
		_, err := relay.Flush(ctx)
		require.NoError(t, err)
	}
	t.Fatalf("worker: relayed everything without reaching message %d", after)
}

func TestRelayCrashMidBatch(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		// Fill the outbox in one transaction, as a handler would.
		uuids := make([]string, relayCrashRows)
		msgs := make([]*message.Message, relayCrashRows)
		for i := range msgs {
			uuids[i] = watermill.NewUUID()
			msgs[i] = message.NewMessage(uuids[i], fmt.Appendf(nil, `{"n":%d}`, i))
			msgs[i].SetContext(e.Ctx)
		}
		tx := e.Begin(t)
		w, err := outbox.NewWriter(e.DB)
		require.NoError(t, err)
		ob, err := w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, ob.Publish(e.Out, msgs...))
		require.NoError(t, tx.Commit())
		require.Equal(t, int64(relayCrashRows), outboxPending(t, e.DB))

		code, output := runWorker(t, "TestRelayCrashWorkerProcess", map[string]string{
			relayCrashEnvDriver: e.Driver.Name, relayCrashEnvSchema: e.DB.Schema,
			relayCrashEnvAfter: strconv.Itoa(relayCrashAfter),
		})
		require.Equal(t, relayCrashExitCode, code, "the relay worker must die mid-batch; output:\n%s", output)

		// The first batch was deleted; the half-published second one
		// was rolled back with the dead connection.
		require.Equal(t, int64(relayCrashRows-relayCrashBatchSize), outboxPending(t, e.DB))
		ready, _ := queueState(t, e.Conn, e.Out)
		require.Equal(t, relayCrashAfter, ready, "messages the dead relay handed to the broker")

		// Restart the relay with the real publisher until the outbox is empty.
		relay := newRelay(t, outbox.RelayConfig{DB: e.DB, Publisher: testenv.AMQPPublisher(t), BatchSize: relayCrashBatchSize})
		require.Equal(t, relayCrashRows-relayCrashBatchSize, relayAll(t, relay, e.DB))
		resent := relayCrashAfter - relayCrashBatchSize
		ready, _ = queueState(t, e.Conn, e.Out)
		require.Equal(t, relayCrashRows+resent, ready)

		// A downstream consumer with the exactly-once middleware.
		var deliveries deliveryLog
		eo := e.Middleware(t, exactlyonce.Config{})
		r := newRouter(t)
		r.AddMiddleware(deliveries.Middleware, eo.Middleware)
		r.AddConsumerHandler("relay-crash-downstream", e.Out, testenv.AMQPSubscriber(t, 50),
			func(msg *message.Message) error {
				return e.Effects.Insert(msg.Context(), msg.UUID, 1)
			})
		testenv.StartRouter(t, r)
		want := int64(relayCrashRows + resent)
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Settled() == want },
			"downstream did not settle %d deliveries", want)
		closeRouter(t, r)
		requireQueueSettled(t, e.Conn, e.Out, 0)

		// Every row arrived at least once; the re-sent half batch twice.
		seen := deliveries.Seen()
		require.Len(t, seen, relayCrashRows)
		var twice []string
		for i, u := range uuids {
			require.GreaterOrEqual(t, seen[u], 1, "message %d (%s) was lost", i, u)
			if seen[u] > 1 {
				require.Equal(t, 2, seen[u], "message %d", i)
				twice = append(twice, u)
			}
		}
		require.Len(t, twice, resent)
		require.True(t, slices.Equal(uuids[relayCrashBatchSize:relayCrashAfter], twice),
			"the re-sent messages are the published part of the crashed batch")
		require.Equal(t, want, deliveries.Total())

		// Each effect exactly once.
		require.Equal(t, int64(relayCrashRows), e.Effects.Count(t, ""))
		require.Equal(t, int64(relayCrashRows), e.Count(t, `SELECT count(DISTINCT msg_key) FROM `+e.Effects.Name))
		require.Equal(t, int64(relayCrashRows), e.Log.Processed.Load())
		require.Equal(t, int64(resent), e.Log.Duplicates.Load())
		require.Equal(t, int64(0), e.Log.Failed.Load())
		require.Equal(t, int64(0), e.Log.ClaimFailed.Load())
	})
}
