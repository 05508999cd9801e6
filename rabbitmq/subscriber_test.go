package rabbitmq_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

func newOwnSubscriber(t *testing.T, cfg rabbitmq.SubscriberConfig) *rabbitmq.Subscriber {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	sub, err := rabbitmq.NewSubscriber(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	return sub
}

// fill publishes n messages with UUIDs prefix-0 ... to queue, declared as
// Subscriber declares it.
func fill(t *testing.T, url, queue, prefix string, n int) {
	t.Helper()
	require.NoError(t, rabbitmq.DeclareQueues(testContext(t), url, queue))
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: url})
	requireAllNil(t, pub.PublishBatch(testContext(t), to(queue, messages(prefix, n))))
}

// queueDepth is the number of ready messages in queue (unacked ones are
// not counted).
func queueDepth(t *testing.T, url, queue string) int {
	t.Helper()
	q, err := rawChannel(t, url).QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	return q.Messages
}

func TestSubscriberManyDeliveriesInFlight(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-inflight")
	fill(t, url, queue, "m", 200)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Prefetch: 50})
	msgs, err := sub.Subscribe(testContext(t), queue)
	require.NoError(t, err)

	// 50 deliveries arrive without any of them being acked: one
	// subscription has the whole prefetch window in flight.
	var first []*message.Message
	for range 50 {
		select {
		case m := <-msgs:
			first = append(first, m)
		case <-time.After(10 * time.Second):
			require.FailNow(t, "fewer than 50 deliveries in flight", "got %d", len(first))
		}
	}
	select {
	case m := <-msgs:
		require.FailNow(t, "a 51st delivery arrived while 50 were unacked", "uuid %s", m.UUID)
	case <-time.After(300 * time.Millisecond):
	}
	seen := map[string]int{}
	for _, m := range first {
		seen[m.UUID]++
		m.Ack()
	}
	for len(seen) < 200 {
		select {
		case m := <-msgs:
			seen[m.UUID]++
			m.Ack()
		case <-time.After(10 * time.Second):
			require.FailNow(t, "messages missing", "got %d of 200", len(seen))
		}
	}
	for id, n := range seen {
		require.Equal(t, 1, n, "message %s delivered %d times", id, n)
	}
	require.NoError(t, sub.Close())
	require.Zero(t, queueDepth(t, url, queue), "every ack reached the broker")
}

func TestSubscriberNackRequeuesOnlyThatMessage(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-nack")
	fill(t, url, queue, "m", 20)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Prefetch: 20})
	msgs, err := sub.Subscribe(testContext(t), queue)
	require.NoError(t, err)
	seen := map[string]int{}
	for len(seen) < 20 || seen["m-00007"] < 2 {
		select {
		case m := <-msgs:
			seen[m.UUID]++
			if m.UUID == "m-00007" && seen[m.UUID] == 1 {
				m.Nack()
				continue
			}
			m.Ack()
		case <-time.After(10 * time.Second):
			require.FailNow(t, "messages missing", "seen %v", seen)
		}
	}
	select {
	case m := <-msgs:
		require.FailNow(t, "an acked message came back", "uuid %s", m.UUID)
	case <-time.After(300 * time.Millisecond):
	}
	for id, n := range seen {
		want := 1
		if id == "m-00007" {
			want = 2
		}
		require.Equal(t, want, n, "message %s", id)
	}
}

// Close waits for the deliveries in flight and acknowledges them: a handler
// that finishes after Close began is not redelivered.
func TestSubscriberCloseSettlesInFlight(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-close")
	fill(t, url, queue, "m", 30)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Prefetch: 30, CloseTimeout: 10 * time.Second})
	msgs, err := sub.Subscribe(testContext(t), queue)
	require.NoError(t, err)
	var got []*message.Message
	for range 30 {
		select {
		case m := <-msgs:
			got = append(got, m)
		case <-time.After(10 * time.Second):
			require.FailNow(t, "messages missing")
		}
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		for _, m := range got {
			m.Ack()
		}
	}()
	start := time.Now()
	require.NoError(t, sub.Close())
	require.GreaterOrEqual(t, time.Since(start), 250*time.Millisecond, "Close must wait for the deliveries in flight")
	_, open := <-msgs
	require.False(t, open, "Close closes the subscription's channel")
	require.Zero(t, queueDepth(t, url, queue), "the acks given during Close reached the broker")
}

// What is still in flight after CloseTimeout goes back to the queue.
func TestSubscriberCloseTimeoutRequeues(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-close-timeout")
	fill(t, url, queue, "m", 5)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Prefetch: 5, CloseTimeout: 200 * time.Millisecond})
	msgs, err := sub.Subscribe(testContext(t), queue)
	require.NoError(t, err)
	for i := range 5 {
		m := <-msgs
		if i < 2 {
			m.Ack()
		}
	}
	require.NoError(t, sub.Close())
	require.Eventually(t, func() bool { return queueDepth(t, url, queue) == 3 }, 5*time.Second, 50*time.Millisecond,
		"the 3 unsettled deliveries go back, the 2 acked ones do not")
}

// A lost connection: the subscription consumes again on a new one; the
// deliveries in flight on the old one are redelivered, none is lost.
func TestSubscriberConsumesAgainAfterConnectionLoss(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-reconnect")
	const n = 300
	fill(t, url, queue, "m", n)
	proxy, purl := proxied(t, url)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: purl, Prefetch: 32, ReconnectDelay: 200 * time.Millisecond})
	ctx := testContext(t)
	msgs, err := sub.Subscribe(ctx, queue)
	require.NoError(t, err)

	seen := map[string]int{}
	cuts := 0
	for len(seen) < n {
		select {
		case m, ok := <-msgs:
			require.True(t, ok, "the subscription ended")
			seen[m.UUID]++
			if len(seen)%100 == 50 && cuts < 2 && seen[m.UUID] == 1 {
				cuts++
				proxy.Refuse() // with this and up to 31 others unacked
				time.AfterFunc(300*time.Millisecond, proxy.Allow)
			}
			go func() {
				time.Sleep(time.Millisecond)
				m.Ack()
			}()
		case <-ctx.Done():
			require.FailNow(t, "messages missing", "got %d of %d after %d cuts", len(seen), n, cuts)
		}
	}
	require.Equal(t, 2, cuts)
	require.NoError(t, sub.Close())
	require.Zero(t, queueDepth(t, url, queue))
}

func TestSubscriberSubscribeFailsClearly(t *testing.T) {
	url := amqpURL(t)
	_, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{})
	require.ErrorContains(t, err, "SubscriberConfig.URL is required")
	_, err = rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: url, Prefetch: -1})
	require.ErrorContains(t, err, "Prefetch is -1")

	down := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: "amqp://guest:guest@127.0.0.1:1/"})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = down.Subscribe(ctx, "x")
	require.ErrorContains(t, err, "cannot connect to 127.0.0.1:1")

	// A queue declared with other arguments: the declaration fails.
	queue := uniqueQueue(t, url, "sub-args")
	_, err = rawChannel(t, url).QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-max-length": int32(10)})
	require.NoError(t, err)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url})
	_, err = sub.Subscribe(testContext(t), queue)
	require.Error(t, err)
	require.True(t, strings.Contains(err.Error(), "PRECONDITION_FAILED") && strings.Contains(err.Error(), queue), "got %v", err)
	// ... and the Subscriber still works for other queues.
	ok := uniqueQueue(t, url, "sub-args-ok")
	fill(t, url, ok, "m", 1)
	msgs, err := sub.Subscribe(testContext(t), ok)
	require.NoError(t, err)
	select {
	case m := <-msgs:
		require.Equal(t, "m-00000", m.UUID)
		m.Ack()
	case <-time.After(10 * time.Second):
		require.FailNow(t, "no message")
	}

	require.NoError(t, sub.Close())
	_, err = sub.Subscribe(testContext(t), ok)
	require.ErrorContains(t, err, "closed")
	_, err = newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url}).Subscribe(testContext(t), "")
	require.ErrorContains(t, err, "topic is empty")
}

// The end of Subscribe's context ends that subscription only.
func TestSubscriberContextEndsSubscription(t *testing.T) {
	url := amqpURL(t)
	q1, q2 := uniqueQueue(t, url, "sub-ctx1"), uniqueQueue(t, url, "sub-ctx2")
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url})
	ctx1, cancel1 := context.WithCancel(testContext(t))
	m1, err := sub.Subscribe(ctx1, q1)
	require.NoError(t, err)
	m2, err := sub.Subscribe(testContext(t), q2)
	require.NoError(t, err)
	cancel1()
	select {
	case _, open := <-m1:
		require.False(t, open)
	case <-time.After(10 * time.Second):
		require.FailNow(t, "the subscription did not end with its context")
	}
	fill(t, url, q2, "x", 1)
	select {
	case m := <-m2:
		require.Equal(t, "x-00000", m.UUID)
		m.Ack()
	case <-time.After(10 * time.Second):
		require.FailNow(t, "the other subscription stopped too")
	}
}
