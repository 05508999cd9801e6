package outboxwrite

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/msgid"
)

// MaxOrderingKeyBytes is the longest ordering key the outbox accepts.
const MaxOrderingKeyBytes = 1024

// insertQuery is the INSERT of messages into table for topic. With lock
// (the sorted hashes of ordering keys, see lockHashes), the statement first
// takes the transaction-level advisory lock (lockClass, hash) of each, in
// that order, and only then draws the rows' ids: the locks are a one-time
// filter of the plan (an InitPlan), evaluated before the first row, and
// the id default is computed with each row after it. One statement, so
// that a Publish outside a transaction (its own autocommit transaction)
// holds the locks until its rows are committed, like one inside.
func insertQuery(table string, lockClass int32, topic string, messages []*message.Message, lock []int32) (string, []any, error) {
	if len(messages) == 0 {
		return "", nil, errors.New("outbox: no messages to insert")
	}
	var b strings.Builder
	b.WriteString("INSERT INTO " + table + " (topic, uuid, payload, metadata, ordering_key) ")
	if len(lock) > 0 {
		b.WriteString("SELECT * FROM (")
	}
	b.WriteString("VALUES ")
	args := make([]any, 0, 5*len(messages))
	for i, msg := range messages {
		if msg == nil {
			return "", nil, fmt.Errorf("outbox: message %d is nil", i)
		}
		if msg.UUID == "" {
			return "", nil, fmt.Errorf("outbox: message %d has an empty UUID; the next consumer's inbox needs it", i)
		}
		meta, err := json.Marshal(msg.Metadata)
		if err != nil {
			return "", nil, fmt.Errorf("outbox: marshaling metadata of message %s: %w", msg.UUID, err)
		}
		if msg.Metadata == nil {
			meta = []byte("{}")
		}
		if i > 0 {
			b.WriteByte(',')
		}
		n := 5 * i
		b.WriteString("($" + strconv.Itoa(n+1) + "::text,$" + strconv.Itoa(n+2) + "::text,$" + strconv.Itoa(n+3) + "::bytea,$" + strconv.Itoa(n+4) + "::jsonb,$" + strconv.Itoa(n+5) + "::text)")
		payload := []byte(msg.Payload)
		if payload == nil {
			payload = []byte{}
		}
		args = append(args, topic, msg.UUID, payload, string(meta), orderingKeyArg(msg))
	}
	if len(lock) > 0 {
		n := len(args)
		b.WriteString(") AS v WHERE (SELECT count(pg_advisory_xact_lock($" + strconv.Itoa(n+1) + "::int4, k)) FROM unnest($" + strconv.Itoa(n+2) + "::int4[]) AS k) >= 0")
		args = append(args, lockClass, lock)
	}
	return b.String(), args, nil
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
// takes before it draws the rows' ids (insertQuery), all of its keys in
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

// LockClass is the first value of the advisory locks of the ordering keys
// of table (quoted, schema-qualified).
func LockClass(table string) int32 { return hash32("exactlyonce.outbox:" + table) }

// hash32 is FNV-1a of s as an int32.
func hash32(s string) int32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return int32(h.Sum32()) //nolint:gosec // a hash: the bits are what matter
}

// orderingKeyArg is the column value of msg's ordering key: NULL when none.
func orderingKeyArg(msg *message.Message) any {
	if k := msg.Metadata.Get(msgid.OrderingKeyMetadata); k != "" {
		return k
	}
	return nil
}
