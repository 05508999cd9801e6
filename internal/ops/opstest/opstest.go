// Package opstest is the operator contract's suite: what every store of
// inbox keys and parked messages (ops.Store) must do, run against each
// (the PostgreSQL inbox in both layouts, the Redis lease store; a MySQL
// store runs it too). A store's own behaviour (its locks, its scripts,
// its failure modes) is tested with it.
package opstest

import (
	"context"
	"testing"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
)

// Harness is a store under test and the means to act on it as the
// middleware and the broker do.
type Harness struct {
	Ctx   context.Context
	Store ops.Store
	// Park parks (consumer, key) for reason, keeping msg, as the
	// middleware does after a permanent failure; parks follow each other
	// in the store's clock (the Redis store's counts milliseconds).
	Park func(t *testing.T, consumer, key, reason string, msg *inboxdb.ParkedMessage)
	// Deliver is a delivery of (consumer, key): it reports whether the
	// handler ran (and the key is then done); a delivery of a key done,
	// discarded or parked is a duplicate, counted.
	Deliver func(t *testing.T, consumer, key string) bool
	// Replayed are the messages replays published so far, in order.
	Replayed func(t *testing.T) []Replayed
	// Age moves the park of (consumer, key)'s message ago into the past,
	// behind the store's back.
	Age func(t *testing.T, consumer, key string, ago time.Duration)
	// SetStatus sets the status of the key's record behind the store's
	// back (processing: an attempt holds its lease for an hour).
	SetStatus func(t *testing.T, consumer, key, status string)
}

// Replayed is a message a replay published (written to the outbox, or
// published through the store's publisher).
type Replayed struct {
	Topic, UUID string
	Payload     []byte
	Metadata    map[string]string
}

// Run runs the contract's subtests, each against a new harness.
func Run(t *testing.T, newHarness func(t *testing.T) Harness) {
	for _, c := range []struct {
		name string
		f    func(t *testing.T, h Harness)
	}{
		{"Expect", testExpect},
		{"GetParkedPrefix", testGetParkedPrefix},
		{"ChangedMessageWithEmptyPayloadIsNotReplayable", testChangedMessageWithEmptyPayload},
		{"DiscardForgetKeepsADoneRecord", testDiscardForgetKeepsADoneRecord},
		{"ReplayParked", testReplayParked},
		{"ReplayParkedRefusals", testReplayParkedRefusals},
		{"DiscardParked", testDiscardParked},
		{"ReplayParkedMatching", testReplayParkedMatching},
		{"FindParked", testFindParked},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.f(t, newHarness(t))
		})
	}
}

// status is the key's record status, "" without a record.
func (h Harness) status(t *testing.T, consumer, key string) string {
	t.Helper()
	rec, err := h.Store.Get(h.Ctx, consumer, key)
	if err != nil {
		requireErrorIs(t, err, errNotFound)
		return ""
	}
	return rec.Status
}
