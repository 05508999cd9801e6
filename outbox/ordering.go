package outbox

import (
	"fmt"
	"hash/fnv"
	"slices"

	"github.com/ThreeDotsLabs/watermill/message"
)

// OrderingKeyMetadata is the metadata field that holds a message's ordering
// key. A message written to the outbox with a non-empty ordering key is
// relayed in per-key order: never before an earlier message of its key (see
// docs/ordering.md). The field travels with the message to the broker, where
// rabbitmq.Publisher routes it to its key's partition queue.
const OrderingKeyMetadata = "ordering_key"

// MaxOrderingKeyBytes is the longest ordering key the outbox accepts.
const MaxOrderingKeyBytes = 1024

// SetOrderingKey sets msg's ordering key (the metadata field
// OrderingKeyMetadata) and returns msg. The key names what must stay in
// order, usually the aggregate the message is about: an order id, an
// account id. For a key that is already a metadata field of your messages:
//
//	outbox.SetOrderingKey(msg, msg.Metadata.Get("aggregate_id"))
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

// checkOrderingKeys refuses a key the outbox would not keep as written.
func checkOrderingKeys(messages []*message.Message) error {
	for _, msg := range messages {
		if k := OrderingKey(msg); len(k) > MaxOrderingKeyBytes {
			return fmt.Errorf("message %q: its ordering key is %d bytes, the most is %d", msg.UUID, len(k), MaxOrderingKeyBytes)
		}
	}
	return nil
}

// lockHashes returns the sorted, distinct lock values of the ordering
// keys of messages; nil when none has a key.
//
// Writers of one key are serialized by a transaction-level advisory lock
// of this outbox table and the key, which each INSERT of a keyed message
// takes before it draws the rows' ids (schemaAdapter.insertQuery), all of
// its keys in this fixed order (so that two writers of the same keys
// cannot deadlock on them). The transaction keeps the locks until it
// commits or rolls back, so a later writer of the key waits and draws
// larger ids: the ids of one key follow the order in which its
// transactions committed, which is the order the relay keeps. The lock is
// the pair (table class, key hash) of 32-bit values; two keys with the
// same hash only make their writers wait for each other.
func lockHashes(messages []*message.Message) []int32 {
	var hashes []int32
	for _, msg := range messages {
		if k := OrderingKey(msg); k != "" {
			hashes = append(hashes, hash32(k))
		}
	}
	if len(hashes) == 0 {
		return nil
	}
	slices.Sort(hashes)
	return slices.Compact(hashes)
}

// lockClass is the first value of the advisory locks of table's keys.
func lockClass(table string) int32 { return hash32("exactlyonce.outbox:" + table) }

// hash32 is FNV-1a of s as an int32.
func hash32(s string) int32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return int32(h.Sum32()) //nolint:gosec // a hash: the bits are what matter
}

// orderingKeyArg is the column value of msg's ordering key: NULL when none.
func orderingKeyArg(msg *message.Message) any {
	if k := OrderingKey(msg); k != "" {
		return k
	}
	return nil
}
