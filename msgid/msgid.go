// Package msgid makes message UUIDs for producers.
//
// The inbox deduplicates by message UUID (the middleware's default key). A
// producer that retries a publish — an HTTP handler retried by its client, a
// cron job re-run after a crash, an outbox write repeated by a transaction
// that was retried — must publish the same UUID again, or the consumer sees
// a new message and acts twice. Named derives that UUID from what the
// message is about (UUIDv5, RFC 9562), so every retry computes the same one:
//
//	id, err := msgid.Named("reminders", "reminder:"+appointmentID+":24h")
//	msg := message.NewMessage(id, payload)
//
// The flip side: a message that is meant to happen again — the same reminder
// sent a second time on purpose, a manual resend — needs a new name (add
// what makes it new: a resend counter, the operator's request id, the
// schedule slot), or the inbox drops it as a duplicate.
//
// New makes a fresh, time-ordered UUID (UUIDv7) for messages that have no
// natural name: generate it once, store it with the intent (in the same
// transaction as the business write, or in the outbox row), and reuse it on
// every retry; never call New again in the retry path.
//
// The package also holds what the library reads from a message besides its
// UUID and payload, with no dependency but Watermill (so that a broker
// adapter or a producer needs neither the outbox nor its database driver):
// the ordering key (SetOrderingKey, OrderingKey, the metadata field
// OrderingKeyMetadata), which keeps a key's messages in order through the
// outbox and picks a partition queue in RabbitMQ, and TopicMessage, a message
// with its topic, the entry of a batch publish (outbox.BatchPublisher).
package msgid

import (
	"errors"
	"fmt"

	"github.com/google/uuid"
)

// Named returns the UUIDv5 of name in namespace, as a string: the same for
// the same inputs, in any process and any language that implements RFC 9562.
//
// namespace is either a UUID (the namespace itself, e.g. one your
// organisation already uses, or uuid.NameSpaceOID's text) or a short name
// for it, such as "reminders" or "orders.v1": a name stands for the
// namespace UUIDv5(NameSpaceURL, "urn:exactlyonce:"+namespace). Different
// namespaces keep equal names apart. name is what identifies the logical
// message within it; build it unambiguously (separate the parts by a
// character none of them contains). Empty values are an error.
func Named(namespace, name string) (string, error) {
	if namespace == "" {
		return "", errors.New("msgid: Named: empty namespace")
	}
	if name == "" {
		return "", errors.New("msgid: Named: empty name (the UUID would be the same for every message of the namespace)")
	}
	return uuid.NewSHA1(Namespace(namespace), []byte(name)).String(), nil
}

// Namespace returns the namespace UUID Named uses for namespace: the UUID
// itself if it parses as one, else UUIDv5(NameSpaceURL,
// "urn:exactlyonce:"+namespace). It lets another system reproduce the IDs.
// Parsing accepts the forms github.com/google/uuid does: the canonical
// 8-4-4-4-12 form, and also "urn:uuid:"-prefixed, braced and 32 hex digits
// without dashes — so a name of 32 hex digits is taken as a UUID. Another
// language reproducing the IDs should pass the canonical form.
func Namespace(namespace string) uuid.UUID {
	if u, err := uuid.Parse(namespace); err == nil {
		return u
	}
	return uuid.NewSHA1(uuid.NameSpaceURL, []byte("urn:exactlyonce:"+namespace))
}

// New returns a new time-ordered UUID (UUIDv7): IDs made later sort after
// earlier ones (within a process, strictly), which keeps B-tree indexes on
// them compact. It fails only if the system's random source does.
func New() (string, error) {
	u, err := uuid.NewV7()
	if err != nil {
		return "", fmt.Errorf("msgid: New: %w", err)
	}
	return u.String(), nil
}
