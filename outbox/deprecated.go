package outbox

import (
	"context"
	"strconv"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The operator functions before Store. Each builds a Store for the call.

// Paging is a page of FindRows.
//
// Deprecated: removed before v0.1.0; use Page.
type Paging struct {
	After int64
	Limit int
}

// RowPageByID is a page of FindRows.
//
// Deprecated: removed before v0.1.0; use RowPage.
type RowPageByID struct {
	Rows []Row
	Next int64
}

// FindRows is Store.Find.
//
// Deprecated: removed before v0.1.0; use Store.Find.
func FindRows(ctx context.Context, db sqlschema.DB, f RowFilter, p Paging) (RowPageByID, error) {
	after := ""
	if p.After != 0 {
		after = strconv.FormatInt(p.After, 10)
	}
	page, err := call(db, func(s *Store) (RowPage, error) { return s.Find(ctx, f, Page{Limit: p.Limit, After: after}) })
	next, _ := strconv.ParseInt(page.Next, 10, 64)
	return RowPageByID{Rows: page.Rows, Next: next}, err
}

// CountRows is Store.Count.
//
// Deprecated: removed before v0.1.0; use Store.Count.
func CountRows(ctx context.Context, db sqlschema.DB, f RowFilter) (int64, error) {
	return call(db, func(s *Store) (int64, error) { return s.Count(ctx, f) })
}

// CountRowsAsOf is Store.CountAsOf.
//
// Deprecated: removed before v0.1.0; use Store.CountAsOf.
func CountRowsAsOf(ctx context.Context, db sqlschema.DB, f RowFilter) (RowCount, error) {
	return call(db, func(s *Store) (RowCount, error) { return s.CountAsOf(ctx, f) })
}

// GetRow is Store.Get.
//
// Deprecated: removed before v0.1.0; use Store.Get.
func GetRow(ctx context.Context, db sqlschema.DB, id int64) (Row, error) {
	return call(db, func(s *Store) (Row, error) { return s.Get(ctx, id) })
}

// GetRowPrefix is Store.GetPrefix.
//
// Deprecated: removed before v0.1.0; use Store.GetPrefix.
func GetRowPrefix(ctx context.Context, db sqlschema.DB, id int64, maxPayload int) (Row, error) {
	return call(db, func(s *Store) (Row, error) { return s.GetPrefix(ctx, id, maxPayload) })
}

// Requeue is Store.Requeue.
//
// Deprecated: removed before v0.1.0; use Store.Requeue.
func Requeue(ctx context.Context, db sqlschema.DB, id int64, expect Expect) error {
	_, err := call(db, func(s *Store) (struct{}, error) { return struct{}{}, s.Requeue(ctx, id, expect) })
	return err
}

// Discard is Store.Discard.
//
// Deprecated: removed before v0.1.0; use Store.Discard.
func Discard(ctx context.Context, db sqlschema.DB, id int64, expect Expect) error {
	_, err := call(db, func(s *Store) (struct{}, error) { return struct{}{}, s.Discard(ctx, id, expect) })
	return err
}

// RequeueMatching is Store.RequeueMatching.
//
// Deprecated: removed before v0.1.0; use Store.RequeueMatching.
func RequeueMatching(ctx context.Context, db sqlschema.DB, f RowFilter) (int64, error) {
	return call(db, func(s *Store) (int64, error) { return s.RequeueMatching(ctx, f) })
}

// DiscardMatching is Store.DiscardMatching.
//
// Deprecated: removed before v0.1.0; use Store.DiscardMatching.
func DiscardMatching(ctx context.Context, db sqlschema.DB, f RowFilter) (int64, error) {
	return call(db, func(s *Store) (int64, error) { return s.DiscardMatching(ctx, f) })
}

// PendingStats is Store.Pending.
//
// Deprecated: removed before v0.1.0; use Store.Pending.
func PendingStats(ctx context.Context, db sqlschema.DB) (Pending, error) {
	return call(db, func(s *Store) (Pending, error) { return s.Pending(ctx) })
}

// RequeueFailed is Store.RequeueFailed.
//
// Deprecated: removed before v0.1.0; use Store.RequeueFailed.
func RequeueFailed(ctx context.Context, db sqlschema.DB) (int64, error) {
	return call(db, func(s *Store) (int64, error) { return s.RequeueFailed(ctx) })
}

// call runs f on a Store of db.
func call[T any](db sqlschema.DB, f func(*Store) (T, error)) (T, error) {
	s, err := NewStore(db)
	if err != nil {
		var zero T
		return zero, err
	}
	return f(s)
}
