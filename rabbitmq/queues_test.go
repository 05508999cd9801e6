package rabbitmq_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

func TestQueuesValidate(t *testing.T) {
	for _, c := range []struct {
		q   rabbitmq.Queues
		err string
	}{
		{rabbitmq.Queues{}, ""},
		{rabbitmq.Queues{Type: rabbitmq.Classic}, ""},
		{rabbitmq.Queues{Type: rabbitmq.Quorum}, ""},
		{rabbitmq.Queues{Type: rabbitmq.Quorum, DeliveryLimit: -1}, "drops the message at its first return"},
		{rabbitmq.Queues{Type: rabbitmq.Quorum, DeliveryLimit: 5, DeadLetterRoutingKey: "dlq"}, ""},
		{rabbitmq.Queues{Type: rabbitmq.Classic, DeadLetterExchange: "dlx"}, ""},
		{rabbitmq.Queues{Type: "stream"}, `Queues.Type is "stream"`},
		{rabbitmq.Queues{DeliveryLimit: 5, DeadLetterExchange: "dlx"}, "only a quorum queue has a delivery limit"},
		{rabbitmq.Queues{Type: rabbitmq.Quorum, DeliveryLimit: 5}, "without a dead-letter exchange: the broker would drop"},
	} {
		err := c.q.Validate()
		if c.err == "" {
			require.NoError(t, err, "%+v", c.q)
		} else {
			require.ErrorContains(t, err, c.err, "%+v", c.q)
		}
	}
	_, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: defaultAMQPURL, Queues: rabbitmq.Queues{Type: rabbitmq.Quorum, DeliveryLimit: 3}})
	require.ErrorContains(t, err, "PublisherConfig.Queues")
	_, err = rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: defaultAMQPURL, Queues: rabbitmq.Queues{Type: "x"}})
	require.ErrorContains(t, err, "SubscriberConfig.Queues")
	_, err = rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: defaultAMQPURL, Queues: rabbitmq.Queues{Type: rabbitmq.Quorum}, QueueArguments: amqp091.Table{"x-max-length": 10}})
	require.ErrorContains(t, err, "both QueueArguments and Queues")
	_, err = rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URLs: []string{"http://x"}})
	require.ErrorContains(t, err, "invalid AMQP URL")
	_, err = rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URLs: []string{"", ""}})
	require.ErrorContains(t, err, "URL is required")

	require.Nil(t, rabbitmq.Queues{}.Arguments(), "the zero Queues declares as watermill-amqp's NewDurableQueueConfig")
	require.Equal(t, amqp091.Table{"x-single-active-consumer": true}, rabbitmq.PartitionQueueArguments())
	require.Equal(t, amqp091.Table{"x-queue-type": "quorum", "x-single-active-consumer": true},
		rabbitmq.Queues{Type: rabbitmq.Quorum}.PartitionArguments())
	require.Equal(t, amqp091.Table{
		"x-queue-type": "quorum", "x-delivery-limit": int64(3), "x-dead-letter-exchange": "",
		"x-dead-letter-routing-key": "dlq", "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish",
	}, rabbitmq.Queues{Type: rabbitmq.Quorum, DeliveryLimit: 3, DeadLetterRoutingKey: "dlq"}.Arguments())
}

// A quorum queue (a single node has them too): the Publisher declares it
// with its Queues, a classic declaration of it is refused, and a Subscriber
// with the same Queues consumes everything; partitions are quorum queues
// with single active consumer, and keep each key's order.
func TestQuorumQueues(t *testing.T) {
	t.Parallel()
	url := amqpURL(t)
	ctx := testContext(t)
	quorum := rabbitmq.Queues{Type: rabbitmq.Quorum}
	q := uniqueQueue(t, url, "quorum")
	topic := uniqueQueue(t, url, "quorum-parts")
	const n = 4
	deletePartitions(t, topic, n)

	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: url, Queues: quorum, Partitions: map[string]int{topic: n}})
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("q", 20))))

	err := rabbitmq.DeclareQueues(ctx, url, q)
	require.ErrorContains(t, err, "PRECONDITION_FAILED", "a classic declaration of a quorum queue")
	require.NoError(t, quorum.Declare(ctx, []string{url}, q), "the same declaration again")

	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Queues: quorum})
	msgs, err := sub.Subscribe(ctx, q)
	require.NoError(t, err)
	got := map[string]bool{}
	for len(got) < 20 {
		select {
		case m := <-msgs:
			got[m.UUID] = true
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%d of 20 messages from the quorum queue", len(got))
		}
	}

	// Partitions: 3 keys x 10 messages, in order per key.
	var batch []msgid.TopicMessage
	for i := range 10 {
		for k := range 3 {
			m := messages(fmt.Sprintf("k%d-%02d", k, i), 1)[0]
			msgid.SetOrderingKey(m, fmt.Sprintf("k%d", k))
			batch = append(batch, msgid.TopicMessage{Topic: topic, Message: m})
		}
	}
	requireAllNil(t, pub.PublishBatch(ctx, batch))
	psub := rabbitmq.PartitionedSubscriber(newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Queues: quorum}), n)
	pmsgs, err := psub.Subscribe(ctx, topic)
	require.NoError(t, err)
	last := map[string]string{}
	for range 30 {
		select {
		case m := <-pmsgs:
			k := msgid.OrderingKey(m)
			require.Less(t, last[k], m.UUID, "key %s out of order", k)
			last[k] = m.UUID
			m.Ack()
		case <-ctx.Done():
			t.Fatal("partitioned quorum queues did not deliver 30 messages")
		}
	}
	// A classic declaration of a quorum partition is refused.
	require.ErrorContains(t, rabbitmq.DeclarePartitions(ctx, url, topic, n), "PRECONDITION_FAILED")
}

// Several URLs: the first that answers serves, for the Publisher, the
// Subscriber and Declare; with none answering the error names each.
func TestSeveralURLs(t *testing.T) {
	t.Parallel()
	url := amqpURL(t)
	ctx := testContext(t)
	dead := "amqp://guest:guest@127.0.0.1:1/"
	q := uniqueQueue(t, url, "urls")
	require.NoError(t, rabbitmq.Queues{}.Declare(ctx, []string{dead, url}, q))
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: dead, URLs: []string{url}})
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("u", 5))))
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URLs: []string{dead, dead, url}})
	msgs, err := sub.Subscribe(ctx, q)
	require.NoError(t, err)
	for range 5 {
		select {
		case m := <-msgs:
			m.Ack()
		case <-ctx.Done():
			t.Fatal("no delivery through the second URL")
		}
	}
	err = rabbitmq.Queues{}.Declare(ctx, []string{dead, "amqp://guest:guest@127.0.0.1:2/"}, q)
	require.ErrorContains(t, err, "no node of 2 answers")
	require.ErrorContains(t, err, "127.0.0.1:1")
	require.ErrorContains(t, err, "127.0.0.1:2")
}

// The broker's delivery limit counts every delivery, whatever returned it:
// a message nacked DeliveryLimit times is dead-lettered to the configured
// queue, not dropped, with its x-death history. The middleware's own park
// does not depend on it (docs/clusters.md).
func TestQuorumDeliveryLimitDeadLetters(t *testing.T) {
	t.Parallel()
	url := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, url, "limited")
	dlq := uniqueQueue(t, url, "limited-dlq")
	const limit = 3
	require.NoError(t, rabbitmq.DeclareQueues(ctx, url, dlq))
	queues := rabbitmq.Queues{Type: rabbitmq.Quorum, DeliveryLimit: limit, DeadLetterRoutingKey: dlq}
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: url, Queues: queues})
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("limited", 1))))

	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Queues: queues, Prefetch: 1})
	sctx, cancel := context.WithCancel(ctx)
	msgs, err := sub.Subscribe(sctx, q)
	require.NoError(t, err)
	deliveries := 0
	ch := rawChannel(t, url)
	deadline := time.Now().Add(20 * time.Second)
	for {
		if d, ok, err := ch.Get(dlq, true); err == nil && ok {
			require.Equal(t, "limited-00000", d.MessageId)
			require.NotNil(t, d.Headers["x-death"], "dead-lettered with its history")
			break
		}
		require.True(t, time.Now().Before(deadline), "not dead-lettered after %d deliveries", deliveries)
		select {
		case m := <-msgs:
			deliveries++
			m.Nack()
		case <-time.After(50 * time.Millisecond):
		}
	}
	cancel()
	// RabbitMQ 3.10 dead-letters once the count of returns exceeds the
	// limit: the message is delivered limit+1 times.
	require.Equal(t, limit+1, deliveries, "deliveries before dead-lettering")
}
