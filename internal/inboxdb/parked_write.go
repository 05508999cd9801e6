package inboxdb

import (
	"encoding/json"
	"math"
	"sort"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
)

// The writing of parked messages: every statement that parks a key (Park,
// Fail with permanent, ParkInterrupted, and the claim that parks after
// MaxInterrupted) writes the message it was given into the table of parked
// messages in the same statement, from the record it parked: a key that was
// not parked (recorded done meanwhile, or no longer the attempt's) keeps
// nothing. A key parked again after a release replaces its row.

// MaxParkedMetadata bounds the metadata a parked message keeps: its JSON
// encoding, in bytes. Brokers bound headers far below it (RabbitMQ's must
// fit one frame, 128 KiB by default), so it is a guard, never expected to
// be reached: metadata over it keeps its fields in key order while they fit,
// each cut to MaxParkedMetadataField bytes (see ParkedMessage.Row).
const MaxParkedMetadata = 1 << 20

// MaxParkedMetadataField is the length, in bytes, to which each key and
// value of metadata over MaxParkedMetadata is cut.
const MaxParkedMetadataField = 256

// maxParkedUUID bounds a parked message's UUID, in bytes: the table's index
// on message_uuid refuses entries over about 2.7 kB.
const maxParkedUUID = 1024

// ParkedFields is a ParkedMessage as the stores write it.
type ParkedFields struct {
	UUID, Topic string
	// Payload is nil when the payload is not kept, and non-nil (perhaps
	// empty) when it is.
	Payload     []byte
	PayloadSize int
	// Metadata is a JSON object of strings.
	Metadata string
}

// Row returns m as the stores write it: UUID, topic and metadata made
// storable in PostgreSQL text and jsonb (valid UTF-8, no NUL: other bytes
// become U+FFFD), the UUID cut to 1 KiB, and the metadata bounded by
// MaxParkedMetadata. When any of them had to be changed, the payload is not
// kept either (PayloadSize still says how large it was): such a message is
// kept for an operator to read, never to be replayed as a message it was
// not. Both stores keep the same Row, so that they show the same message.
func (m ParkedMessage) Row() ParkedFields {
	r := ParkedFields{PayloadSize: m.PayloadSize}
	if m.Payload != nil {
		r.PayloadSize = len(m.Payload)
	}
	uuidChanged, topicChanged, metaChanged := false, false, false
	r.UUID, uuidChanged = storable(m.UUID, maxParkedUUID)
	r.Topic, topicChanged = storable(m.Topic, math.MaxInt)
	r.Metadata, metaChanged = metadataJSON(m.Metadata)
	if m.Kept() && !uuidChanged && !topicChanged && !metaChanged {
		r.Payload = m.Payload
		if r.Payload == nil {
			r.Payload = []byte{} // empty, not NULL: kept
		}
	}
	return r
}

// storable returns s as PostgreSQL text can hold it, cut to max bytes, and
// whether that changed it.
func storable(s string, max int) (string, bool) {
	if pgtext.Check(s) == nil && len(s) <= max {
		return s, false
	}
	return pgtext.Storable(s, max), true
}

// metadataJSON encodes md as a JSON object that jsonb takes, bounded by
// MaxParkedMetadata, and reports whether that changed any field.
func metadataJSON(md map[string]string) (string, bool) {
	if len(md) == 0 {
		return "{}", false
	}
	clean, changed := md, false
	for k, v := range md {
		if pgtext.Check(k) != nil || pgtext.Check(v) != nil {
			changed = true
			break
		}
	}
	if changed {
		clean = make(map[string]string, len(md))
		for k, v := range md {
			k, _ = storable(k, math.MaxInt)
			v, _ = storable(v, math.MaxInt)
			clean[k] = v
		}
	}
	b, err := json.Marshal(clean)
	if err == nil && len(b) <= MaxParkedMetadata {
		return string(b), changed
	}
	// Over the bound: the fields, in key order, cut, while they fit.
	keys := make([]string, 0, len(clean))
	for k := range clean {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	bounded := map[string]string{}
	size := len("{}")
	for _, k := range keys {
		ck, _ := storable(k, MaxParkedMetadataField)
		cv, _ := storable(clean[k], MaxParkedMetadataField)
		if _, dup := bounded[ck]; dup {
			continue
		}
		entry := jsonLen(ck) + jsonLen(cv) + 2 // "k":"v",
		if size+entry > MaxParkedMetadata {
			break
		}
		bounded[ck] = cv
		size += entry
	}
	b, _ = json.Marshal(bounded) // strings only: cannot fail
	return string(b), true
}

// jsonLen is the length of s encoded as a JSON string.
func jsonLen(s string) int {
	b, _ := json.Marshal(s)
	return len(b)
}

// args are the arguments of fragments.sql's KeepParked for r: $1..$5 of
// every statement that keeps a parked message.
func (r ParkedFields) args() []any {
	return []any{r.UUID, r.Topic, r.Payload, r.PayloadSize, r.Metadata}
}
