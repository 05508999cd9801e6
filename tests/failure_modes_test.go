package tests

import (
	"context"
	stdsql "database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// What the middleware does when things go wrong around it: a message it
// cannot key, a database that is down, a handler that panics, and the
// explicit fail-open choice. In every case nothing is lost and nothing is
// applied twice, or (fail-open) the trade is visible in the counters.

// publishKeyless publishes body to queue with amqp091 directly, like a
// producer that is not Watermill: no UUID header, so the Watermill
// subscriber sees an empty UUID.
func publishKeyless(t testing.TB, conn *amqp.Connection, queue string, body []byte) {
	t.Helper()
	publishRaw(t, conn, queue, amqp.Publishing{
		Headers: amqp.Table{"producer": "legacy-php"}, ContentType: "application/json", Body: body,
	})
}

// (a) A message without a key goes to the poison queue, with the reason;
// the handler never runs, and the messages behind it are not blocked.
func TestFailureEmptyKeyPoisonQueue(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		poison := e.In + "_poison"
		declareQueue(t, e.Conn, poison)

		var handled sync.Map
		eo := e.Middleware(t, exactlyonce.Config{})
		pq, err := wmiddleware.PoisonQueueWithFilter(e.Pub, poison, func(err error) bool {
			return errors.Is(err, inboxdb.ErrEmptyKey)
		})
		require.NoError(t, err)
		r := newRouter(t)
		r.AddMiddleware(pq, eo.Middleware) // poison queue outside
		r.AddConsumerHandler("empty-key", e.In, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
			handled.Store(msg.UUID, string(msg.Payload))
			return e.Effects.Insert(msg.Context(), msg.UUID, 1)
		})
		testenv.StartRouter(t, r)

		badBody := []byte(`{"sms":"your code is 1234"}`)
		publishKeyless(t, e.Conn, e.In, badBody)
		good := watermill.NewUUID()
		require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(good, []byte(`{"sms":"hello"}`))))

		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Processed.Load() == 1 },
			"the good message behind the keyless one was not processed")
		var poisoned []amqp.Delivery
		testenv.Eventually(t, waitTimeout, func() bool {
			poisoned = append(poisoned, drainQueue(t, e.Conn, poison)...)
			return len(poisoned) > 0
		}, "nothing arrived in the poison queue")
		closeRouter(t, r)
		requireQueueSettled(t, e.Conn, e.In, 0)
		require.Empty(t, drainQueue(t, e.Conn, poison), "exactly one poisoned message")

		require.Len(t, poisoned, 1)
		p := poisoned[0]
		require.Equal(t, badBody, p.Body, "the poisoned message is the keyless one")
		reason, _ := p.Headers[wmiddleware.ReasonForPoisonedKey].(string)
		require.Contains(t, reason, inboxdb.ErrEmptyKey.Error())
		require.Contains(t, reason, "set a UUID on the message")
		require.Equal(t, e.In, p.Headers[wmiddleware.PoisonedTopicKey])
		require.Equal(t, "empty-key", p.Headers[wmiddleware.PoisonedHandlerKey])
		require.Equal(t, "legacy-php", p.Headers["producer"], "the original metadata is kept")

		n := 0
		handled.Range(func(k, _ any) bool {
			n++
			require.Equal(t, good, k, "the handler must only see the good message")
			return true
		})
		require.Equal(t, 1, n)
		require.Equal(t, int64(1), e.Effects.Count(t, ""))
		require.Equal(t, int64(1), e.Log.Rejected.Load())
		require.Equal(t, int64(0), e.Log.Failed.Load())
		require.Equal(t, int64(0), e.Log.ClaimFailed.Load())
		rej := e.Log.Of(exactlyonce.Nacked, exactlyonce.ErrInvalidKey)
		require.Len(t, rej, 1)
		require.ErrorIs(t, rej[0].Err, inboxdb.ErrEmptyKey)
	})
}

// (a') Without a poison queue the keyless message is nacked, not dropped,
// with an error that says what to do.
func TestFailureEmptyKeyWithoutPoisonQueue(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		var calls atomic.Int64
		eo := e.Middleware(t, exactlyonce.Config{})
		r := newRouter(t)
		r.AddMiddleware(eo.Middleware)
		r.AddConsumerHandler("empty-key-plain", e.In, testenv.AMQPSubscriber(t, 1), func(*message.Message) error {
			calls.Add(1)
			return nil
		})
		testenv.StartRouter(t, r)

		publishKeyless(t, e.Conn, e.In, []byte(`{"sms":"no key"}`))
		// Rejected at least twice: it was nacked and came back.
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Rejected.Load() >= 2 },
			"the keyless message was not rejected and redelivered")
		closeRouter(t, r)
		requireQueueSettled(t, e.Conn, e.In, 1)

		require.Equal(t, int64(0), calls.Load(), "the handler must not run without a key")
		require.Equal(t, int64(0), e.Log.Processed.Load())
		err := e.Log.Of(exactlyonce.Nacked, exactlyonce.ErrInvalidKey)[0].Err
		require.ErrorIs(t, err, inboxdb.ErrEmptyKey)
		require.Contains(t, err.Error(), `handler "empty-key-plain"`)
		require.Contains(t, err.Error(), "set a UUID on the message")
		require.Contains(t, err.Error(), "message_id")
		require.Contains(t, err.Error(), "Config.Key")
	})
}

// refuseAfterBegin is a DB whose next BeginTx, once armed, makes the proxy
// refuse right after the transaction began: the database goes away between
// BEGIN and the inbox claim.
type refuseAfterBegin struct {
	wsql.Beginner
	proxy *testenv.Proxy
	armed atomic.Bool
}

func (b *refuseAfterBegin) BeginTx(ctx context.Context, opts *stdsql.TxOptions) (wsql.Tx, error) {
	tx, err := b.Beginner.BeginTx(ctx, opts)
	if err == nil && b.armed.CompareAndSwap(true, false) {
		b.proxy.Refuse()
	}
	return tx, err
}

// (b) The database goes down at claim time: the message is nacked and kept,
// the handler does not run; once the database is back it is processed
// exactly once.
func TestFailureDBDownAtClaim(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		proxy := testenv.NewProxy(t, dbAddr(t))
		via := driverVia(t, e.Driver, proxy.RewriteURL(testenv.DatabaseURL()))
		db := &refuseAfterBegin{Beginner: via.DB, proxy: proxy}

		var calls atomic.Int64
		eo := newMiddleware(t, exactlyonce.Config{DB: testenv.WithConn(e.DB, db), OnEvent: e.Log.Observe})
		handler := func(msg *message.Message) error {
			calls.Add(1)
			return e.Effects.Insert(msg.Context(), msg.UUID, 1)
		}
		startRouter := func() *message.Router {
			r := newRouter(t)
			r.AddMiddleware(eo.Middleware)
			r.AddConsumerHandler("db-down", e.In, testenv.AMQPSubscriber(t, 1), handler)
			testenv.StartRouter(t, r)
			return r
		}

		db.armed.Store(true)
		r := startRouter()
		msgUUID := watermill.NewUUID()
		require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(msgUUID, []byte(`{}`))))

		// Fails at the claim, then (proxy refusing) at BEGIN on each
		// redelivery: never acked.
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.DBUnavailable.Load() >= 3 },
			"the middleware did not report the database as unavailable on redeliveries")
		require.True(t, proxy.Refusing())
		closeRouter(t, r)
		requireQueueSettled(t, e.Conn, e.In, 1)
		require.Equal(t, int64(0), calls.Load(), "the handler must not run without its transaction")
		require.Equal(t, int64(0), e.Log.Processed.Load())
		down := e.Log.Of(exactlyonce.Nacked, exactlyonce.ErrDBUnavailable)
		for _, ev := range down {
			require.ErrorIs(t, ev.Err, exactlyonce.ErrDBUnavailable)
			require.Equal(t, msgUUID, ev.Key)
		}
		require.Contains(t, down[0].Err.Error(), "claiming", "the first delivery failed at the claim")
		require.Contains(t, down[len(down)-1].Err.Error(), "begin", "later deliveries failed at BEGIN")

		// The database is back: processed exactly once.
		proxy.Allow()
		r = startRouter()
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Processed.Load() == 1 },
			"the message was not processed once the database was back")
		closeRouter(t, r)
		requireQueueSettled(t, e.Conn, e.In, 0)
		require.Equal(t, int64(1), calls.Load())
		require.Equal(t, int64(1), e.Effects.Count(t, ""))
		require.Equal(t, int64(0), e.Log.Duplicates.Load())
		require.Equal(t, int64(0), e.Log.FailOpen.Load())
	})
}

// (c) A handler that panics: its writes are rolled back, the message is
// redelivered and processed once the panic stops.
func TestFailureHandlerPanic(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		var attempts atomic.Int64
		var redelivered atomic.Bool
		eo := e.Middleware(t, exactlyonce.Config{})
		r := newRouter(t)
		r.AddMiddleware(eo.Middleware)
		r.AddConsumerHandler("panicky", e.In, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
			n := attempts.Add(1)
			if err := e.Effects.Insert(msg.Context(), msg.UUID, int(n)); err != nil {
				return err
			}
			if n == 1 {
				panic("boom: first delivery")
			}
			redelivered.Store(wamqp.IsMessageRedelivered(msg))
			return nil
		})
		testenv.StartRouter(t, r)

		msgUUID := watermill.NewUUID()
		require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(msgUUID, []byte(`{}`))))
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Processed.Load() == 1 },
			"the message was not processed after the panic")
		closeRouter(t, r)
		requireQueueSettled(t, e.Conn, e.In, 0)

		require.Equal(t, int64(2), attempts.Load())
		require.True(t, redelivered.Load(), "the second attempt is RabbitMQ's redelivery")
		failed := e.Log.Of(exactlyonce.Nacked, nil)
		require.Len(t, failed, 1)
		require.Equal(t, int64(1), e.Log.Failed.Load(), "the panic is a handler failure, not a database or key problem")
		var pe wmiddleware.RecoveredPanicError
		require.ErrorAs(t, failed[0].Err, &pe)
		require.Equal(t, "boom: first delivery", pe.V)
		require.Contains(t, failed[0].Err.Error(), "boom: first delivery")
		// Only the second attempt's write exists: the panic rolled back the first.
		require.Equal(t, int64(1), e.Effects.Count(t, ""))
		require.Equal(t, []int{2}, e.Effects.Attempts(t, msgUUID))
		require.Equal(t, int64(0), e.Log.Duplicates.Load())
	})
}

// (d) Fail-open: with the database down, the handler runs without a
// transaction, the message is acked, and the handler's output goes to the
// router's publisher (there is no outbox to write it to).
func TestFailureFailOpen(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		proxy := testenv.NewProxy(t, dbAddr(t))
		proxy.Refuse()
		via := driverVia(t, e.Driver, proxy.RewriteURL(testenv.DatabaseURL()))

		var calls atomic.Int64
		var sawTx atomic.Bool
		eo := newMiddleware(t, exactlyonce.Config{DB: testenv.WithConn(e.DB, via.DB), FailOpen: true, OnEvent: e.Log.Observe})
		outUUID := watermill.NewUUID()
		routedUUID := watermill.NewUUID()
		r := newRouter(t)
		r.AddMiddleware(eo.Middleware)
		// A real publisher: a fail-open run hands its messages to the router.
		r.AddHandler("fail-open", e.In, testenv.AMQPSubscriber(t, 1), e.Out, e.Pub, func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			_, pgxErr := exactlyonce.PgxTxFromContext(msg.Context())
			_, stdErr := exactlyonce.StdTxFromContext(msg.Context())
			_, obErr := exactlyonce.OutboxFromContext(msg.Context())
			info, infoErr := exactlyonce.InfoFromContext(msg.Context())
			sawTx.Store(pgxErr == nil || stdErr == nil || obErr == nil || infoErr != nil || !info.FailOpen)
			// SetDestination to the handler's own publish topic is
			// honoured; the internal destination key is not published.
			routed := message.NewMessage(routedUUID, []byte(`{}`))
			exactlyonce.SetDestination(routed, e.Out)
			return []*message.Message{message.NewMessage(outUUID, []byte(`{"sms":"sent without dedup"}`)), routed}, nil
		})
		testenv.StartRouter(t, r)

		require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(watermill.NewUUID(), []byte(`{}`))))
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.FailOpen.Load() == 1 },
			"the handler did not run fail-open")
		var got []amqp.Delivery
		testenv.Eventually(t, waitTimeout, func() bool {
			got = append(got, drainQueue(t, e.Conn, e.Out)...)
			return len(got) >= 2
		}, "the router did not publish the fail-open handler's output")
		closeRouter(t, r)
		requireQueueSettled(t, e.Conn, e.In, 0) // acked
		require.Empty(t, drainQueue(t, e.Conn, e.Out))

		require.Len(t, got, 2)
		require.Equal(t, outUUID, uuidOf(got[0]))
		require.Equal(t, routedUUID, uuidOf(got[1]))
		for _, g := range got {
			require.NotContains(t, g.Headers, topicMetadataKey, "the internal destination key leaked")
		}
		require.Equal(t, int64(1), calls.Load())
		require.False(t, sawTx.Load(), "fail-open runs the handler without a transaction or outbox, and says so in its Info")
		require.Equal(t, int64(1), e.Log.FailOpen.Load())
		require.Equal(t, int64(0), e.Log.DBUnavailable.Load())
		require.Equal(t, int64(0), e.Log.Processed.Load())
		require.Greater(t, proxy.Stats().Refused, int64(0), "the database really was unreachable")

		// Nothing was written behind the outage: no inbox row, no outbox row.
		require.Equal(t, int64(0), outboxPending(t, e.DB))
		require.Equal(t, int64(0), e.Count(t, "SELECT count(*) FROM "+e.DB.Inbox()))
	})
}

// (e) Fail-open with an output for another topic: without the outbox only
// the router can publish, and it publishes to the handler's publish topic.
// The delivery is nacked with ErrNoDestination rather than published to the
// wrong topic or dropped.
func TestFailureFailOpenOtherDestination(t *testing.T) {
	t.Parallel()
	e := setupE2E(t, testenv.DriverNamed(t, "pgxpool"))
	elsewhere := testenv.Queue(t, "else_")
	proxy := testenv.NewProxy(t, dbAddr(t))
	proxy.Refuse()
	via := driverVia(t, e.Driver, proxy.RewriteURL(testenv.DatabaseURL()))

	eo := newMiddleware(t, exactlyonce.Config{DB: testenv.WithConn(e.DB, via.DB), FailOpen: true, OnEvent: e.Log.Observe, NackDelay: 50 * time.Millisecond})
	r := newRouter(t)
	r.AddMiddleware(eo.Middleware)
	r.AddHandler("fail-open-else", e.In, testenv.AMQPSubscriber(t, 1), e.Out, e.Pub, func(msg *message.Message) ([]*message.Message, error) {
		m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		exactlyonce.SetDestination(m, elsewhere)
		return []*message.Message{m}, nil
	})
	testenv.StartRouter(t, r)
	require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(watermill.NewUUID(), []byte(`{}`))))
	testenv.Eventually(t, waitTimeout, func() bool { return len(e.Log.Of(exactlyonce.FailOpen, nil)) >= 2 },
		"the fail-open run was not redelivered after its nack")
	closeRouter(t, r)
	for _, ev := range e.Log.Of(exactlyonce.FailOpen, nil) {
		require.ErrorIs(t, ev.Err, exactlyonce.ErrNoDestination)
		require.Contains(t, ev.Err.Error(), elsewhere)
	}
	requireQueueSettled(t, e.Conn, e.In, 1) // nacked, kept
	require.Empty(t, drainQueue(t, e.Conn, e.Out), "nothing published to the wrong topic")
	require.Empty(t, drainQueue(t, e.Conn, elsewhere))
}
