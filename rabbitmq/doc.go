// Package rabbitmq holds helpers for running the exactly-once middleware on
// RabbitMQ with watermill-amqp v3, a publisher for the outbox relay,
// partitioned topics for per-key order, and a subscriber with a prefetch
// window and batched acknowledgements. The library's other packages do not
// import it, and it imports no Watermill broker adapter itself: only
// Watermill and amqp091-go.
//
// # Marshaler: messages from producers that are not Watermill
//
// The middleware deduplicates on the Watermill message UUID by default.
// watermill-amqp's DefaultMarshaler reads that UUID from the
// "_watermill_message_uuid" header only, which PHP, Python or Node producers
// do not send: their messages get an empty UUID, even when they set the
// standard AMQP message_id property. DefaultMarshaler.PreprocessDelivery runs
// after the UUID has been read, so it cannot fix that. DefaultMarshaler also
// fails the whole delivery on a header that is not a string, such as the
// x-death table RabbitMQ adds after dead-lettering, or a number or boolean
// set by another client; watermill-amqp then nacks and redelivers it forever.
//
// Marshaler takes the UUID from the header when present, else from
// message_id, and turns every header into a string. Use it as the
// watermill-amqp marshaler of the subscriber (and of the publisher, so that
// consumers that are not Watermill see message_id too):
//
//	cfg := amqp.NewDurableQueueConfig(amqpURL) // watermill-amqp/v3/pkg/amqp
//	cfg.Marshaler = rabbitmq.Marshaler{}
//	sub, err := amqp.NewSubscriber(cfg, logger)
//
// A message with neither the header nor message_id keeps an empty UUID and
// the middleware rejects it (exactlyonce.ErrInvalidKey): Marshaler never
// invents one, since a random UUID would make every redelivery look new.
//
// # DeclareQueues: queues nobody declared
//
// RabbitMQ silently drops a message published to the default exchange with a
// routing key no queue has. watermill-amqp's publisher declares exchanges,
// never queues, so an outbox relay or a PoisonQueue middleware publishing to
// a queue that no subscriber has declared yet loses its messages.
// DeclareQueues declares them up front, with the properties
// amqp.NewDurableQueueConfig uses, so that a later subscriber of the same
// queue accepts them:
//
//	if err := rabbitmq.DeclareQueues(ctx, amqpURL, "orders", "orders.poison"); err != nil {
//		return err
//	}
//
// # Publisher: many confirms in flight
//
// watermill-amqp's publisher with ConfirmDelivery waits for each message's
// publisher confirm before sending the next. Publisher keeps up to Window
// messages of a call awaiting their confirm and reports, message by message,
// which ones the broker confirmed. It implements outbox.BatchPublisher, so an
// outbox Relay configured with it sends each batch in one call:
//
//	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: amqpURL})
//	if err != nil {
//		return err
//	}
//	defer pub.Close()
//	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: pub})
//
// It publishes to the default exchange with the topic as routing key,
// declares each topic's durable queue (as DeclareQueues does) the first time
// it sees the topic on a connection, and publishes with the mandatory flag,
// so that a message no queue takes fails instead of vanishing.
//
// It is a message.Publisher too, safe for concurrent use (each call on a
// channel of its own): the same Publisher serves Watermill's poison queue,
// which then acks a delivery only once the broker confirmed its copy:
//
//	poisonQueue, err := middleware.PoisonQueueWithFilter(pub, "orders.poison", exactlyonce.IsPermanent)
//
// # Partitioned topics: per-key order
//
// The outbox relays a message with an ordering key (msgid.SetOrderingKey)
// only after the earlier messages of its key were confirmed. A partitioned
// topic carries that order to the consumer, with concurrency across keys:
// with PublisherConfig.Partitions, Publisher sends each message of the topic
// to the queue PartitionQueue(topic, Partition(key, n)), "<topic>.p<i>",
// where Partition is FNV-1a (32 bits) of the key's bytes modulo n (a message
// without a key goes by its UUID). The queues are durable, with single
// active consumer (PartitionQueueArguments): RabbitMQ delivers each to one
// subscriber at a time, in queue order; other instances stand by and take
// over when it goes. DeclarePartitions declares them up front.
//
//	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: amqpURL, Partitions: map[string]int{"orders": 8}})
//
// The consumer registers one handler with PartitionedSubscriber, which
// subscribes to every partition queue and merges them: up to n deliveries in
// flight, one per partition, under one consumer name, in every mode of the
// middleware. The subscriber must declare the queues with the same arguments
// and take one message at a time (a prefetch of 1: a nacked message goes
// back to the head of its queue, but messages already sent to the subscriber
// would be handled before it). This package's Subscriber does both for
// PartitionedSubscriber; with watermill-amqp, set them:
//
//	cfg := amqp.NewDurableQueueConfig(amqpURL)
//	cfg.Marshaler = rabbitmq.Marshaler{}
//	cfg.Queue.Arguments = rabbitmq.PartitionQueueArguments()
//	cfg.Consume.Qos.PrefetchCount = 1
//	sub, err := amqp.NewSubscriber(cfg, logger)
//	router.AddConsumerHandler("ship-order", "orders", rabbitmq.PartitionedSubscriber(sub, 8), handler)
//
// Concurrency is the number of partitions, not of instances (the first
// instance to subscribe takes every partition). Every relay and consumer of
// a topic must use the same number; changing it moves keys to other queues,
// so drain them first. A message the consumer sets aside (a poison queue, a
// parked key) lets its key's later messages go on: a gap. docs/ordering.md
// states the guarantee, its assumptions, its costs and what breaks it.
//
// # Subscriber: a prefetch window on one subscription
//
// A watermill-amqp subscription hands over one delivery at a time and acks
// each with a frame of its own; many in flight took as many subscriptions
// (exactlyonce.ConcurrentSubscriber). Subscriber hands over every delivery
// of its prefetch window at once, so the router runs up to Prefetch
// messages of a handler together, and acknowledges the oldest settled ones
// with one basic.ack with the multiple flag (nacks go alone, with requeue).
// Nothing is acknowledged before the router acked it:
//
//	sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: amqpURL, Prefetch: 256})
//	router.AddHandler("charge-order", "orders.placed", sub, "orders.charged", exactlyonce.OutboxOnly(), handler)
package rabbitmq
