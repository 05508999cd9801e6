package ops

import (
	"context"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Rows is the outbox rows of a database, for operators: outbox.Store with
// the layer's confirmation and state words.
type Rows struct {
	*outbox.Store
	db sqlschema.DB
}

// NewRows returns the rows of db's outbox table.
func NewRows(db sqlschema.DB) (Rows, error) {
	s, err := outbox.NewStore(db)
	return Rows{Store: s, db: db}, err
}

// Now is the database's time.
func (r Rows) Now(ctx context.Context) (time.Time, error) { return dbNow(ctx, r.db) }

// Confirm is Store.CountAsOf, as the layer's Confirmation.
func (r Rows) Confirm(ctx context.Context, f outbox.RowFilter) (Confirmation, error) {
	c, err := r.CountAsOf(ctx, f)
	return Confirmation{Count: c.Count, AsOf: c.AsOf, MaxID: c.MaxID}, err
}

// Act requeues (VerbRequeue) or discards (VerbDiscard) row id if it is
// still what expect says.
func (r Rows) Act(ctx context.Context, verb string, id int64, expect outbox.Expect) error {
	if verb == VerbRequeue {
		return r.Requeue(ctx, id, expect)
	}
	return r.Discard(ctx, id, expect)
}

// RowsBulk is the outbox rows a filter matches, for a bulk requeue or
// discard.
type RowsBulk struct {
	Rows   Rows
	Filter outbox.RowFilter
	Verb   string // VerbRequeue or VerbDiscard
}

// Noun is "row", "rows".
func (RowsBulk) Noun() (string, string) { return "row", "rows" }

// Now is the database's time.
func (b RowsBulk) Now(ctx context.Context) (time.Time, error) { return b.Rows.Now(ctx) }

// Count counts the matches now, with the bounds of the count.
func (b RowsBulk) Count(ctx context.Context) (Confirmation, error) {
	return b.Rows.Confirm(ctx, b.Filter)
}

// Recount counts the matches within c's bounds.
func (b RowsBulk) Recount(ctx context.Context, c Confirmation) (int64, error) {
	return b.Rows.Count(ctx, b.bound(c))
}

// Act requeues or discards the matches within c's bounds.
func (b RowsBulk) Act(ctx context.Context, c Confirmation) (int64, int64, error) {
	var n int64
	var err error
	if b.Verb == VerbRequeue {
		n, err = b.Rows.RequeueMatching(ctx, b.bound(c))
	} else {
		n, err = b.Rows.DiscardMatching(ctx, b.bound(c))
	}
	return n, 0, err
}

func (b RowsBulk) bound(c Confirmation) outbox.RowFilter {
	f := b.Filter
	f.AsOf, f.MaxID = c.AsOf, c.MaxID
	return f
}

// RowState is the word of r's state (RowQuarantined, RowFailing,
// RowReady).
func RowState(r outbox.Row) string { return PendingState(r.Quarantined(), r.Failures, false) }

// PendingState is the word of the state of a row of the backlog:
// quarantined, failing (failures > 0), blocked (it never failed, and waits
// behind a failed row of its ordering key) or ready.
func PendingState(quarantined bool, failures int, blocked bool) string {
	switch {
	case quarantined:
		return RowQuarantined
	case failures > 0:
		return RowFailing
	case blocked:
		return RowBlocked
	}
	return RowReady
}
