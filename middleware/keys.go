package exactlyonce

import (
	"crypto/sha256"
	"encoding/hex"

	"github.com/ThreeDotsLabs/watermill/message"
)

// keyFromUUID keys on the Watermill message UUID: the default Config.Key. A
// message from a producer that is not Watermill has an empty UUID unless
// the subscriber's unmarshaler fills it (for RabbitMQ: rabbitmq.Marshaler
// takes the message_id property).
func keyFromUUID(msg *message.Message) (string, error) { return msg.UUID, nil }

// KeyFromMetadata keys on a metadata field, such as an idempotency key the
// producer sets ("Idempotency-Key" in HTTP terms). Use it as Config.Key.
func KeyFromMetadata(field string) func(msg *message.Message) (string, error) {
	return func(msg *message.Message) (string, error) { return msg.Metadata.Get(field), nil }
}

// KeyFromPayloadSHA256 keys on the hex SHA-256 of the payload: byte-equal
// payloads are duplicates, whatever their UUID. It suits webhooks, whose
// retries carry the same body. Unlike a short checksum it does not make
// distinct messages collide. Use it as Config.Key.
func KeyFromPayloadSHA256(msg *message.Message) (string, error) {
	sum := sha256.Sum256(msg.Payload)
	return hex.EncodeToString(sum[:]), nil
}
