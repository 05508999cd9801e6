package rabbitmq_test

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

func TestPartitionIsStable(t *testing.T) {
	// FNV-1a 32 of "order-1" is 0x2b7fcd6d (729795949): fixed, so that a
	// producer in another language routes the same way.
	require.Equal(t, 729795949%8, rabbitmq.Partition("order-1", 8))
	require.Equal(t, "orders.p3", rabbitmq.PartitionQueue("orders", 3))
	seen := map[int]bool{}
	for i := range 1000 {
		p := rabbitmq.Partition(fmt.Sprintf("k%d", i), 8)
		require.True(t, p >= 0 && p < 8)
		seen[p] = true
	}
	require.Len(t, seen, 8, "1000 keys reach every partition")
}

func TestPublisherConfigPartitionsChecked(t *testing.T) {
	_, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: testenv.AMQPURL(), Partitions: map[string]int{"orders": 0}})
	require.ErrorContains(t, err, `PublisherConfig.Partitions: topic "orders": 0 partitions, it must be between 1 and 1024`)
}

// deletePartitions deletes the partition queues of topic at cleanup.
func deletePartitions(t *testing.T, topic string, n int) {
	t.Cleanup(func() {
		conn, err := amqp091.Dial(testenv.AMQPURL())
		if err != nil {
			t.Errorf("deleting partitions of %s: %v", topic, err)
			return
		}
		defer func() { _ = conn.Close() }()
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("deleting partitions of %s: %v", topic, err)
			return
		}
		for i := range n {
			_, _ = ch.QueueDelete(rabbitmq.PartitionQueue(topic, i), false, false, false)
		}
	})
}

func keyedMessage(key string, seq int) *message.Message {
	m := message.NewMessage(fmt.Sprintf("%s-%03d", key, seq), []byte(strconv.Itoa(seq)))
	m.Metadata.Set("seq", strconv.Itoa(seq))
	return msgid.SetOrderingKey(m, key)
}

// TestPublisherPartitionsByKey: a partitioned topic's messages go to the
// partition queue of their key, in order, and the queues are declared with
// single active consumer.
func TestPublisherPartitionsByKey(t *testing.T) {
	const n, keys, perKey = 4, 12, 5
	topic := testenv.Unique(t, "part_")
	deletePartitions(t, topic, n)
	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: testenv.AMQPURL(), Partitions: map[string]int{topic: n}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	for seq := 1; seq <= perKey; seq++ {
		var msgs []*message.Message
		for k := range keys {
			msgs = append(msgs, keyedMessage(fmt.Sprintf("key-%d", k), seq))
		}
		require.NoError(t, pub.Publish(topic, msgs...))
	}
	conn := testenv.AMQPConn(t)
	ch, err := conn.Channel()
	require.NoError(t, err)
	got := map[string][]int{} // key -> seqs, in queue order
	for i := range n {
		q := rabbitmq.PartitionQueue(topic, i)
		for {
			d, ok, err := ch.Get(q, true)
			require.NoError(t, err)
			if !ok {
				break
			}
			key, _ := d.Headers[msgid.OrderingKeyMetadata].(string)
			require.Equal(t, q, rabbitmq.PartitionQueue(topic, rabbitmq.Partition(key, n)), "key %s in the wrong partition", key)
			seq, _ := strconv.Atoi(string(d.Body))
			got[key] = append(got[key], seq)
		}
	}
	require.Len(t, got, keys)
	for k, seqs := range got {
		require.Equal(t, []int{1, 2, 3, 4, 5}, seqs, "key %s", k)
	}
	// Declared with single active consumer: a declaration without it is
	// refused.
	_, err = ch.QueueDeclare(rabbitmq.PartitionQueue(topic, 0), true, false, false, false, nil)
	var amqpErr *amqp091.Error
	require.ErrorAs(t, err, &amqpErr)
	require.Equal(t, amqp091.PreconditionFailed, amqpErr.Code)
}

// TestPartitionedSubscriberKeepsKeyOrder: a handler registered with
// PartitionedSubscriber, failing a third of its deliveries at random (the
// router nacks, the message is redelivered), handles each key's messages
// in order, while partitions run concurrently: over watermill-amqp's
// subscriber with prefetch 1, and over this package's Subscriber, whose
// Prefetch of 64 PartitionedSubscriber must override with 1 per partition.
func TestPartitionedSubscriberKeepsKeyOrder(t *testing.T) {
	t.Run("watermill-amqp", func(t *testing.T) {
		sub, err := wamqp.NewSubscriber(testenv.PartitionSubscriberConfig(testenv.AMQPURL()), watermill.NopLogger{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() }) // the router closes it only when Close ends it
		testPartitionedKeyOrder(t, sub)
	})
	t.Run("Subscriber", func(t *testing.T) {
		sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: testenv.AMQPURL(), Prefetch: 64, Logger: watermill.NopLogger{}})
		require.NoError(t, err)
		t.Cleanup(func() { _ = sub.Close() })
		testPartitionedKeyOrder(t, sub)
	})
}

func testPartitionedKeyOrder(t *testing.T, sub message.Subscriber) {
	const n, keys, perKey = 4, 16, 15
	topic := testenv.Unique(t, "psub_")
	deletePartitions(t, topic, n)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, rabbitmq.DeclarePartitions(ctx, testenv.AMQPURL(), topic, n))
	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: testenv.AMQPURL(), Partitions: map[string]int{topic: n}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	for seq := 1; seq <= perKey; seq++ {
		var msgs []*message.Message
		for k := range keys {
			msgs = append(msgs, keyedMessage(fmt.Sprintf("key-%d", k), seq))
		}
		require.NoError(t, pub.Publish(topic, msgs...))
	}

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	var (
		mu       sync.Mutex
		handled  = map[string][]int{}
		inFlight int
		maxIn    int
		total    int
		rng      = mrand.New(mrand.NewPCG(1, 2))
	)
	errFlaky := errors.New("flaky handler (test)")
	router.AddConsumerHandler("ordered", topic, rabbitmq.PartitionedSubscriber(sub, n), func(msg *message.Message) error {
		mu.Lock()
		inFlight++
		maxIn = max(maxIn, inFlight)
		fail := rng.IntN(3) == 0
		mu.Unlock()
		time.Sleep(time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		inFlight--
		if fail {
			return errFlaky
		}
		seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
		k := msgid.OrderingKey(msg)
		handled[k] = append(handled[k], seq)
		total++
		return nil
	})
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return total == keys*perKey
	}, 50*time.Second, 10*time.Millisecond)
	require.NoError(t, router.Close())
	want := make([]int, perKey)
	for i := range want {
		want[i] = i + 1
	}
	for k, seqs := range handled {
		require.Equal(t, want, seqs, "key %s", k)
	}
	require.Greater(t, maxIn, 1, "partitions run concurrently")
}
