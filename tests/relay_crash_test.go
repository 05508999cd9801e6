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

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/middleware"
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

// faultCrashingPublisher publishes one message at a time through its inner
// publisher and kills the process once `after` messages were published (and
// confirmed by the broker).
type faultCrashingPublisher struct {
	inner message.Publisher
	after int64
	n     atomic.Int64
}

func (p *faultCrashingPublisher) Publish(topic string, msgs ...*message.Message) error {
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

func (p *faultCrashingPublisher) Close() error { return p.inner.Close() }

// TestRelayCrashWorkerProcess is the worker of TestRelayCrashMidBatch, run in
// a subprocess. It does nothing in a normal test run.
func TestRelayCrashWorkerProcess(t *testing.T) {
	if !faultIsWorker(t.Name()) {
		return
	}
	d := faultDriver(t, faultEnv(t, relayCrashEnvDriver))
	tables := sqlschema.Config{Schema: faultEnv(t, relayCrashEnvSchema)}
	after, err := strconv.Atoi(faultEnv(t, relayCrashEnvAfter))
	require.NoError(t, err)

	pub := &faultCrashingPublisher{inner: testenv.AMQPPublisher(t), after: int64(after)}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: d.DB, Publisher: pub, Tables: tables, BatchSize: relayCrashBatchSize})
	require.NoError(t, err)
	ctx := faultCtx(t)
	for range relayCrashRows {
		_, err := relay.RelayOnce(ctx)
		require.NoError(t, err)
	}
	t.Fatalf("worker: relayed everything without reaching message %d", after)
}

func TestRelayCrashMidBatch(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := faultCtx(t)
			tables := testenv.Schema(t)
			faultCreateEffects(t, d.DB, tables)
			out := testenv.Queue(t, "rcrash_out_")
			conn := testenv.AMQPConn(t)

			// Fill the outbox in one transaction, as a handler would.
			uuids := make([]string, relayCrashRows)
			msgs := make([]*message.Message, relayCrashRows)
			for i := range msgs {
				uuids[i] = watermill.NewUUID()
				msgs[i] = message.NewMessage(uuids[i], fmt.Appendf(nil, `{"n":%d}`, i))
				msgs[i].SetContext(ctx)
			}
			tx, err := d.DB.BeginTx(ctx, nil)
			require.NoError(t, err)
			ob, err := outbox.NewPublisher(tx, outbox.PublisherConfig{Tables: tables})
			require.NoError(t, err)
			require.NoError(t, ob.Publish(out, msgs...))
			require.NoError(t, tx.Commit())
			require.Equal(t, int64(relayCrashRows), faultPending(t, d.DB, tables))

			code, output := faultRunWorker(t, "TestRelayCrashWorkerProcess", map[string]string{
				relayCrashEnvDriver: d.Name, relayCrashEnvSchema: tables.Schema,
				relayCrashEnvAfter: strconv.Itoa(relayCrashAfter),
			})
			require.Equal(t, relayCrashExitCode, code, "the relay worker must die mid-batch; output:\n%s", output)

			// The first batch was deleted; the half-published second one
			// was rolled back with the dead connection.
			require.Equal(t, int64(relayCrashRows-relayCrashBatchSize), faultPending(t, d.DB, tables))
			ready, _ := faultQueueState(t, conn, out)
			require.Equal(t, relayCrashAfter, ready, "messages the dead relay handed to the broker")

			// Restart the relay with the real publisher until the outbox is empty.
			relay, err := outbox.NewRelay(outbox.RelayConfig{
				DB: d.DB, Publisher: testenv.AMQPPublisher(t), Tables: tables, BatchSize: relayCrashBatchSize,
			})
			require.NoError(t, err)
			require.Equal(t, relayCrashRows-relayCrashBatchSize, faultRelayAll(t, relay, d.DB, tables))
			resent := relayCrashAfter - relayCrashBatchSize
			ready, _ = faultQueueState(t, conn, out)
			require.Equal(t, relayCrashRows+resent, ready)

			// A downstream consumer with the exactly-once middleware.
			var ev faultEvents
			var deliveries faultDeliveries
			eo, err := middleware.New(middleware.Config{DB: d.DB, Tables: tables, OnEvent: ev.Observe})
			require.NoError(t, err)
			r := faultNewRouter(t)
			r.AddMiddleware(deliveries.Middleware, eo.Middleware)
			r.AddConsumerHandler("relay-crash-downstream", out, testenv.AMQPSubscriber(t, 50),
				func(msg *message.Message) error {
					return faultInsertEffect(msg.Context(), tables, msg.UUID, "")
				})
			testenv.StartRouter(t, r)
			want := int64(relayCrashRows + resent)
			testenv.Eventually(t, faultWait, func() bool { return ev.Processed.Load()+ev.Duplicates.Load() == want },
				"downstream did not settle %d deliveries", want)
			require.NoError(t, r.Close())
			faultRequireQueueSettled(t, conn, out, 0)

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
			require.Equal(t, int(want), deliveries.Total())

			// Each effect exactly once.
			require.Equal(t, int64(relayCrashRows), faultEffects(t, d.DB, tables))
			require.Equal(t, int64(relayCrashRows), ev.Processed.Load())
			require.Equal(t, int64(resent), ev.Duplicates.Load())
			require.Equal(t, int64(0), ev.Failed.Load())
		})
	}
}
