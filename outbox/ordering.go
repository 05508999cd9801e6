package outbox

import (
	"context"
	"fmt"
	"hash/fnv"
	"slices"

	"github.com/ThreeDotsLabs/watermill/message"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
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

// lockOrderingKeys takes, for each distinct ordering key of messages, a
// transaction-level advisory lock of this outbox table and that key, in one
// statement and in a fixed order (so that two writers of the same keys
// cannot deadlock on them). It runs before the INSERT: the rows' ids are
// drawn while the transaction holds its keys' locks, which it keeps until
// it commits or rolls back, so a later writer of the key waits and draws
// larger ids. The ids of one key therefore follow the order in which its
// transactions committed, which is the order the relay keeps.
//
// The lock is the pair (table class, key hash) of 32-bit values; two keys
// with the same hash only make their writers wait for each other.
func lockOrderingKeys(ctx context.Context, db wsql.ContextExecutor, table string, messages []*message.Message) error {
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
	hashes = slices.Compact(hashes)
	class := hash32("exactlyonce.outbox:" + table)
	var err error
	if len(hashes) == 1 {
		_, err = db.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1::int4, $2::int4)`, class, hashes[0])
	} else {
		// unnest yields the array's order; the plain scan calls the
		// function row by row in that order.
		_, err = db.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1::int4, k) FROM unnest($2::int4[]) AS k`, class, hashes)
	}
	if err != nil {
		return fmt.Errorf("locking %d ordering key(s): %w", len(hashes), err)
	}
	return nil
}

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
