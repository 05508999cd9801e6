package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// uniqueViolation is PostgreSQL's SQLSTATE for a duplicate key.
const uniqueViolation = "23505"

// BeginClaimPgx begins a transaction on conn and claims (consumer, key) in
// it, in one round trip: BEGIN and the inbox INSERT travel as one
// simple-protocol query. It is the fast path of ClaimTx for pgx
// connections; the semantics are the same.
//
// When it returns Claimed true, tx is open and holds the claim; the caller
// commits or rolls it back. When the key is already done, it rolls the
// attempt back, counts the duplicate in its own statement, and returns
// Claimed false with the existing record and a nil tx. conn is never left in
// a transaction by an error.
//
// consumer and key are sent as quoted literals (the INSERT cannot take
// parameters in a multi-statement query); ValidateKey guarantees they are
// valid UTF-8 without NUL, and conn must use standard_conforming_strings=on
// and UTF8 client encoding (PostgreSQL's defaults; checked).
//
// It keeps nothing in the database session (no prepared statement, no
// setting) and makes one round trip for a claim, so it works through
// PgBouncer in transaction pooling, where consecutive round trips outside a
// transaction may run on different server connections.
func (s *Store) BeginClaimPgx(ctx context.Context, conn *pgx.Conn, consumer, key string) (pgx.Tx, ClaimResult, error) {
	if err := s.ValidateKey(consumer, key); err != nil {
		return nil, ClaimResult{}, err
	}
	qc, err := conn.PgConn().EscapeString(consumer)
	if err != nil {
		return nil, ClaimResult{}, fmt.Errorf("inbox: %w", err)
	}
	qk, err := conn.PgConn().EscapeString(key)
	if err != nil {
		return nil, ClaimResult{}, fmt.Errorf("inbox: %w", err)
	}
	// A plain INSERT, not INSERT ... ON CONFLICT: a duplicate fails the
	// query with a unique violation, and the transaction with it.
	begin := `BEGIN; INSERT INTO ` + s.table + ` (consumer, message_key, status, attempts, processed_at) VALUES ('` +
		qc + `', '` + qk + `', 'done', 1, now())`

	for attempt := 0; attempt < 4; attempt++ {
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: begin})
		if err == nil {
			return tx, ClaimResult{Claimed: true}, nil
		}
		// A failed BEGIN query may leave conn in an aborted transaction.
		if conn.PgConn().TxStatus() != 'I' && !conn.IsClosed() {
			if _, rbErr := conn.Exec(context.WithoutCancel(ctx), "ROLLBACK"); rbErr != nil {
				return nil, ClaimResult{}, fmt.Errorf("inbox: rolling back a failed claim of %q for %q: %w", key, consumer, rbErr)
			}
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != uniqueViolation {
			return nil, ClaimResult{}, fmt.Errorf("inbox: claiming %q for %q: %w", key, consumer, err)
		}
		// Already recorded: count the duplicate. Zero rows means the record
		// was deleted (Forget, Purge) in between: claim again.
		var rec Record
		err = conn.QueryRow(ctx, `UPDATE `+s.table+` SET duplicates = duplicates + 1
WHERE consumer = $1 AND message_key = $2 RETURNING `+recordColumns, consumer, key).Scan(rec.scanDest()...)
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		if err != nil {
			return nil, ClaimResult{}, fmt.Errorf("inbox: counting duplicate %q for %q: %w", key, consumer, err)
		}
		if rec.Status != StatusDone {
			return nil, ClaimResult{Existing: rec}, fmt.Errorf("%w: %q for %q is %s (is a lease-mode consumer using the same name?)", ErrNotDone, key, consumer, rec.Status)
		}
		return nil, ClaimResult{Existing: rec}, nil
	}
	return nil, ClaimResult{}, fmt.Errorf("inbox: claiming %q for %q: the record kept disappearing (concurrent Forget or Purge)", key, consumer)
}
