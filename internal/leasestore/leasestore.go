// Package leasestore is the seam between lease mode (the middleware) and
// where it keeps its records: the inbox table (Postgres, the default, on
// PostgreSQL or MySQL/MariaDB, as Config.DB's dialect says) or Redis
// (package redisstore). Both implement Backend with the same semantics,
// which the middleware's lease-mode behaviour suite checks store by store
// (PostgreSQL, MariaDB, Redis).
//
// The package is internal so that only this module provides stores: the
// middleware's exported LeaseStore is sealed by Provider, whose one method
// is unexported; a store provides its Backend by embedding a Handle.
package leasestore

import (
	"context"
	"reflect"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
)

// ErrLeaseLost means the attempt no longer owns the key: its lease expired
// and another worker took the key over (the key's fencing token moved on),
// or an operator changed or forgot the record. Every Backend returns it
// (wrapped) for a refused Extend, Complete, Fail or ParkInterrupted.
var ErrLeaseLost = inboxdb.ErrLeaseLost

// Outcome is what a claim decided.
type Outcome = inboxdb.LeaseOutcome

// The outcomes of a claim.
const (
	// Acquired: the caller owns the key until LeaseUntil and runs attempt
	// Attempt, fenced by Token.
	Acquired = inboxdb.LeaseAcquired
	// Duplicate: the key is done; do not run it.
	Duplicate = inboxdb.LeaseDuplicate
	// Busy: another worker holds a live lease (or is in the middle of a
	// claim or completion); do not run it, and do not ack it.
	Busy = inboxdb.LeaseBusy
	// Parked: the key is parked (now or earlier) for an operator.
	Parked = inboxdb.LeaseParked
)

// Options configures a claim.
type Options = inboxdb.LeaseOptions

// Claim is the result of a claim: see inboxdb.LeaseClaim, whose fields every
// Backend fills the same way (Record with at least Status, Attempts,
// FirstSeenAt and LastError).
type Claim = inboxdb.LeaseClaim

// Record is a key's record, in the inbox table's vocabulary (status
// processing, done, failed or parked).
type Record = inboxdb.Record

// Attempt names one acquired attempt: the key and its fencing token.
type Attempt struct {
	Consumer, Key, Token string
	// Tx is the handler's completion transaction when it has begun
	// (Postgres only, either dialect): Extend and Complete then write in
	// it. Nil otherwise.
	Tx wsql.ContextExecutor
	// Message is the message the attempt processes: Fail (permanent) and
	// ParkInterrupted keep it with the park, atomically. Nil keeps
	// nothing.
	Message *inboxdb.ParkedMessage
}

// Backend is a lease-mode store. Every method is safe for concurrent use.
// The rules, identical for every store:
//
//   - Claim: no record, or failed (an error, or an operator's release):
//     acquired as attempt 1, or attempts+1 (Interrupted when the failed
//     record was interrupted); done: Duplicate (duplicates+1); parked:
//     Parked (duplicates+1); processing with a live lease: Busy, unchanged;
//     processing with an expired lease: interrupted (interruptions+1), then
//     acquired as attempts+1 with Interrupted, or parked with ParkedNow once
//     MaxInterrupted attempts were interrupted (keeping Options.Message
//     with the park, atomically). Every acquired claim gets a
//     new random Token.
//   - Extend, Complete, Fail, ParkInterrupted act only while the record is
//     processing with the attempt's Token; otherwise ErrLeaseLost.
//   - Fail records failed (the next claim runs again) or, when permanent,
//     parked; ParkInterrupted parks and marks the record interrupted. Both
//     keep Attempt.Message with the park, atomically.
//   - Every park keeps the message (inboxdb.ParkedMessage.Row) with the
//     record's reason, attempts, first-seen and parked times, replacing
//     what an earlier park of the key kept; Forget deletes it with the
//     record.
//   - Release turns a parked record into failed.
type Backend interface {
	// Claim claims (consumer, key), durably before it returns.
	Claim(ctx context.Context, consumer, key string, opts Options) (Claim, error)
	// Extend moves the attempt's lease to now + d and returns its new end.
	Extend(ctx context.Context, a Attempt, d time.Duration) (time.Time, error)
	// Complete records the attempt done. Transactional backends need
	// a.Tx and write there (the caller commits); others commit at once.
	Complete(ctx context.Context, a Attempt) error
	// Owns reports whether the attempt still owns the key.
	Owns(ctx context.Context, a Attempt) (bool, error)
	// Fail records a failed attempt: failed, or parked when permanent.
	Fail(ctx context.Context, a Attempt, errText string, permanent bool) error
	// ParkInterrupted parks the key of an attempt whose handler ran but
	// whose completion can never be recorded, marking it interrupted.
	ParkInterrupted(ctx context.Context, a Attempt, reason string) error
	// Get returns the key's record, or an error wrapping
	// inboxdb.ErrNotFound.
	Get(ctx context.Context, consumer, key string) (Record, error)
	// Forget deletes the key's record and the message its park kept; it
	// reports whether a record existed.
	Forget(ctx context.Context, consumer, key string) (bool, error)
	// Parked lists up to limit parked records of consumer, oldest first.
	Parked(ctx context.Context, consumer string, limit int) ([]Record, error)
	// Release turns a parked record into failed; it reports whether a
	// parked record was found.
	Release(ctx context.Context, consumer, key string) (bool, error)

	// Unreachable reports whether err means the store could not be
	// reached (ErrDBUnavailable) rather than that it answered with an
	// error (ErrClaimFailed).
	Unreachable(err error) bool
	// Transactional reports whether the completion is an SQL
	// transaction that also holds the handler's writes and output
	// messages. When false the handler gets no transaction and no outbox.
	Transactional() bool
}

// Checker is a Backend that can tell, once at start-up, what in its
// server's set-up weakens the guarantee (see the middleware's start-up
// check).
type Checker interface {
	// StartupCheck returns one sentence per problem found (none: the
	// set-up is as the documentation asks), or an error when it cannot
	// tell (Backend.Unreachable tells whether to ask again later).
	StartupCheck(ctx context.Context) (problems []string, err error)
}

// Provider is a store that provides a Backend: the middleware's
// exactlyonce.LeaseStore embeds it. Its one method is unexported, so that
// only this package's Handle has it: other modules cannot implement
// LeaseStore, and users see no method of it. A store embeds a Handle (as an
// unexported field, through a type alias, so that its docs show nothing).
type Provider interface {
	backend() Backend
}

// Handle gives the store that embeds it its Backend (see Provider).
type Handle struct{ b Backend }

// NewHandle returns the Handle of b.
func NewHandle(b Backend) Handle { return Handle{b: b} }

func (h Handle) backend() Backend { return h.b }

// BackendOf returns p's Backend: nil when p is nil, a nil pointer (a
// store left nil, whose promoted method would dereference it), or its
// Handle is the zero value (a store not made by its constructor).
func BackendOf(p Provider) Backend {
	if p == nil {
		return nil
	}
	if v := reflect.ValueOf(p); v.Kind() == reflect.Pointer && v.IsNil() {
		return nil
	}
	return p.backend()
}
