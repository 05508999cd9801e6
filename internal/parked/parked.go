// Package parked holds what the operator views of parked messages share,
// in PostgreSQL (package inbox) and Redis (package redisstore): the checks
// of a filter and of a page's size, the match of a message against a
// filter (the Redis store filters in Go), and the page cursor.
//
// Errors name the public field (ParkedFilter.Tenant, Page.Limit, ...) and
// wrap ErrInvalid; they carry no package prefix.
package parked

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/internal/tenant"
)

// ErrInvalid is wrapped by every error about a filter, a page, a cursor or
// the consumer and key of a parked message: the request is wrong, not the
// store.
var ErrInvalid = errors.New("invalid request for parked messages")

// ErrTooBroad is wrapped by the refusal of a find or count bounded by
// Filter.MaxScan or Filter.MaxCount that would read more than they allow.
var ErrTooBroad = errors.New("the filter selects too many parked messages for the bound of this read")

// Page sizes and batch sizes.
const (
	// DefaultLimit is a page's size when none is given.
	DefaultLimit = 100
	// MaxLimit is the largest page.
	MaxLimit = 1000
	// DefaultBatch is the number of parked messages one transaction (or
	// one step) of a bulk replay or discard handles.
	DefaultBatch = 100
	// MaxBatch is the largest batch.
	MaxBatch = 1000
)

// maxConsumerLength is inboxdb.MaxConsumerLength (not imported: inboxdb
// imports this package).
const maxConsumerLength = 255

// Filter selects parked messages: a message matches when it matches every
// field that is set.
type Filter struct {
	Consumer    string
	Key         string
	MessageUUID string
	Tenant      string
	Reason      string
	Since       time.Time
	Before      time.Time
	Metadata    map[string]string

	// MaxScan, when positive, bounds a find or count of a filter that
	// Scans: refused (ErrTooBroad) when the conditions an index serves
	// select more than MaxScan messages to check the others on.
	MaxScan int
	// MaxCount, when positive, bounds a count: refused (ErrTooBroad) when
	// more than MaxCount messages match.
	MaxCount int
}

// Scans reports whether f has a condition that the PostgreSQL store's
// indexes do not serve, which it checks on each message the other
// conditions select (or on every message): the reason's text, and a
// tenant or a key without the consumer (the indexes hold the key after
// the consumer). The Redis store checks every condition but the consumer
// on each of the consumer's parked keys.
func (f Filter) Scans() bool {
	return f.Reason != "" || f.Consumer == "" && (f.Tenant != "" || f.Key != "")
}

// Indexed is f with only the conditions an index serves: those that
// select the messages a filter that Scans checks the others on.
func (f Filter) Indexed() Filter {
	f.Reason = ""
	if f.Consumer == "" {
		f.Tenant, f.Key = "", ""
	}
	return f
}

// TooBroad is the refusal of a find or count of f whose indexed conditions
// select more than f.MaxScan messages (checked, at least, on more than that).
func (f Filter) TooBroad() error {
	var what []string
	if f.Reason != "" {
		what = append(what, "the reason's text")
	}
	if f.Consumer == "" && f.Tenant != "" {
		what = append(what, "a tenant without the consumer")
	}
	if f.Consumer == "" && f.Key != "" {
		what = append(what, "a key without the consumer")
	}
	return fmt.Errorf("%w: %s, which no index serves, would be checked on more than %d parked messages (MaxScan)",
		ErrTooBroad, strings.Join(what, " and "), f.MaxScan)
}

// CountTooBroad is the refusal of a count of more than f.MaxCount
// messages.
func (f Filter) CountTooBroad() error {
	return fmt.Errorf("%w: more than %d parked messages match (MaxCount)",
		ErrTooBroad, f.MaxCount)
}

// Empty reports whether f selects every parked message.
func (f Filter) Empty() bool {
	return f.Consumer == "" && f.Key == "" && f.MessageUUID == "" && f.Tenant == "" && f.Reason == "" &&
		f.Since.IsZero() && f.Before.IsZero() && len(f.Metadata) == 0
}

// Validate reports the first field of f that cannot match anything stored,
// wrapped in ErrInvalid: text that is not valid UTF-8 or holds a NUL
// byte, a consumer name over 255 bytes, a tenant that is not one (see
// exactlyonce.KeyByTenant), an empty metadata name, or Before not after
// Since. An unknown consumer is valid: it matches nothing.
func (f Filter) Validate() error {
	for _, c := range []struct{ field, v string }{
		{"Consumer", f.Consumer}, {"Key", f.Key}, {"MessageUUID", f.MessageUUID}, {"Reason", f.Reason},
	} {
		if err := pgtext.Check(c.v); err != nil {
			return invalid("ParkedFilter.%s: %w", c.field, err)
		}
	}
	if len(f.Consumer) > maxConsumerLength {
		return invalid("ParkedFilter.Consumer is %d bytes, a consumer name has at most %d", len(f.Consumer), maxConsumerLength)
	}
	if f.Tenant != "" {
		if err := tenant.Check(f.Tenant); err != nil {
			return invalid("ParkedFilter.Tenant: %w", err)
		}
	}
	if !f.Since.IsZero() && !f.Before.IsZero() && !f.Before.After(f.Since) {
		return invalid("ParkedFilter.Before (%s) must be after ParkedFilter.Since (%s)", f.Before.Format(time.RFC3339Nano), f.Since.Format(time.RFC3339Nano))
	}
	if f.MaxScan < 0 || f.MaxCount < 0 {
		return invalid("ParkedFilter.MaxScan (%d) and MaxCount (%d) are bounds: 0 (none) or positive", f.MaxScan, f.MaxCount)
	}
	for k, v := range f.Metadata {
		if k == "" {
			return invalid("ParkedFilter.Metadata has an empty name")
		}
		if err := pgtext.Check(k); err != nil {
			return invalid("ParkedFilter.Metadata name %q: %w", k, err)
		}
		if err := pgtext.Check(v); err != nil {
			return invalid("ParkedFilter.Metadata[%q]: %w", k, err)
		}
	}
	return nil
}

// MetadataJSON is f.Metadata as the JSON object that `metadata @> $1`
// looks for; "" when f has no metadata.
func (f Filter) MetadataJSON() (string, error) {
	if len(f.Metadata) == 0 {
		return "", nil
	}
	b, err := json.Marshal(f.Metadata)
	if err != nil {
		return "", invalid("ParkedFilter.Metadata: %w", err)
	}
	return string(b), nil
}

// Message is what Match looks at.
type Message struct {
	Consumer, Key, UUID, Reason string
	ParkedAt                    time.Time
	Metadata                    map[string]string
}

// Match reports whether m matches f, as the PostgreSQL store's query
// does: equal consumer, key and UUID, the key within the tenant, the
// reason containing f.Reason whatever the case, parked at or after Since
// and before Before, and every metadata field of f present with the same
// value.
func (f Filter) Match(m Message) bool {
	switch {
	case f.Consumer != "" && m.Consumer != f.Consumer,
		f.Key != "" && m.Key != f.Key,
		f.MessageUUID != "" && m.UUID != f.MessageUUID,
		f.Tenant != "" && !strings.HasPrefix(m.Key, tenant.Prefix(f.Tenant)),
		f.Reason != "" && !strings.Contains(strings.ToLower(m.Reason), strings.ToLower(f.Reason)),
		!f.Since.IsZero() && m.ParkedAt.Before(f.Since),
		!f.Before.IsZero() && !m.ParkedAt.Before(f.Before):
		return false
	}
	for k, v := range f.Metadata {
		if have, ok := m.Metadata[k]; !ok || have != v {
			return false
		}
	}
	return true
}

// Limit is a page's size: DefaultLimit for 0, an error for a negative
// one or one over MaxLimit.
func Limit(n int) (int, error) {
	switch {
	case n == 0:
		return DefaultLimit, nil
	case n < 0 || n > MaxLimit:
		return 0, invalid("Page.Limit is %d, it must be between 1 and %d (0: %d)", n, MaxLimit, DefaultLimit)
	}
	return n, nil
}

// Batch is a bulk operation's batch size: DefaultBatch for 0, an error
// for a negative one or one over MaxBatch. field names the option.
func Batch(field string, n int) (int, error) {
	switch {
	case n == 0:
		return DefaultBatch, nil
	case n < 0 || n > MaxBatch:
		return 0, invalid("%s is %d, it must be between 1 and %d (0: %d)", field, n, MaxBatch, DefaultBatch)
	}
	return n, nil
}

// CheckKey reports whether consumer and key name a parked message.
func CheckKey(consumer, key string) error {
	switch {
	case consumer == "":
		return invalid("empty consumer name")
	case key == "":
		return invalid("empty key")
	}
	if err := pgtext.Check(consumer); err != nil {
		return invalid("consumer name: %w", err)
	}
	if err := pgtext.Check(key); err != nil {
		return invalid("key: %w", err)
	}
	return nil
}

// Cursor is where a page ended: the sort key (parked time, consumer, key)
// of its last message. The next page starts after it.
type Cursor struct {
	ParkedAt time.Time
	Consumer string
	Key      string
}

type cursorJSON struct {
	T int64  `json:"t"` // Unix microseconds: PostgreSQL's precision
	C string `json:"c"`
	K string `json:"k"`
}

// Encode returns the cursor as an opaque string safe in a URL.
func (c Cursor) Encode() string {
	b, _ := json.Marshal(cursorJSON{T: c.ParkedAt.UnixMicro(), C: c.Consumer, K: c.Key}) // cannot fail
	return base64.RawURLEncoding.EncodeToString(b)
}

// The range of a cursor's time: years 1 to 9999, within every store's
// (PostgreSQL's timestamptz refuses times far outside it).
var (
	minCursorMicro = time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()
	maxCursorMicro = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro() - 1
)

// Decode parses what Encode returned. "" is no cursor (nil). A cursor no
// page could have returned is invalid: a time outside years 1 to 9999, a
// consumer or key that is not valid UTF-8 or holds a NUL byte (no store
// holds such text, and PostgreSQL refuses it in a query).
func Decode(s string) (*Cursor, error) {
	if s == "" {
		return nil, nil
	}
	b, err := base64.RawURLEncoding.DecodeString(s)
	var j cursorJSON
	if err == nil {
		err = json.Unmarshal(b, &j)
	}
	if err == nil && (j.K == "" || j.T < minCursorMicro || j.T > maxCursorMicro) {
		err = errors.New("out of range")
	}
	if err == nil {
		err = pgtext.Check(j.C)
	}
	if err == nil {
		err = pgtext.Check(j.K)
	}
	if err != nil || !utf8.Valid(b) {
		return nil, invalid("Page.After %q is not a cursor a page returned (ParkedPage.Next)", s)
	}
	return &Cursor{ParkedAt: time.UnixMicro(j.T).UTC(), Consumer: j.C, Key: j.K}, nil
}

// Precedes reports whether c sorts before (at, consumer, key): the position
// of a message on a later page.
func (c Cursor) Precedes(at time.Time, consumer, key string) bool {
	at = at.Truncate(time.Microsecond)
	switch {
	case !at.Equal(c.ParkedAt):
		return at.After(c.ParkedAt)
	case consumer != c.Consumer:
		return consumer > c.Consumer
	}
	return key > c.Key
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...)
}
