// Package rabbitmq holds helpers for running the exactly-once middleware on
// RabbitMQ with watermill-amqp v3, and a publisher for the outbox relay. The
// library's other packages do not import it, and it imports no Watermill
// broker adapter itself: only Watermill and amqp091-go.
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
package rabbitmq
