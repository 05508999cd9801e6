package ops

import (
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// The words of a row's and a key's state: what the console shows, the CLI
// prints, and the API's and the CLI's JSON send ("state" of a row,
// "status" of a key). One word for one state everywhere.

// A row's state.
const (
	// RowQuarantined: the relay gave up on the row (a failure that was
	// the message's own, MaxAttempts times); it waits for an operator.
	RowQuarantined = string(outbox.StateQuarantined)
	// RowFailing: its publish failed, and the relay retries it after its
	// backoff.
	RowFailing = string(outbox.StateFailing)
	// RowReady: it never failed: the live backlog.
	RowReady = "ready"
	// RowBlocked: it never failed, and waits behind a failed row of its
	// ordering key (the CLI's outbox pending).
	RowBlocked = "blocked"
)

// RowStates are the words a row filter's state takes: a state, or "all"
// (every row with a failure record).
func RowStates() []string { return []string{RowQuarantined, RowFailing, string(outbox.StateAll)} }

// A key's state: the inbox record's status (inbox.Record.Status,
// inbox.ParkedMessage.Status).
const (
	KeyProcessing = inboxdb.StatusProcessing
	KeyDone       = inboxdb.StatusDone
	KeyFailed     = inboxdb.StatusFailed
	KeyParked     = inboxdb.StatusParked
	KeyDiscarded  = inboxdb.StatusDiscarded
	// KeyNoRecord is how a key without a record is shown (its status is
	// ""): a parked message whose key was forgotten or purged.
	KeyNoRecord = "no record"
)

// KeyStates are the statuses in the order the tools list them.
func KeyStates() []string {
	return []string{KeyDone, KeyProcessing, KeyFailed, KeyParked, KeyDiscarded}
}

// KeyState is status as shown: KeyNoRecord for "".
func KeyState(status string) string {
	if status == "" {
		return KeyNoRecord
	}
	return status
}
