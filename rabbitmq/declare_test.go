package rabbitmq_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// A mandatory publish to the default exchange is returned (NO_ROUTE) when no
// queue has the routing key, which is what a plain publish silently drops;
// after DeclareQueues the same publish lands in the queue.
func TestDeclareQueuesPreventsSilentDrop(t *testing.T) {
	url := amqpURL(t)
	ctx := testContext(t)
	declared := uniqueQueue(t, url, "declared")
	undeclared := uniqueQueue(t, url, "undeclared")

	require.NoError(t, rabbitmq.DeclareQueues(ctx, url, declared))

	ch := rawChannel(t, url)
	require.NoError(t, ch.Confirm(false))
	returns := ch.NotifyReturn(make(chan amqp091.Return, 1))
	publish := func(key string) {
		t.Helper()
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", key, true, false, amqp091.Publishing{Body: []byte(key)})
		require.NoError(t, err)
		acked, err := dc.WaitContext(ctx)
		require.NoError(t, err)
		require.True(t, acked)
	}

	publish(undeclared)
	select {
	case r := <-returns:
		require.Equal(t, uint16(amqp091.NoRoute), r.ReplyCode)
		require.Equal(t, undeclared, r.RoutingKey)
	case <-time.After(5 * time.Second):
		require.FailNow(t, "a publish to an undeclared queue was not returned")
	}

	publish(declared)
	// RabbitMQ sends basic.return before the confirm, so it would be here.
	select {
	case r := <-returns:
		require.FailNow(t, "publish to the declared queue was returned", "%s: %s", r.RoutingKey, r.ReplyText)
	default:
	}
	q, err := ch.QueueDeclarePassive(declared, true, false, false, false, nil)
	require.NoError(t, err)
	require.Equal(t, 1, q.Messages)
}

// A queue DeclareQueues created is accepted by a watermill-amqp
// NewDurableQueueConfig subscriber; a queue declared with other properties is
// not (the check can fail), and DeclareQueues reports it clearly.
func TestDeclareQueuesMatchesWatermillDurableQueue(t *testing.T) {
	url := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, url, "wm")
	require.NoError(t, rabbitmq.DeclareQueues(ctx, url, q))
	require.NoError(t, rabbitmq.DeclareQueues(ctx, url, q), "declaring again changes nothing")

	sub := newSubscriber(t, url, rabbitmq.Marshaler{})
	_, err := sub.Subscribe(ctx, q)
	require.NoError(t, err)

	transient := uniqueQueue(t, url, "transient")
	_, err = rawChannel(t, url).QueueDeclare(transient, false, false, false, false, nil)
	require.NoError(t, err)
	_, err = newSubscriber(t, url, rabbitmq.Marshaler{}).Subscribe(ctx, transient)
	require.ErrorContains(t, err, "PRECONDITION_FAILED", "watermill-amqp refuses a queue with other properties")

	err = rabbitmq.DeclareQueues(ctx, url, transient)
	require.ErrorContains(t, err, "PRECONDITION_FAILED")
	require.ErrorContains(t, err, "rabbitmq: ")
	require.ErrorContains(t, err, transient)
	require.ErrorContains(t, err, "exists with other properties")
}

func TestDeclareQueuesRejectsEmptyName(t *testing.T) {
	// The URL is unreachable: names are checked before connecting.
	err := rabbitmq.DeclareQueues(context.Background(), "amqp://guest:guest@127.0.0.1:1/", "orders", "")
	require.ErrorContains(t, err, "rabbitmq: ")
	require.ErrorContains(t, err, "queue name 2 of 2 is empty")

	require.NoError(t, rabbitmq.DeclareQueues(context.Background(), "amqp://guest:guest@127.0.0.1:1/"), "no names: nothing to do")
}

func TestDeclareQueuesUnreachable(t *testing.T) {
	start := time.Now()
	err := rabbitmq.DeclareQueues(context.Background(), "amqp://guest:secret@127.0.0.1:1/", "orders")
	require.Less(t, time.Since(start), 5*time.Second)
	require.ErrorContains(t, err, "rabbitmq: ")
	require.ErrorContains(t, err, "cannot connect to 127.0.0.1:1")
	require.Regexp(t, `cannot connect to 127\.0\.0\.1:1: \S`, err.Error(), "the cause follows")
	require.NotContains(t, err.Error(), "secret", "the password stays out of errors")

	err = rabbitmq.DeclareQueues(context.Background(), "http://127.0.0.1:5672/", "orders")
	require.ErrorContains(t, err, "invalid AMQP URL")
}

// A server that accepts TCP connections but never speaks AMQP: without
// honouring ctx, DeclareQueues would wait for amqp091-go's 30 s handshake
// timeout.
func TestDeclareQueuesRespectsContext(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var (
		mu    sync.Mutex
		conns []net.Conn
		wg    sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	url := "amqp://guest:guest@" + ln.Addr().String() + "/"

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = rabbitmq.DeclareQueues(ctx, url, "orders-"+watermill.NewShortUUID())
	require.Less(t, time.Since(start), 3*time.Second)
	require.True(t, errors.Is(err, context.DeadlineExceeded), "got %v", err)
	require.ErrorContains(t, err, "rabbitmq: ")

	cancelled, cancelNow := context.WithCancel(context.Background())
	cancelNow()
	err = rabbitmq.DeclareQueues(cancelled, url, "orders")
	require.True(t, errors.Is(err, context.Canceled), "got %v", err)
}
