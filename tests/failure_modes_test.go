package tests

import (
	"context"
	stdsql "database/sql"
	"errors"
	"strconv"
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

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/middleware"
)

// What the middleware does when things go wrong around it: a message it
// cannot key, a database that is down, a handler that panics, and the
// explicit fail-open choice. In every case nothing is lost and nothing is
// applied twice, or (fail-open) the trade is visible in the counters.

// faultPublishRaw publishes body to queue with amqp091 directly, like a
// producer that is not Watermill: no UUID header, so the Watermill
// subscriber sees an empty UUID. It waits for the broker's confirm.
func faultPublishRaw(t testing.TB, conn *amqp.Connection, queue string, body []byte) {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	require.NoError(t, ch.Confirm(false))
	dc, err := ch.PublishWithDeferredConfirmWithContext(faultCtx(t), "", queue, true, false, amqp.Publishing{
		Headers:      amqp.Table{"producer": "legacy-php"},
		ContentType:  "application/json",
		DeliveryMode: amqp.Persistent,
		Body:         body,
	})
	require.NoError(t, err)
	ok, err := dc.WaitContext(faultCtx(t))
	require.NoError(t, err)
	require.True(t, ok, "broker nacked the publish")
}

// faultDeclare declares a durable queue (deleted by the test's
// testenv.Queue cleanup when named <queue>_poison).
func faultDeclare(t testing.TB, conn *amqp.Connection, queue string) {
	t.Helper()
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	_, err = ch.QueueDeclare(queue, true, false, false, false, nil)
	require.NoError(t, err)
}

// (a) A message without a key goes to the poison queue, with the reason;
// the handler never runs, and the messages behind it are not blocked.
func TestFailureEmptyKeyPoisonQueue(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			tables := testenv.Schema(t)
			faultCreateEffects(t, d.DB, tables)
			in := testenv.Queue(t, "empty_in_")
			poison := in + "_poison"
			conn := testenv.AMQPConn(t)
			faultDeclare(t, conn, poison)
			pub := testenv.AMQPPublisher(t)

			var ev faultEvents
			var handled sync.Map
			eo, err := middleware.New(middleware.Config{DB: d.DB, Tables: tables, OnEvent: ev.Observe})
			require.NoError(t, err)
			pq, err := wmiddleware.PoisonQueueWithFilter(pub, poison, func(err error) bool {
				return errors.Is(err, middleware.ErrEmptyKey)
			})
			require.NoError(t, err)
			r := faultNewRouter(t)
			r.AddMiddleware(pq, eo.Middleware) // poison queue outside
			r.AddConsumerHandler("empty-key", in, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
				handled.Store(msg.UUID, string(msg.Payload))
				return faultInsertEffect(msg.Context(), tables, msg.UUID, "")
			})
			testenv.StartRouter(t, r)

			badBody := []byte(`{"sms":"your code is 1234"}`)
			faultPublishRaw(t, conn, in, badBody)
			good := watermill.NewUUID()
			require.NoError(t, pub.Publish(in, message.NewMessage(good, []byte(`{"sms":"hello"}`))))

			testenv.Eventually(t, faultWait, func() bool { return ev.Processed.Load() == 1 },
				"the good message behind the keyless one was not processed")
			var poisoned []amqp.Delivery
			testenv.Eventually(t, faultWait, func() bool {
				poisoned = append(poisoned, faultDrain(t, conn, poison)...)
				return len(poisoned) > 0
			}, "nothing arrived in the poison queue")
			require.NoError(t, r.Close())
			faultRequireQueueSettled(t, conn, in, 0)
			require.Empty(t, faultDrain(t, conn, poison), "exactly one poisoned message")

			require.Len(t, poisoned, 1)
			p := poisoned[0]
			require.Equal(t, badBody, p.Body, "the poisoned message is the keyless one")
			reason, _ := p.Headers[wmiddleware.ReasonForPoisonedKey].(string)
			require.Contains(t, reason, middleware.ErrEmptyKey.Error())
			require.Contains(t, reason, "set a UUID on the message")
			require.Equal(t, in, p.Headers[wmiddleware.PoisonedTopicKey])
			require.Equal(t, "empty-key", p.Headers[wmiddleware.PoisonedHandlerKey])
			require.Equal(t, "legacy-php", p.Headers["producer"], "the original metadata is kept")

			n := 0
			handled.Range(func(k, _ any) bool {
				n++
				require.Equal(t, good, k, "the handler must only see the good message")
				return true
			})
			require.Equal(t, 1, n)
			require.Equal(t, int64(1), faultEffects(t, d.DB, tables))
			require.Equal(t, int64(1), ev.Rejected.Load())
			require.Equal(t, int64(0), ev.Failed.Load())
			rej := ev.Of(middleware.EventRejected)
			require.Len(t, rej, 1)
			require.ErrorIs(t, rej[0].Err, middleware.ErrEmptyKey)
		})
	}
}

// (a') Without a poison queue the keyless message is nacked, not dropped,
// with an error that says what to do.
func TestFailureEmptyKeyWithoutPoisonQueue(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			tables := testenv.Schema(t)
			in := testenv.Queue(t, "empty_np_in_")
			conn := testenv.AMQPConn(t)

			var ev faultEvents
			var calls atomic.Int64
			eo, err := middleware.New(middleware.Config{DB: d.DB, Tables: tables, OnEvent: ev.Observe})
			require.NoError(t, err)
			r := faultNewRouter(t)
			r.AddMiddleware(eo.Middleware)
			r.AddConsumerHandler("empty-key-plain", in, testenv.AMQPSubscriber(t, 1), func(*message.Message) error {
				calls.Add(1)
				return nil
			})
			testenv.StartRouter(t, r)

			faultPublishRaw(t, conn, in, []byte(`{"sms":"no key"}`))
			// Rejected at least twice: it was nacked and came back.
			testenv.Eventually(t, faultWait, func() bool { return ev.Rejected.Load() >= 2 },
				"the keyless message was not rejected and redelivered")
			require.NoError(t, r.Close())
			faultRequireQueueSettled(t, conn, in, 1)

			require.Equal(t, int64(0), calls.Load(), "the handler must not run without a key")
			require.Equal(t, int64(0), ev.Processed.Load())
			err = ev.Of(middleware.EventRejected)[0].Err
			require.ErrorIs(t, err, middleware.ErrEmptyKey)
			require.Contains(t, err.Error(), `handler "empty-key-plain"`)
			require.Contains(t, err.Error(), "set a UUID on the message")
			require.Contains(t, err.Error(), "message_id")
			require.Contains(t, err.Error(), "Config.Key")
		})
	}
}

// faultRefuseAfterBegin is a DB whose next BeginTx, once armed, makes the
// proxy refuse right after the transaction began: the database goes away
// between BEGIN and the inbox claim.
type faultRefuseAfterBegin struct {
	wsql.Beginner
	proxy *testenv.Proxy
	armed atomic.Bool
}

func (b *faultRefuseAfterBegin) BeginTx(ctx context.Context, opts *stdsql.TxOptions) (wsql.Tx, error) {
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
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			tables := testenv.Schema(t)
			faultCreateEffects(t, d.DB, tables)
			in := testenv.Queue(t, "dbdown_in_")
			conn := testenv.AMQPConn(t)
			proxy := testenv.NewProxy(t, faultDBAddr(t))
			via := faultDriverVia(t, d, proxy.RewriteURL(testenv.DatabaseURL()))
			db := &faultRefuseAfterBegin{Beginner: via.DB, proxy: proxy}

			var ev faultEvents
			var calls atomic.Int64
			eo, err := middleware.New(middleware.Config{DB: db, Tables: tables, OnEvent: ev.Observe})
			require.NoError(t, err)
			handler := func(msg *message.Message) error {
				calls.Add(1)
				return faultInsertEffect(msg.Context(), tables, msg.UUID, "")
			}
			newRouter := func() *message.Router {
				r := faultNewRouter(t)
				r.AddMiddleware(eo.Middleware)
				r.AddConsumerHandler("db-down", in, testenv.AMQPSubscriber(t, 1), handler)
				testenv.StartRouter(t, r)
				return r
			}

			db.armed.Store(true)
			r := newRouter()
			msgUUID := watermill.NewUUID()
			require.NoError(t, testenv.AMQPPublisher(t).Publish(in, message.NewMessage(msgUUID, []byte(`{}`))))

			// Fails at the claim, then (proxy refusing) at BEGIN on each
			// redelivery: never acked.
			testenv.Eventually(t, faultWait, func() bool { return ev.DBUnavailable.Load() >= 3 },
				"the middleware did not report the database as unavailable on redeliveries")
			require.True(t, proxy.Refusing())
			require.NoError(t, r.Close())
			faultRequireQueueSettled(t, conn, in, 1)
			require.Equal(t, int64(0), calls.Load(), "the handler must not run without its transaction")
			require.Equal(t, int64(0), ev.Processed.Load())
			down := ev.Of(middleware.EventDBUnavailable)
			for _, e := range down {
				require.ErrorIs(t, e.Err, middleware.ErrDBUnavailable)
				require.Equal(t, msgUUID, e.Key)
			}
			require.Contains(t, down[0].Err.Error(), "claiming", "the first delivery failed at the claim")
			require.Contains(t, down[len(down)-1].Err.Error(), "begin", "later deliveries failed at BEGIN")

			// The database is back: processed exactly once.
			proxy.Allow()
			r = newRouter()
			testenv.Eventually(t, faultWait, func() bool { return ev.Processed.Load() == 1 },
				"the message was not processed once the database was back")
			require.NoError(t, r.Close())
			faultRequireQueueSettled(t, conn, in, 0)
			require.Equal(t, int64(1), calls.Load())
			require.Equal(t, int64(1), faultEffects(t, d.DB, tables))
			require.Equal(t, int64(0), ev.Duplicates.Load())
			require.Equal(t, int64(0), ev.FailOpen.Load())
		})
	}
}

// (c) A handler that panics: its writes are rolled back, the message is
// redelivered and processed once the panic stops.
func TestFailureHandlerPanic(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			tables := testenv.Schema(t)
			faultCreateEffects(t, d.DB, tables)
			in := testenv.Queue(t, "panic_in_")
			conn := testenv.AMQPConn(t)

			var ev faultEvents
			var attempts atomic.Int64
			var redelivered atomic.Bool
			eo, err := middleware.New(middleware.Config{DB: d.DB, Tables: tables, OnEvent: ev.Observe})
			require.NoError(t, err)
			r := faultNewRouter(t)
			r.AddMiddleware(eo.Middleware)
			r.AddConsumerHandler("panicky", in, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
				n := attempts.Add(1)
				if err := faultInsertEffect(msg.Context(), tables, "attempt-"+strconv.FormatInt(n, 10), msg.UUID); err != nil {
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
			require.NoError(t, testenv.AMQPPublisher(t).Publish(in, message.NewMessage(msgUUID, []byte(`{}`))))
			testenv.Eventually(t, faultWait, func() bool { return ev.Processed.Load() == 1 },
				"the message was not processed after the panic")
			require.NoError(t, r.Close())
			faultRequireQueueSettled(t, conn, in, 0)

			require.Equal(t, int64(2), attempts.Load())
			require.True(t, redelivered.Load(), "the second attempt is RabbitMQ's redelivery")
			failed := ev.Of(middleware.EventFailed)
			require.Len(t, failed, 1)
			require.ErrorIs(t, failed[0].Err, middleware.ErrHandlerPanic)
			require.Contains(t, failed[0].Err.Error(), "boom: first delivery")
			// Only the second attempt's write exists: the panic rolled back the first.
			require.Equal(t, int64(1), faultEffects(t, d.DB, tables))
			require.Equal(t, int64(1), faultCount(t, d.DB,
				"SELECT count(*) FROM "+faultTable(tables, "effects")+" WHERE id = 'attempt-2' AND note = $1", msgUUID))
			require.Equal(t, int64(0), ev.Duplicates.Load())
		})
	}
}

// (d) Fail-open: with the database down, the handler runs without a
// transaction, the message is acked, and the handler's output goes to the
// router's publisher (there is no outbox to write it to).
func TestFailureFailOpen(t *testing.T) {
	t.Parallel()
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			tables := testenv.Schema(t)
			in := testenv.Queue(t, "failopen_in_")
			out := testenv.Queue(t, "failopen_out_")
			conn := testenv.AMQPConn(t)
			proxy := testenv.NewProxy(t, faultDBAddr(t))
			proxy.Refuse()
			via := faultDriverVia(t, d, proxy.RewriteURL(testenv.DatabaseURL()))
			pub := testenv.AMQPPublisher(t)

			var ev faultEvents
			var calls atomic.Int64
			var sawTx atomic.Bool
			eo, err := middleware.New(middleware.Config{DB: via.DB, Tables: tables, FailOpen: true, OnEvent: ev.Observe})
			require.NoError(t, err)
			outUUID := watermill.NewUUID()
			routedUUID := watermill.NewUUID()
			r := faultNewRouter(t)
			r.AddMiddleware(eo.Middleware)
			r.AddHandler("fail-open", in, testenv.AMQPSubscriber(t, 1), out, pub, func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				_, pgxOK := middleware.PgxTxFromContext(msg.Context())
				_, stdOK := middleware.StdTxFromContext(msg.Context())
				_, anyOK := middleware.TxFromContext(msg.Context())
				_, obOK := middleware.OutboxFromContext(msg.Context())
				sawTx.Store(pgxOK || stdOK || anyOK || obOK)
				// SetDestination to the handler's own publish topic is
				// honoured; the internal destination key is not published.
				routed := message.NewMessage(routedUUID, []byte(`{}`))
				middleware.SetDestination(routed, out)
				return []*message.Message{message.NewMessage(outUUID, []byte(`{"sms":"sent without dedup"}`)), routed}, nil
			})
			testenv.StartRouter(t, r)

			require.NoError(t, pub.Publish(in, message.NewMessage(watermill.NewUUID(), []byte(`{}`))))
			testenv.Eventually(t, faultWait, func() bool { return ev.FailOpen.Load() == 1 },
				"the handler did not run fail-open")
			var got []amqp.Delivery
			testenv.Eventually(t, faultWait, func() bool {
				got = append(got, faultDrain(t, conn, out)...)
				return len(got) >= 2
			}, "the router did not publish the fail-open handler's output")
			require.NoError(t, r.Close())
			faultRequireQueueSettled(t, conn, in, 0) // acked
			require.Empty(t, faultDrain(t, conn, out))

			require.Len(t, got, 2)
			require.Equal(t, outUUID, faultUUIDOf(got[0]))
			require.Equal(t, routedUUID, faultUUIDOf(got[1]))
			for _, g := range got {
				require.NotContains(t, g.Headers, middleware.TopicMetadataKey, "the internal destination key leaked")
			}
			require.Equal(t, int64(1), calls.Load())
			require.False(t, sawTx.Load(), "fail-open runs the handler without a transaction or outbox")
			require.Equal(t, int64(1), ev.FailOpen.Load())
			require.Equal(t, int64(0), ev.DBUnavailable.Load())
			require.Equal(t, int64(0), ev.Processed.Load())
			require.Greater(t, proxy.Stats().Refused, int64(0), "the database really was unreachable")

			// Nothing was written behind the outage: no inbox row, no outbox row.
			require.Equal(t, int64(0), faultPending(t, d.DB, tables))
			require.Equal(t, int64(0), faultCount(t, d.DB, "SELECT count(*) FROM "+tables.Inbox()))
		})
	}
}

// (e) Fail-open with an output for another topic: without the outbox only
// the router can publish, and it publishes to the handler's publish topic.
// The delivery is nacked with ErrNoDestination rather than published to the
// wrong topic or dropped.
func TestFailureFailOpenOtherDestination(t *testing.T) {
	t.Parallel()
	d := faultDriver(t, "pgxpool")
	tables := testenv.Schema(t)
	in := testenv.Queue(t, "failopen2_in_")
	out := testenv.Queue(t, "failopen2_out_")
	elsewhere := testenv.Queue(t, "failopen2_else_")
	conn := testenv.AMQPConn(t)
	proxy := testenv.NewProxy(t, faultDBAddr(t))
	proxy.Refuse()
	via := faultDriverVia(t, d, proxy.RewriteURL(testenv.DatabaseURL()))
	pub := testenv.AMQPPublisher(t)

	var ev faultEvents
	eo, err := middleware.New(middleware.Config{DB: via.DB, Tables: tables, FailOpen: true, OnEvent: ev.Observe, NackDelay: 50 * time.Millisecond})
	require.NoError(t, err)
	r := faultNewRouter(t)
	r.AddMiddleware(eo.Middleware)
	r.AddHandler("fail-open-else", in, testenv.AMQPSubscriber(t, 1), out, pub, func(msg *message.Message) ([]*message.Message, error) {
		m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		middleware.SetDestination(m, elsewhere)
		return []*message.Message{m}, nil
	})
	testenv.StartRouter(t, r)
	require.NoError(t, pub.Publish(in, message.NewMessage(watermill.NewUUID(), []byte(`{}`))))
	testenv.Eventually(t, faultWait, func() bool { return len(ev.Of(middleware.EventFailOpen)) >= 2 },
		"the fail-open run was not redelivered after its nack")
	require.NoError(t, r.Close())
	for _, e := range ev.Of(middleware.EventFailOpen) {
		require.ErrorIs(t, e.Err, middleware.ErrNoDestination)
		require.Contains(t, e.Err.Error(), elsewhere)
	}
	faultRequireQueueSettled(t, conn, in, 1) // nacked, kept
	require.Empty(t, faultDrain(t, conn, out), "nothing published to the wrong topic")
	require.Empty(t, faultDrain(t, conn, elsewhere))
}
