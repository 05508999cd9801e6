package tests

import (
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
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
func crashHandler(effects effectsTable, calls *atomic.Int64) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		outs := []*message.Message{
			message.NewMessage(watermill.NewUUID(), []byte(`{"event":"order-accepted"}`)),
			message.NewMessage(watermill.NewUUID(), []byte(`{"event":"sms-requested"}`)),
		}
		if err := effects.InsertNote(msg.Context(), msg.UUID, 1, outs[0].UUID+","+outs[1].UUID); err != nil {
			return nil, err
		}
		return outs, nil
	}
}

// TestCrashWorkerProcess is the worker of TestCrashAfterCommitBeforeAck,
// run in a subprocess. It does nothing in a normal test run.
func TestCrashWorkerProcess(t *testing.T) {
	if !isWorker(t.Name()) {
		return
	}
	d := testenv.DriverNamed(t, workerEnv(t, crashEnvDriver))
	db := sqlschema.DB{Conn: d.DB, Schema: workerEnv(t, crashEnvSchema)}
	in, out := workerEnv(t, crashEnvIn), workerEnv(t, crashEnvOut)

	eo := newMiddleware(t, exactlyonce.Config{
		DB: db,
		OnEvent: func(ev exactlyonce.Event) {
			if ev.Outcome == exactlyonce.Processed {
				// Committed; the router has not acked yet. Die now.
				os.Exit(crashExitCode)
			}
		},
	})
	var calls atomic.Int64
	r := newRouter(t)
	h := r.AddHandler(crashConsumer, in, testenv.AMQPSubscriber(t, 1), out, outboxOnly(t), crashHandler(effectsOf(db), &calls))
	h.AddMiddleware(eo.Middleware)
	testenv.StartRouter(t, r)

	select {
	case <-time.After(waitTimeout):
		t.Fatalf("worker: no message processed within %s (handler calls: %d)", waitTimeout, calls.Load())
	case <-t.Context().Done():
	}
}

func TestCrashAfterCommitBeforeAck(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		msgUUID := watermill.NewUUID()
		require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(msgUUID, []byte(`{"order":42}`))))

		code, output := runWorker(t, "TestCrashWorkerProcess", map[string]string{
			crashEnvDriver: e.Driver.Name, crashEnvSchema: e.DB.Schema, crashEnvIn: e.In, crashEnvOut: e.Out,
		})
		require.Equal(t, crashExitCode, code, "the worker must die right after its commit; output:\n%s", output)

		// The dead worker's commit holds: one business row naming its
		// two outputs, both outputs in the outbox, the key recorded.
		require.Equal(t, int64(1), e.Effects.Count(t, ""))
		notes := e.Effects.Notes(t, msgUUID)
		require.Len(t, notes, 1)
		recorded := strings.Split(notes[0], ",")
		require.Len(t, recorded, 2)
		require.Equal(t, int64(2), outboxPending(t, e.DB))
		rec := inboxRecord(t, e.DB, crashConsumer, msgUUID)
		require.Equal(t, inboxdb.StatusDone, rec.Status)

		// Restart: same consumer name, same middleware.
		var calls atomic.Int64
		var deliveries deliveryLog
		eo := e.Middleware(t, exactlyonce.Config{})
		r := newRouter(t)
		r.AddMiddleware(deliveries.Middleware, eo.Middleware)
		r.AddHandler(crashConsumer, e.In, testenv.AMQPSubscriber(t, 1), e.Out, outboxOnly(t), crashHandler(e.Effects, &calls))
		testenv.StartRouter(t, r)

		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Duplicates.Load() == 1 },
			"the requeued delivery was not recognised as a duplicate (events: processed %d, failed %d)",
			e.Log.Processed.Load(), e.Log.Failed.Load())
		closeRouter(t, r)
		requireQueueSettled(t, e.Conn, e.In, 0)

		require.Equal(t, int64(0), calls.Load(), "the handler must not run again")
		require.Equal(t, int64(1), e.Effects.Count(t, ""), "no second effect")
		require.Equal(t, int64(0), e.Log.Processed.Load())
		require.Equal(t, int64(0), e.Log.Failed.Load())
		require.Equal(t, int64(0), e.Log.ClaimFailed.Load())
		require.Equal(t, int64(0), e.Log.DBUnavailable.Load())
		require.Equal(t, []bool{true}, deliveries.Redelivered(), "exactly one delivery, RabbitMQ's redelivery of the unacked one")
		dup := e.Log.Of(exactlyonce.Duplicate, nil)
		require.Len(t, dup, 1)
		require.Equal(t, msgUUID, dup[0].Key)
		require.Equal(t, rec.FirstSeenAt.UnixMicro(), dup[0].FirstSeenAt.UnixMicro())
		require.Equal(t, int64(2), outboxPending(t, e.DB), "the duplicate wrote no output")

		// Relay the outbox: exactly the dead worker's two outputs arrive.
		require.Equal(t, 2, relayOutbox(t, e.DB))
		var gotUUIDs []string
		for _, m := range drainQueue(t, e.Conn, e.Out) {
			gotUUIDs = append(gotUUIDs, uuidOf(m))
		}
		require.ElementsMatch(t, recorded, gotUUIDs, "the relayed messages are the ones the handler recorded")
	})
}
