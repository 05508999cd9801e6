package parked

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ErrChanged is wrapped by the error of an operator action whose Expect no
// longer holds: the key, its record or its parked message is not what the
// operator was shown. Nothing was done.
var ErrChanged = errors.New("changed since it was shown")

// Expect is inbox.Expect: what an operator was shown of a key before an
// action on it. A field left empty is not checked.
type Expect struct {
	Version     string
	MessageUUID string
	Status      string
}

// Empty reports whether e checks nothing.
func (e Expect) Empty() bool { return e == Expect{} }

// Validate checks that e can be compared (text a store can hold).
func (e Expect) Validate() error {
	for _, c := range []struct{ field, v string }{{"Version", e.Version}, {"MessageUUID", e.MessageUUID}, {"Status", e.Status}} {
		if strings.ContainsRune(c.v, 0) || len(c.v) > 255 {
			return invalid("Expect.%s is not a value a store shows (a NUL byte, or over 255 bytes)", c.field)
		}
	}
	return nil
}

// The kinds of version: a version starts with its kind, so that one given
// for another kind of target (a message's for a record) is refused as
// such, not taken for a change.
const (
	kindMessage = "msg-"
	kindRecord  = "rec-"
	kindRow     = "row-"
)

// ValidateMessage is Validate for an action on a parked message (replay,
// discard): a version must be a message's.
func (e Expect) ValidateMessage() error {
	if err := e.Validate(); err != nil {
		return err
	}
	return checkKind(e.Version, kindMessage, "a parked message", "parked show (GET .../parked/{consumer}/{key})")
}

// ValidateRecord is Validate for an action on a key's record (forget,
// release): a version must be a record's.
func (e Expect) ValidateRecord() error {
	if err := e.Validate(); err != nil {
		return err
	}
	return checkKind(e.Version, kindRecord, "a key's record", "inbox show (GET .../consumers/{consumer}/keys/{key})")
}

// version hashes the parts of a state into a short opaque string after
// kind: equal states have equal versions, and a version tells nothing else.
func version(kind string, parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(strconv.Itoa(len(p))))
		h.Write([]byte{':'})
		h.Write([]byte(p))
	}
	return kind + hex.EncodeToString(h.Sum(nil)[:8])
}

// checkKind refuses a version of another kind than want, saying where the
// right one is shown.
func checkKind(v, want, of, shownBy string) error {
	if v == "" || strings.HasPrefix(v, want) {
		return nil
	}
	return invalid("Expect.Version %q is not the version of %s: give the version %s shows", v, of, shownBy)
}

func micros(t time.Time) string { return strconv.FormatInt(t.UnixMicro(), 10) }

// MessageVersion is the version of a parked message (ParkedMessage.Version):
// the message and the park that kept it (its time and the key's attempt
// then: two parks of one message within one tick of the store's clock are
// still two). It changes when the key's parked message is replaced (the
// key parked again, with this message or another).
func MessageVersion(uuid string, parkedAt time.Time, attempts int) string {
	return version(kindMessage, uuid, micros(parkedAt), strconv.Itoa(attempts))
}

// RecordVersion is the version of an inbox record (Record.Version): it
// changes whenever the record is created, attempted, finished (done,
// failed, parked, discarded) or released; not when a duplicate is counted
// or a lease extended.
func RecordVersion(status string, attempts int, firstSeenAt time.Time, processedAt *time.Time) string {
	processed := ""
	if processedAt != nil {
		processed = micros(*processedAt)
	}
	return version(kindRecord, status, strconv.Itoa(attempts), micros(firstSeenAt), processed)
}

// RowVersion is the version of an outbox row (outbox.Row.Version): its
// failure record. It changes whenever the relay records a failure, the
// row is quarantined, or an operator requeues it.
func RowVersion(id int64, quarantinedAt *time.Time, failures, permanentFailures int) string {
	quarantined := ""
	if quarantinedAt != nil {
		quarantined = micros(*quarantinedAt)
	}
	return version(kindRow, strconv.FormatInt(id, 10), quarantined, strconv.Itoa(failures), strconv.Itoa(permanentFailures))
}

// CheckRowVersion refuses a version that is not an outbox row's.
func CheckRowVersion(v string) error {
	return checkKind(v, kindRow, "an outbox row", "outbox show (GET .../outbox/rows/{id})")
}

// MessageNow is a key's parked message as an action found it, under its lock:
// what an Expect of a replay or a discard is compared with.
type MessageNow struct {
	UUID     string
	ParkedAt time.Time
	// Attempts is the key's attempts when it was parked.
	Attempts int
	// Status is the status of the key's record ("" when none).
	Status string
}

// CheckMessage returns nil when e holds for m, the key's parked message
// now; else an error wrapping ErrChanged that says what it is now.
func (e Expect) CheckMessage(consumer, key string, m MessageNow) error {
	if err := checkKind(e.Version, kindMessage, "a parked message", "parked show (GET .../parked/{consumer}/{key})"); err != nil {
		return err
	}
	var diffs []string
	if e.Version != "" && e.Version != MessageVersion(m.UUID, m.ParkedAt, m.Attempts) {
		diffs = append(diffs, "the key's parked message was replaced (shown: version "+e.Version+")")
	}
	if e.MessageUUID != "" && e.MessageUUID != m.UUID {
		diffs = append(diffs, "it is not message "+e.MessageUUID)
	}
	if e.Status != "" && e.Status != m.Status {
		diffs = append(diffs, "the key's status is not "+strconv.Quote(e.Status))
	}
	if len(diffs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: the parked message of key %q for %q is now message %s, parked at %s, the key's status %s: %s",
		ErrChanged, key, consumer, m.UUID, m.ParkedAt.UTC().Format(time.RFC3339Nano), statusText(m.Status), strings.Join(diffs, "; "))
}

// RecordNow is a key's inbox record as an action found it, under its lock:
// what an Expect of a forget or a release is compared with.
type RecordNow struct {
	Status      string
	Attempts    int
	FirstSeenAt time.Time
	ProcessedAt *time.Time
	// MessageUUID is the UUID of the key's parked message; "" when it has
	// none.
	MessageUUID string
}

// CheckRecord returns nil when e holds for r, the key's record now; else
// an error wrapping ErrChanged that says what it is now.
func (e Expect) CheckRecord(consumer, key string, r RecordNow) error {
	if err := checkKind(e.Version, kindRecord, "a key's record", "inbox show (GET .../consumers/{consumer}/keys/{key})"); err != nil {
		return err
	}
	var diffs []string
	if e.Version != "" && e.Version != RecordVersion(r.Status, r.Attempts, r.FirstSeenAt, r.ProcessedAt) {
		diffs = append(diffs, "the record changed (shown: version "+e.Version+")")
	}
	if e.Status != "" && e.Status != r.Status {
		diffs = append(diffs, "its status is not "+strconv.Quote(e.Status))
	}
	if e.MessageUUID != "" && e.MessageUUID != r.MessageUUID {
		diffs = append(diffs, "its parked message is not message "+e.MessageUUID)
	}
	if len(diffs) == 0 {
		return nil
	}
	msg := "no parked message"
	if r.MessageUUID != "" {
		msg = "parked message " + r.MessageUUID
	}
	processed := "never finished"
	if r.ProcessedAt != nil {
		processed = "last finished at " + r.ProcessedAt.UTC().Format(time.RFC3339Nano)
	}
	return fmt.Errorf("%w: the record of key %q for %q is now %s, attempt %d, %s, %s: %s",
		ErrChanged, key, consumer, statusText(r.Status), r.Attempts, processed, msg, strings.Join(diffs, "; "))
}

func statusText(s string) string {
	if s == "" {
		return "(no record)"
	}
	return s
}
