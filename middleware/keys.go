package middleware

import (
	"crypto/sha256"
	"encoding/hex"

	"github.com/ThreeDotsLabs/watermill/message"
)

// KeyFunc returns the key that identifies a message for deduplication. Two
// deliveries with the same key (for the same consumer) are the same message.
// Returning "" is an error (ErrEmptyKey), never a shared key.
type KeyFunc func(msg *message.Message) (string, error)

// KeyFromUUID keys on the Watermill message UUID. It is the default. A
// message from a producer that is not Watermill has an empty UUID unless the
// subscriber's unmarshaler fills it (for AMQP: from the message_id property).
func KeyFromUUID() KeyFunc {
	return func(msg *message.Message) (string, error) { return msg.UUID, nil }
}

// KeyFromMetadata keys on a metadata field, such as an idempotency key the
// producer sets ("Idempotency-Key" in HTTP terms).
func KeyFromMetadata(field string) KeyFunc {
	return func(msg *message.Message) (string, error) { return msg.Metadata.Get(field), nil }
}

// KeyFromPayloadSHA256 keys on the hex SHA-256 of the payload: byte-equal
// payloads are duplicates, whatever their UUID. It suits webhooks, whose
// retries carry the same body. Unlike a short checksum it does not make
// distinct messages collide.
func KeyFromPayloadSHA256() KeyFunc {
	return func(msg *message.Message) (string, error) {
		sum := sha256.Sum256(msg.Payload)
		return hex.EncodeToString(sum[:]), nil
	}
}
