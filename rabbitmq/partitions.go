package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/exactlyonce/watermill-exactlyonce/internal/fanin"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
)

// Partitioned topics: per-key order on the consumer's side, with
// concurrency across keys (see docs/ordering.md).
//
// A partitioned topic is n durable queues, PartitionQueue(topic, 0) to
// PartitionQueue(topic, n-1), each declared with single active consumer
// (PartitionQueueArguments): however many instances subscribe to a
// partition, RabbitMQ delivers it to one at a time, in queue order. The
// Publisher (PublisherConfig.Partitions) sends a message to the partition
// of its ordering key (msgid.OrderingKey: the metadata field
// msgid.OrderingKeyMetadata, which msgid.SetOrderingKey sets),
// Partition(key, n); a message without one to the partition of its UUID.
// PartitionedSubscriber subscribes a handler to every partition of a topic,
// each subscription taking one message at a time.
// So the messages of one key reach one queue, in the order the relay
// published them, and are handled one at a time in that order, while the
// n partitions run in parallel.

// MaxPartitions is the most partitions a topic may have.
const MaxPartitions = 1024

// PartitionQueue is the name of partition i of topic: topic + ".p" + i.
func PartitionQueue(topic string, i int) string {
	return topic + ".p" + strconv.Itoa(i)
}

// Partition is the partition of ordering key key among n: FNV-1a (32 bits)
// of the key's bytes, modulo n. A producer in another language routes the
// same way with the same function.
func Partition(key string, n int) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(key))
	return int(h.Sum32() % uint32(n)) //nolint:gosec // n is at most MaxPartitions
}

// PartitionQueueArguments are the arguments a classic partition queue is
// declared with: single active consumer (Queues{}.PartitionArguments();
// Queues.PartitionArguments for quorum partitions). A subscriber that
// declares the queue must pass the same (watermill-amqp:
// cfg.Queue.Arguments), or RabbitMQ refuses its declaration
// (PRECONDITION_FAILED, inequivalent arg).
func PartitionQueueArguments() amqp091.Table {
	return Queues{}.PartitionArguments()
}

// DeclarePartitions declares the n partition queues of topic (durable,
// single active consumer), as the Publisher does on its first message to
// the topic; call it before consumers subscribe when they start first.
// Queues.DeclarePartitions declares quorum partitions.
func DeclarePartitions(ctx context.Context, amqpURL, topic string, n int) error {
	if err := checkPartitions(topic, n); err != nil {
		return fmt.Errorf("rabbitmq: DeclarePartitions: %w", err)
	}
	queues := make([]string, n)
	for i := range n {
		queues[i] = PartitionQueue(topic, i)
	}
	return declareAll(ctx, "DeclarePartitions", []string{amqpURL}, queues, PartitionQueueArguments())
}

func checkPartitions(topic string, n int) error {
	switch {
	case topic == "":
		return errors.New("the topic is empty")
	case n < 1 || n > MaxPartitions:
		return fmt.Errorf("topic %q: %d partitions, it must be between 1 and %d", topic, n, MaxPartitions)
	}
	return nil
}

// route returns the queue each message of batch goes to (its topic, or for
// a partitioned topic its key's partition queue) and the messages.
func (p *Publisher) route(batch []msgid.TopicMessage) (queues []string, msgs []*message.Message) {
	queues, msgs = make([]string, len(batch)), make([]*message.Message, len(batch))
	for i, tm := range batch {
		queues[i], msgs[i] = tm.Topic, tm.Message
		n := p.cfg.Partitions[tm.Topic]
		if n == 0 || tm.Message == nil {
			continue
		}
		key := msgid.OrderingKey(tm.Message)
		if key == "" {
			key = tm.Message.UUID
		}
		queues[i] = PartitionQueue(tm.Topic, Partition(key, n))
	}
	return queues, msgs
}

// queueArguments are the arguments queue is declared with.
func (p *Publisher) queueArguments(queue string) amqp091.Table {
	if _, ok := p.partitionOf[queue]; ok {
		return p.cfg.Queues.PartitionArguments()
	}
	return p.cfg.Queues.Arguments()
}

// PartitionedSubscriber returns a message.Subscriber whose Subscribe(ctx,
// topic) subscribes sub to each of the n partition queues of topic
// (PartitionQueue(topic, i)) and merges their deliveries into one channel.
// Register one handler with it: up to n deliveries are in flight at once,
// one per partition, all under the handler's one name (and so one consumer
// name for the exactly-once middleware, in any mode).
//
// sub must consume the queue named like the topic it is given, declare it
// with PartitionQueueArguments, and take one message at a time, acking or
// nacking (with requeue) each before it receives the next. With
// watermill-amqp v3:
//
//	cfg := amqp.NewDurableQueueConfig(amqpURL)
//	cfg.Marshaler = rabbitmq.Marshaler{}
//	cfg.Queue.Arguments = rabbitmq.PartitionQueueArguments()
//	cfg.Consume.Qos.PrefetchCount = 1 // a nacked message comes back before the next
//	sub, err := amqp.NewSubscriber(cfg, logger)
//	...
//	router.AddConsumerHandler("ship-order", "orders", rabbitmq.PartitionedSubscriber(sub, 8), handler)
//
// Prefetch 1 matters: a message nacked with requeue goes back to the head
// of its queue, but messages the broker already sent to the subscriber
// would be handled before it comes back. With this package's Subscriber
// both are taken care of: each partition is consumed with a prefetch of 1
// and declared with its SubscriberConfig.Queues' PartitionArguments
// (PartitionQueueArguments for classic queues), whatever QueueArguments says:
//
//	sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: amqpURL})
//	...
//	router.AddConsumerHandler("ship-order", "orders", rabbitmq.PartitionedSubscriber(sub, 8), handler)
//
// n must equal the Partitions of the topic in the publisher. Closing the
// returned subscriber closes sub. When ctx ends, deliveries taken but not
// handed over are nacked.
func PartitionedSubscriber(sub message.Subscriber, n int) message.Subscriber {
	return &partitionedSubscriber{sub: sub, n: n}
}

type partitionedSubscriber struct {
	sub       message.Subscriber
	n         int
	closeOnce sync.Once
	closeErr  error
}

func (s *partitionedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if s.sub == nil {
		return nil, errors.New("rabbitmq: PartitionedSubscriber: subscriber is nil")
	}
	if err := checkPartitions(topic, s.n); err != nil {
		return nil, fmt.Errorf("rabbitmq: PartitionedSubscriber: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	chans := make([]<-chan *message.Message, 0, s.n)
	own, _ := s.sub.(*Subscriber)
	for i := range s.n {
		var ch <-chan *message.Message
		var err error
		if own != nil {
			// One delivery in flight per partition, and the queue
			// declared as Publisher declares partitions.
			ch, err = own.subscribe(ctx, PartitionQueue(topic, i), 1, own.cfg.Queues.PartitionArguments())
		} else {
			ch, err = s.sub.Subscribe(ctx, PartitionQueue(topic, i))
		}
		if err != nil {
			cancel()
			return nil, fmt.Errorf("rabbitmq: PartitionedSubscriber: partition %d of %d of %q: %w", i, s.n, topic, err)
		}
		chans = append(chans, ch)
	}
	return fanin.Merge(ctx, cancel, chans), nil
}

func (s *partitionedSubscriber) Close() error {
	s.closeOnce.Do(func() {
		if s.sub != nil {
			s.closeErr = s.sub.Close()
		}
	})
	return s.closeErr
}
