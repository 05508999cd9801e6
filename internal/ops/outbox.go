package ops

import (
	"context"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// This file is the one place the tools (the console, the CLI) call the
// outbox's operator functions: when they become methods of an outbox
// store, only it changes.

// Rows is the outbox rows of db, for operators.
type Rows struct{ db sqlschema.DB }

// NewRows returns the rows of db's outbox table.
func NewRows(db sqlschema.DB) Rows { return Rows{db: db} }

// Find is outbox.FindRows.
func (r Rows) Find(ctx context.Context, f outbox.RowFilter, p outbox.Paging) (outbox.RowPage, error) {
	return outbox.FindRows(ctx, r.db, f, p)
}

// Count is outbox.CountRows.
func (r Rows) Count(ctx context.Context, f outbox.RowFilter) (int64, error) {
	return outbox.CountRows(ctx, r.db, f)
}

// CountAsOf is outbox.CountRowsAsOf: a count with its bounds.
func (r Rows) CountAsOf(ctx context.Context, f outbox.RowFilter) (Confirmation, error) {
	c, err := outbox.CountRowsAsOf(ctx, r.db, f)
	return Confirmation{Count: c.Count, AsOf: c.AsOf, MaxID: c.MaxID}, err
}

// Get is outbox.GetRow.
func (r Rows) Get(ctx context.Context, id int64) (outbox.Row, error) {
	return outbox.GetRow(ctx, r.db, id)
}

// GetPrefix is outbox.GetRowPrefix.
func (r Rows) GetPrefix(ctx context.Context, id int64, maxPayload int) (outbox.Row, error) {
	return outbox.GetRowPrefix(ctx, r.db, id, maxPayload)
}

// Act requeues (VerbRequeue) or discards (VerbDiscard) row id if it is
// still what expect says.
func (r Rows) Act(ctx context.Context, verb string, id int64, expect outbox.Expect) error {
	if verb == VerbRequeue {
		return outbox.Requeue(ctx, r.db, id, expect)
	}
	return outbox.Discard(ctx, r.db, id, expect)
}

// Pending is outbox.PendingStats.
func (r Rows) Pending(ctx context.Context) (outbox.Pending, error) {
	return outbox.PendingStats(ctx, r.db)
}

// RequeueFailed is outbox.RequeueFailed.
func (r Rows) RequeueFailed(ctx context.Context) (int64, error) {
	return outbox.RequeueFailed(ctx, r.db)
}

// Now is the database's time.
func (r Rows) Now(ctx context.Context) (time.Time, error) { return dbNow(ctx, r.db) }

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
	return b.Rows.CountAsOf(ctx, b.Filter)
}

// Recount counts the matches within c's bounds.
func (b RowsBulk) Recount(ctx context.Context, c Confirmation) (int64, error) {
	n, err := b.Rows.CountAsOf(ctx, b.bound(c))
	return n.Count, err
}

// Act requeues or discards the matches within c's bounds.
func (b RowsBulk) Act(ctx context.Context, c Confirmation) (int64, int64, error) {
	var n int64
	var err error
	if b.Verb == VerbRequeue {
		n, err = outbox.RequeueMatching(ctx, b.Rows.db, b.bound(c))
	} else {
		n, err = outbox.DiscardMatching(ctx, b.Rows.db, b.bound(c))
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
