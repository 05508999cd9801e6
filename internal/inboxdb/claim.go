package inbox

import (
	"context"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

var errNoRows = seam.ErrNoRows

// ClaimResult is the outcome of a claim.
type ClaimResult struct {
	// Claimed is true when this transaction inserted the key's row: the
	// caller owns the key and runs the handler. False means a duplicate.
	Claimed bool
	// Existing is the committed record found for a duplicate (its
	// Duplicates already counts this delivery). Zero when Claimed.
	Existing Record
}

// ClaimTx records (consumer, key) as done inside tx, the transaction that
// also holds the handler's writes. The row becomes visible to others when tx
// commits and disappears with it if tx rolls back.
//
// If the key is already recorded, ClaimTx increments the record's duplicate
// counter and returns Claimed false with the record: the caller must not run
// the handler. If another transaction holds an uncommitted claim of the same
// key, ClaimTx waits for it to end (the primary key serialises them) and then
// reports a duplicate if it committed, or claims the key if it rolled back.
//
// A record in a status other than done (written by lease mode) yields an
// error wrapping ErrNotDone.
//
// Under REPEATABLE READ or SERIALIZABLE (a database or role default), a
// claim that waited for another transaction's claim of the same key fails
// with a serialization failure (SQLSTATE 40001) when that one commits: the
// row is not in tx's snapshot. Make the claim tx's first statement, roll
// back, and claim again in a new transaction, which sees the row; the
// middleware does exactly that.
func (s *Store) ClaimTx(ctx context.Context, tx wsql.ContextExecutor, consumer, key string) (ClaimResult, error) {
	if err := s.ValidateKey(consumer, key); err != nil {
		return ClaimResult{}, err
	}
	insert := `INSERT INTO ` + s.table + ` (consumer, message_key, status, attempts, processed_at)
VALUES ($1, $2, 'done', 1, now())
ON CONFLICT (consumer, message_key) DO NOTHING
RETURNING first_seen_at`
	update := `UPDATE ` + s.table + ` SET duplicates = duplicates + 1
WHERE consumer = $1 AND message_key = $2
RETURNING ` + recordColumns

	// The loop runs a second time only if the conflicting row was deleted
	// (Forget or Purge) between the two statements.
	for range 3 {
		var firstSeen any
		err := seam.QueryRow(ctx, tx, insert, []any{consumer, key}, &firstSeen)
		if err == nil {
			return ClaimResult{Claimed: true}, nil
		}
		if !notFound(err) {
			return ClaimResult{}, fmt.Errorf("inbox: claiming %q for %q: %w", key, consumer, err)
		}
		var rec Record
		err = seam.QueryRow(ctx, tx, update, []any{consumer, key}, rec.scanDest()...)
		if notFound(err) {
			continue
		}
		if err != nil {
			return ClaimResult{}, fmt.Errorf("inbox: counting duplicate %q for %q: %w", key, consumer, err)
		}
		if rec.Status != StatusDone {
			return ClaimResult{Existing: rec}, fmt.Errorf("%w: %q for %q is %s (is a lease-mode consumer using the same name?)", ErrNotDone, key, consumer, rec.Status)
		}
		return ClaimResult{Existing: rec}, nil
	}
	return ClaimResult{}, fmt.Errorf("inbox: claiming %q for %q: the record kept disappearing (concurrent Forget or Purge)", key, consumer)
}
