package outboxwrite

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
)

// MaxOrderingKeyBytes is the longest ordering key the outbox accepts.
const MaxOrderingKeyBytes = 1024

// insertRows are the rows of one INSERT of messages into the table for
// topic (outboxdb's Insert: a fixed statement whatever the number of
// messages, their values in arrays). With lock (the sorted hashes of
// ordering keys, see lockHashes), the statement first takes the
// transaction-level advisory lock (lockClass, hash) of each, in that
// order, and only then draws the rows' ids, in the order of messages. One
// statement, so that a Publish outside a transaction (its own autocommit
// transaction) holds the locks until its rows are committed, like one
// inside. On MySQL lock holds the key-lock buckets (lockBuckets), taken by
// a statement before the INSERT, and Publish runs both in a transaction.
func insertRows(lockClass int32, topic string, messages []*message.Message, lock []int32) (outboxdb.Insert, error) {
	if len(messages) == 0 {
		return outboxdb.Insert{}, errors.New("outbox: no messages to insert")
	}
	in := outboxdb.Insert{
		Topic:        topic,
		UUIDs:        make([]string, len(messages)),
		Payloads:     make([][]byte, len(messages)),
		Metadata:     make([]string, len(messages)),
		OrderingKeys: make([]string, len(messages)),
		LockClass:    lockClass,
		Locks:        lock,
	}
	for i, msg := range messages {
		if msg == nil {
			return outboxdb.Insert{}, fmt.Errorf("outbox: message %d is nil", i)
		}
		if msg.UUID == "" {
			return outboxdb.Insert{}, fmt.Errorf("outbox: message %d has an empty UUID", i)
		}
		meta, err := json.Marshal(msg.Metadata)
		if err != nil {
			return outboxdb.Insert{}, fmt.Errorf("outbox: marshaling metadata of message %s: %w", msg.UUID, err)
		}
		if msg.Metadata == nil {
			meta = []byte("{}")
		}
		payload := []byte(msg.Payload)
		if payload == nil {
			payload = []byte{}
		}
		in.UUIDs[i], in.Payloads[i], in.Metadata[i] = msg.UUID, payload, string(meta)
		in.OrderingKeys[i] = msg.Metadata.Get(msgid.OrderingKeyMetadata)
	}
	return in, nil
}

// checkOrderingKeys refuses a key the outbox would not keep as written.
func checkOrderingKeys(messages []*message.Message) error {
	for _, msg := range messages {
		if k := msg.Metadata.Get(msgid.OrderingKeyMetadata); len(k) > MaxOrderingKeyBytes {
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
// takes before it draws the rows' ids (insertRows), all of its keys in
// this fixed order (so that two writers of the same keys cannot deadlock
// on them). The transaction keeps the locks until it commits or rolls
// back, so a later writer of the key waits and draws larger ids: the ids
// of one key follow the order in which its transactions committed, which
// is the order the relay keeps. The lock is the pair (table class, key
// hash) of 32-bit values; two keys with the same hash only make their
// writers wait for each other.
func lockHashes(messages []*message.Message) []int32 {
	var hashes []int32
	for _, msg := range messages {
		if k := msg.Metadata.Get(msgid.OrderingKeyMetadata); k != "" {
			hashes = append(hashes, hash32(k))
		}
	}
	if len(hashes) == 0 {
		return nil
	}
	slices.Sort(hashes)
	return slices.Compact(hashes)
}

// lockBuckets returns the MySQL key-lock buckets of the lock hashes of
// lockHashes, sorted and distinct: the rows of the outbox's table of key
// locks (<outbox>_key_locks) that a writer upserts, in this order, before
// it inserts its messages (outboxdb's LockKeys), as PostgreSQL's writer
// takes the advisory locks (class, hash). A bucket is the hash folded to
// 16 bits (0 to 65535), which bounds the table to 65,536 small rows; two
// keys of one bucket only make their writers wait for each other.
func lockBuckets(hashes []int32) []int32 {
	if len(hashes) == 0 {
		return nil
	}
	out := make([]int32, len(hashes))
	for i, h := range hashes {
		out[i] = bucket(h)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// bucket folds a key's lock hash to 16 bits (the high half xored into the
// low one, so that every bit of the hash counts).
func bucket(h int32) int32 {
	u := uint32(h)
	return int32((u ^ u>>16) & 0xffff) //nolint:gosec // 16 bits: always fits
}

// LockClass is the first value of the advisory locks of the ordering keys
// of table (quoted, schema-qualified).
func LockClass(table string) int32 { return hash32("exactlyonce.outbox:" + table) }

// hash32 is FNV-1a of s as an int32.
func hash32(s string) int32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return int32(h.Sum32()) //nolint:gosec // a hash: the bits are what matter
}
