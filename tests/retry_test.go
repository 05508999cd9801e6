package tests

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// retryFailures is the number of handler runs that fail (after writing
// their effect and returning an output) before one succeeds.
const retryFailures = 2

// retryHandler writes an effect row tagged with the run number and returns
// an output message tagged likewise on every run, then fails runs 1 and 2
// of each key; run 3 succeeds.
func retryHandler(e *e2e, runs *runCounter) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		attempt := runs.Next(msg.UUID)
		if err := e.Effects.Insert(msg.Context(), msg.UUID, attempt); err != nil {
			return nil, err
		}
		out := []*message.Message{message.NewMessage(outputUUID(msg.UUID, attempt), []byte(fmt.Sprintf(`{"attempt":%d}`, attempt)))}
		if attempt <= retryFailures {
			return out, fmt.Errorf("attempt %d fails after writing its effect and output", attempt)
		}
		return out, nil
	}
}

// runRetryTest publishes one message to a router whose middlewares are
// outer..., then the exactly-once middleware, and checks that only the
// successful run's effect and output survive. wantDeliveries is the number
// of deliveries RabbitMQ makes.
func runRetryTest(t *testing.T, e *e2e, wantDeliveries int64, outer ...message.HandlerMiddleware) {
	eo := e.Middleware(t, exactlyonce.Config{})

	var runs runCounter
	var deliveries deliveryLog
	r := newRouter(t)
	r.AddMiddleware(deliveries.Middleware)
	r.AddMiddleware(outer...)
	r.AddMiddleware(eo.Middleware)
	addHandler(t, r, "retry-handler", e.In, e.Out, retryHandler(e, &runs))

	key := watermill.NewUUID()
	publishCopies(t, e.Pub, e.In, key, []byte(`{"n":1}`), 1)
	testenv.StartRouter(t, r)

	waitSettled(t, e.Log, 1)
	closeRouter(t, r)
	requireQueueDrained(t, e.In)

	require.Equal(t, wantDeliveries, deliveries.Total(), "deliveries by RabbitMQ")
	require.Equal(t, retryFailures+1, runs.Get(key), "handler runs")
	require.Equal(t, int64(retryFailures), e.Log.Failed.Load(), "failed runs reported")
	require.Equal(t, int64(1), e.Log.Processed.Load(), "processed")
	require.Zero(t, e.Log.Duplicates.Load(), "duplicates")

	require.Equal(t, []int{retryFailures + 1}, e.Effects.Attempts(t, key),
		"only the effect of the successful run may survive")
	require.Equal(t, int64(1), e.Effects.Count(t, ""), "effect rows")
	require.Equal(t, []outboxRow{{Topic: e.Out, UUID: outputUUID(key, retryFailures+1)}}, outboxRows(t, e.DB),
		"only the output of the successful run may be in the outbox")
	requireExactlyOneOutput(t, e.DB, e.Out, outputUUID(key, retryFailures+1))
}

// TestRetryMiddleware: Watermill's Retry middleware, placed outside the
// exactly-once middleware, retries in-process; each attempt gets a fresh
// transaction, so the failed attempts leave no effect and no output.
func TestRetryMiddleware(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		retry := wmiddleware.Retry{
			MaxRetries:      3,
			InitialInterval: time.Millisecond,
			MaxInterval:     10 * time.Millisecond,
			Multiplier:      2,
		}
		runRetryTest(t, e, 1, retry.Middleware)
	})
}

// TestRetryRedelivery: without a Retry middleware the router nacks the
// failed runs and RabbitMQ redelivers; the failed runs leave no effect and
// no output.
func TestRetryRedelivery(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		runRetryTest(t, e, retryFailures+1)
	})
}
