package exactlyonce_test

// Regression tests for the second "first hours" report: a forgotten
// middleware, a store-only lease handler that returns messages, log noise
// during an outage and under lease contention, and the start-up checks.
// Each goes through a Watermill router on a real RabbitMQ queue and real
// PostgreSQL (and Redis for the Redis store).

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	exactlyonce "github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// fh2Errors records the first errors a handler got from the context helpers.
type fh2Errors struct {
	mu   sync.Mutex
	errs []error
}

func (e *fh2Errors) add(err error) {
	e.mu.Lock()
	e.errs = append(e.errs, err)
	e.mu.Unlock()
}

func (e *fh2Errors) first(t *testing.T) error {
	t.Helper()
	var err error
	testenv.Eventually(t, fhWait, func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		if len(e.errs) == 0 {
			return false
		}
		err = e.errs[0]
		return true
	}, "the handler never ran")
	return err
}

// A handler that calls PgxTxFromContext(msg.Context()) on a router without
// the exactly-once middleware: the error names the missing middleware and
// the handler (not the context), it is permanent, and the redelivery loop
// is bounded without a poison queue. With the recommended poison queue
// (PoisonQueueWithFilter(IsPermanent)) the message leaves the loop after
// one delivery, kept in the poison queue.
// Before: "the context is not a handler's ... (use msg.Context() inside
// the handler)", not permanent, thousands of redeliveries per second.
func TestFirstHoursForgottenMiddleware(t *testing.T) {
	t.Parallel()
	handler := func(run *fhRun, seen *fh2Errors) message.NoPublishHandlerFunc {
		return func(msg *message.Message) error {
			run.runs.Add(1)
			_, err := exactlyonce.PgxTxFromContext(msg.Context())
			seen.add(err)
			return err
		}
	}

	t.Run("without a poison queue", func(t *testing.T) {
		t.Parallel()
		q := testenv.Queue(t, "fh2_nomw_")
		var run fhRun
		var seen fh2Errors
		r := fhRouter(t)
		r.AddMiddleware(run.Outer) // no exactly-once middleware: the mistake
		r.AddConsumerHandler("forgot-middleware", q, testenv.AMQPSubscriber(t, 1), handler(&run, &seen))
		testenv.StartRouter(t, r)
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), []byte("{}")))

		err := seen.first(t)
		require.Error(t, err)
		require.True(t, exactlyonce.IsPermanent(err), "no redelivery can fix a missing middleware: %v", err)
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		require.Contains(t, err.Error(), `"forgot-middleware"`, "it names the handler")
		require.Contains(t, err.Error(), "AddMiddleware", "it says how to add the middleware")
		require.NotContains(t, err.Error(), "use msg.Context()", "the handler did use msg.Context()")
		n := run.window(t, "a forgotten middleware")
		require.LessOrEqual(t, n, int64(fhWindow/time.Second)+2, "the redelivery loop is bounded (one delivery a second)")
		fhStop(t, r)
		fhQueueDepth(t, q, 1) // kept
	})

	t.Run("with the recommended poison queue", func(t *testing.T) {
		t.Parallel()
		q := testenv.Queue(t, "fh2_nomw_pq_")
		poison := q + "_poison" // testenv.Queue deletes it too
		require.NoError(t, rabbitmq.DeclareQueues(context.Background(), testenv.AMQPURL(), poison))
		pq, err := middleware.PoisonQueueWithFilter(testenv.AMQPPublisher(t), poison, exactlyonce.IsPermanent)
		require.NoError(t, err)
		var run fhRun
		var seen fh2Errors
		r := fhRouter(t)
		r.AddMiddleware(run.Outer, pq) // the poison queue, and no exactly-once middleware
		r.AddConsumerHandler("forgot-middleware-pq", q, testenv.AMQPSubscriber(t, 1), handler(&run, &seen))
		testenv.StartRouter(t, r)
		fhPublish(t, q, message.NewMessage(watermill.NewUUID(), []byte("{}")))

		fhQueueDepth(t, poison, 1)
		fhStop(t, r)
		require.Equal(t, int64(1), run.runs.Load(), "one delivery, then the poison queue took it")
		fhQueueDepth(t, q, 0)
	})

	t.Run("a context that is not the message's, under the middleware", func(t *testing.T) {
		t.Parallel()
		_, err := exactlyonce.PgxTxFromContext(context.Background())
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		require.True(t, exactlyonce.IsPermanent(err))
		require.Contains(t, err.Error(), "msg.Context()", "it says which context to pass")
		_, err = exactlyonce.OutboxFromContext(context.Background())
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		require.ErrorIs(t, exactlyonce.Queue(context.Background(), "SELECT 1"), exactlyonce.ErrNoMiddleware)
		_, err = exactlyonce.InfoFromContext(context.Background())
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
	})

	t.Run("OutboxOnly without the middleware", func(t *testing.T) {
		t.Parallel()
		in := testenv.Queue(t, "fh2_oo_in_")
		out := testenv.Queue(t, "fh2_oo_out_")
		pub := &fhRecordingPublisher{Publisher: exactlyonce.OutboxOnly()}
		var run fhRun
		r := fhRouter(t)
		r.AddMiddleware(run.Outer)
		r.AddHandler("forgot-middleware-oo", in, testenv.AMQPSubscriber(t, 1), out, pub, func(msg *message.Message) ([]*message.Message, error) {
			run.runs.Add(1)
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("out"))}, nil
		})
		testenv.StartRouter(t, r)
		fhPublish(t, in, message.NewMessage(watermill.NewUUID(), []byte("{}")))
		var err error
		testenv.Eventually(t, fhWait, func() bool {
			var ok bool
			err, ok = pub.first()
			return ok
		}, "the router never published")
		require.ErrorIs(t, err, exactlyonce.ErrNoMiddleware)
		require.Contains(t, err.Error(), `"forgot-middleware-oo"`, "it names the handler")
		n := run.window(t, "OutboxOnly without the middleware")
		require.LessOrEqual(t, n, int64(fhWindow/time.Second)+2, "the redelivery loop is bounded (one delivery a second)")
		fhStop(t, r)
		fhQueueDepth(t, out, 0)
		fhQueueDepth(t, in, 1)
	})
}

var _ = errors.New
var _ = strings.Contains
