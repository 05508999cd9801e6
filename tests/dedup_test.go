package tests

import (
	"errors"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// dedupCopies is the number of deliveries of the same message.
const dedupCopies = 5

// dedupHandlerName is the router handler name, and so the inbox consumer
// (the middleware's default).
const dedupHandlerName = "dedup-handler"

// dedupHandler writes one effect row in the middleware's transaction and
// returns one output message, for every run.
func dedupHandler(e *e2e, runs *runCounter) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		attempt := runs.Next(msg.UUID)
		if err := e.Effects.Insert(msg.Context(), msg.UUID, attempt); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(outputUUID(msg.UUID, attempt), []byte(`{"done":true}`))}, nil
	}
}

// requireDedupOutcome checks the state after dedupCopies deliveries of the
// message uuid were acked: one handler run, one effect, the duplicates
// counted by the middleware and in the inbox, every delivery acked, one
// output in the outbox, and exactly one message downstream after the relay.
func requireDedupOutcome(t *testing.T, e *e2e, r *message.Router, runs *runCounter, deliveries *deliveryLog, uuid string) {
	t.Helper()
	waitSettled(t, e.Log, dedupCopies)
	closeRouter(t, r)
	requireQueueDrained(t, e.In)

	require.Equal(t, int64(dedupCopies), deliveries.Total(), "deliveries that reached the router")
	require.Equal(t, 1, runs.Total(), "handler runs")
	require.Equal(t, int64(1), e.Effects.Count(t, ""), "effect rows")
	require.Equal(t, int64(1), e.Log.Processed.Load(), "processed")
	require.Equal(t, int64(dedupCopies-1), e.Log.Duplicates.Load(), "duplicates")
	require.Zero(t, e.Log.Failed.Load()+e.Log.ClaimFailed.Load()+e.Log.Rejected.Load()+e.Log.DBUnavailable.Load()+e.Log.FailOpen.Load(),
		"no delivery may fail")

	rec := inboxRecord(t, e.DB, dedupHandlerName, uuid)
	require.Equal(t, inboxdb.StatusDone, rec.Status)
	require.Equal(t, int64(dedupCopies-1), rec.Duplicates, "inbox duplicate counter")

	require.Equal(t, int64(1), outboxPending(t, e.DB), "outbox rows")
	require.Equal(t, []outboxRow{{Topic: e.Out, UUID: outputUUID(uuid, 1)}}, outboxRows(t, e.DB))
	requireExactlyOneOutput(t, e.DB, e.Out, outputUUID(uuid, 1))
}

// errLostAck simulates an ack that never reached the broker.
var errLostAck = errors.New("simulated lost ack")

// loseAcks returns a router middleware, to be added outside the exactly-once
// middleware, that turns the first n successful deliveries into errors after
// the inner handler (and so the middleware's commit) succeeded: the router
// nacks them and RabbitMQ redelivers, as it would after a lost ack.
func loseAcks(n int64) message.HandlerMiddleware {
	var lost atomic.Int64
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && lost.Add(1) <= n {
				return nil, errLostAck
			}
			return out, err
		}
	}
}

// TestDedup: dedupCopies deliveries of one message reach the router; the
// handler's effect and output happen once, and every copy is acked.
// Republished: a producer publishes the same message (same UUID) five
// times. Redelivered: one published message is redelivered by RabbitMQ
// four times, because the first four acks are "lost" after the middleware
// committed.
func TestDedup(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		published int   // copies the producer publishes
		lostAcks  int64 // acks lost after the middleware committed (loseAcks)
	}{
		{"republished", dedupCopies, 0},
		{"redelivered", 1, dedupCopies - 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			eachDriver(t, func(t *testing.T, e *e2e) {
				eo := e.Middleware(t, exactlyonce.Config{})

				var runs runCounter
				var deliveries deliveryLog
				r := newRouter(t)
				r.AddMiddleware(deliveries.Middleware, loseAcks(c.lostAcks), eo.Middleware)
				addHandler(t, r, dedupHandlerName, e.In, e.Out, dedupHandler(e, &runs))

				uuid := watermill.NewUUID()
				publishCopies(t, e.Pub, e.In, uuid, []byte(`{"n":1}`), c.published)
				testenv.StartRouter(t, r)

				requireDedupOutcome(t, e, r, &runs, &deliveries, uuid)
			})
		})
	}
}
