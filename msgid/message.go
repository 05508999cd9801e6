package msgid

import "github.com/ThreeDotsLabs/watermill/message"

// OrderingKeyMetadata is the metadata field that holds a message's ordering
// key. A message written to the outbox with a non-empty ordering key is
// relayed in per-key order: never before an earlier message of its key (see
// docs/ordering.md; the outbox accepts keys of at most
// outbox.MaxOrderingKeyBytes). The field travels with the message to the
// broker, where rabbitmq.Publisher routes it to its key's partition queue.
const OrderingKeyMetadata = "ordering_key"

// SetOrderingKey sets msg's ordering key (the metadata field
// OrderingKeyMetadata) and returns msg. The key names what must stay in
// order, usually the aggregate the message is about: an order id, an
// account id. For a key that is already a metadata field of your messages:
//
//	msgid.SetOrderingKey(msg, msg.Metadata.Get("aggregate_id"))
//
// An empty key removes it: the message is relayed without order, as
// messages without a key are.
func SetOrderingKey(msg *message.Message, key string) *message.Message {
	if key == "" {
		delete(msg.Metadata, OrderingKeyMetadata)
		return msg
	}
	if msg.Metadata == nil {
		msg.Metadata = message.Metadata{}
	}
	msg.Metadata.Set(OrderingKeyMetadata, key)
	return msg
}

// OrderingKey returns msg's ordering key, "" when it has none.
func OrderingKey(msg *message.Message) string {
	return msg.Metadata.Get(OrderingKeyMetadata)
}

// TopicMessage is a message and the topic it is published to: one entry of
// an outbox.BatchPublisher's PublishBatch call (rabbitmq.Publisher
// implements it). It lives here, with no dependency but Watermill, so that a
// publisher implements the interface without importing the outbox (and its
// database driver).
type TopicMessage struct {
	Topic   string
	Message *message.Message
}
