package tests

import (
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The process dies after the middleware committed and before the router
// acked: the worst moment for an at-least-once broker. RabbitMQ requeues the
// unacked delivery when the dead process's connection drops; the restarted
// consumer must recognise it as a duplicate, and the handler's output
// messages, committed to the outbox with the effect, must still reach the
// next queue exactly as the dead process produced them.

const (
	crashConsumer = "crash-consumer"
	// crashExitCode is the worker's exit code when it dies after a commit.
	crashExitCode = 3

	crashEnvDriver = "FAULT_CRASH_DRIVER"
	crashEnvSchema = "FAULT_CRASH_SCHEMA"
	crashEnvIn     = "FAULT_CRASH_IN"
	crashEnvOut    = "FAULT_CRASH_OUT"
)

// crashHandler inserts the business row of msg, recording the UUIDs of the
// two output messages it returns (fresh UUIDs on every run), and returns
// them.
func crashHandler(tables sqlschema.Config, calls *atomic.Int64) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		outs := []*message.Message{
			message.NewMessage(watermill.NewUUID(), []byte(`{"event":"order-accepted"}`)),
			message.NewMessage(watermill.NewUUID(), []byte(`{"event":"sms-requested"}`)),
		}
		if err := faultInsertEffect(msg.Context(), tables, msg.UUID, outs[0].UUID+","+outs[1].UUID); err != nil {
			return nil, err
		}
		return outs, nil
	}
}

// TestCrashWorkerProcess is the worker of TestCrashAfterCommitBeforeAck,
// run in a subprocess. It does nothing in a normal test run.
func TestCrashWorkerProcess(t *testing.T) {
	if !faultIsWorker(t.Name()) {
		return
	}
	d := faultDriver(t, faultEnv(t, crashEnvDriver))
	tables := sqlschema.Config{Schema: faultEnv(t, crashEnvSchema)}
	in, out := faultEnv(t, crashEnvIn), faultEnv(t, crashEnvOut)

	eo, err := middleware.New(middleware.Config{
		DB: d.DB, Tables: tables,
		OnEvent: func(ev middleware.Event) {
			if ev.Kind == middleware.EventProcessed {
				// Committed; the router has not acked yet. Die now.
				os.Exit(crashExitCode)
			}
		},
	})
	require.NoError(t, err)
	var calls atomic.Int64
	r := faultNewRouter(t)
	h := r.AddHandler(crashConsumer, in, testenv.AMQPSubscriber(t, 1), out, testenv.AMQPPublisher(t), crashHandler(tables, &calls))
	h.AddMiddleware(eo.Middleware)
	testenv.StartRouter(t, r)

	select {
	case <-time.After(faultWait):
		t.Fatalf("worker: no message processed within %s (handler calls: %d)", faultWait, calls.Load())
	case <-t.Context().Done():
	}
}

func TestCrashAfterCommitBeforeAck(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			ctx := faultCtx(t)
			tables := testenv.Schema(t)
			faultCreateEffects(t, d.DB, tables)
			in := testenv.Queue(t, "crash_in_")
			out := testenv.Queue(t, "crash_out_")
			conn := testenv.AMQPConn(t)
			pub := testenv.AMQPPublisher(t)

			msgUUID := watermill.NewUUID()
			require.NoError(t, pub.Publish(in, message.NewMessage(msgUUID, []byte(`{"order":42}`))))

			code, output := faultRunWorker(t, "TestCrashWorkerProcess", map[string]string{
				crashEnvDriver: d.Name, crashEnvSchema: tables.Schema, crashEnvIn: in, crashEnvOut: out,
			})
			require.Equal(t, crashExitCode, code, "the worker must die right after its commit; output:\n%s", output)

			// The dead worker's commit holds: one business row naming its
			// two outputs, both outputs in the outbox, the key recorded.
			require.Equal(t, int64(1), faultEffects(t, d.DB, tables))
			var note string
			require.NoError(t, seam.QueryRow(ctx, d.DB, "SELECT note FROM "+faultTable(tables, "effects")+" WHERE id = $1",
				[]any{msgUUID}, &note))
			recorded := strings.Split(note, ",")
			require.Len(t, recorded, 2)
			require.Equal(t, int64(2), faultPending(t, d.DB, tables))
			store, err := inbox.NewStore(inbox.Config{Tables: tables})
			require.NoError(t, err)
			rec, err := store.Lookup(ctx, d.DB, crashConsumer, msgUUID)
			require.NoError(t, err)
			require.Equal(t, inbox.StatusDone, rec.Status)

			// Restart: same consumer name, same middleware.
			var ev faultEvents
			var calls atomic.Int64
			eo, err := middleware.New(middleware.Config{DB: d.DB, Tables: tables, OnEvent: ev.Observe})
			require.NoError(t, err)
			var redeliveredMu sync.Mutex
			var redelivered []bool
			r := faultNewRouter(t)
			r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					redeliveredMu.Lock()
					redelivered = append(redelivered, wamqp.IsMessageRedelivered(msg))
					redeliveredMu.Unlock()
					return h(msg)
				}
			}, eo.Middleware)
			r.AddHandler(crashConsumer, in, testenv.AMQPSubscriber(t, 1), out, pub, crashHandler(tables, &calls))
			testenv.StartRouter(t, r)

			testenv.Eventually(t, faultWait, func() bool { return ev.Duplicates.Load() == 1 },
				"the requeued delivery was not recognised as a duplicate (events: processed %d, failed %d)",
				ev.Processed.Load(), ev.Failed.Load())
			require.NoError(t, r.Close())
			faultRequireQueueSettled(t, conn, in, 0)

			require.Equal(t, int64(0), calls.Load(), "the handler must not run again")
			require.Equal(t, int64(1), faultEffects(t, d.DB, tables), "no second effect")
			require.Equal(t, int64(0), ev.Processed.Load())
			require.Equal(t, int64(0), ev.Failed.Load())
			require.Equal(t, int64(0), ev.DBUnavailable.Load())
			redeliveredMu.Lock()
			require.Equal(t, []bool{true}, redelivered, "exactly one delivery, RabbitMQ's redelivery of the unacked one")
			redeliveredMu.Unlock()
			dup := ev.Of(middleware.EventDuplicate)
			require.Len(t, dup, 1)
			require.Equal(t, msgUUID, dup[0].Key)
			require.Equal(t, rec.FirstSeenAt.UnixMicro(), dup[0].FirstSeenAt.UnixMicro())
			require.Equal(t, int64(2), faultPending(t, d.DB, tables), "the duplicate wrote no output")

			// Relay the outbox: exactly the dead worker's two outputs arrive.
			// (A fresh publisher: closing the router closed its handler's.)
			relay, err := outbox.NewRelay(outbox.RelayConfig{DB: d.DB, Publisher: testenv.AMQPPublisher(t), Tables: tables})
			require.NoError(t, err)
			require.Equal(t, 2, faultRelayAll(t, relay, d.DB, tables))
			got := faultDrain(t, conn, out)
			var gotUUIDs []string
			for _, m := range got {
				gotUUIDs = append(gotUUIDs, faultUUIDOf(m))
			}
			require.ElementsMatch(t, recorded, gotUUIDs, "the relayed messages are the ones the handler recorded")
		})
	}
}
