package inboxdb

import (
	"context"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

var errNoRows = seam.ErrNoRows

// ClaimResult is the outcome of a claim.
type ClaimResult struct {
	// Claimed is true when this transaction inserted the key's row (or
	// took over a failed one, released by an operator): the caller owns the
	// key and runs the handler. False means a duplicate, or a parked key
	// (Existing.Status says which): ack without running the handler.
	Claimed bool
	// Existing is the committed record found when not claimed (its
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
// A parked record (a Permanent handler error, or lease mode's) is not
// claimed: Existing says parked. A failed record that a transactional
// consumer parked and an operator released is claimed again in tx
// (attempts+1). A processing or failed record written by lease mode yields
// an error wrapping ErrNotDone.
//
// Under REPEATABLE READ or SERIALIZABLE (a database or role default), a
// claim that waited for another transaction's claim of the same key fails
// with a serialization failure (SQLSTATE 40001) when that one commits: the
// row is not in tx's snapshot. Make the claim tx's first statement, roll
// back, and claim again in a new transaction, which sees the row; the
// middleware does exactly that.
//
// On MySQL/MariaDB (InnoDB) the claim is an INSERT ... ON DUPLICATE KEY
// UPDATE and a locking read (SELECT ... FOR UPDATE) of the record; a
// claim that waited for another transaction's claim of the key reads the
// latest committed row whatever tx's isolation level, as locking reads do
// there: no serialization failure under REPEATABLE READ (MySQL's default)
// or READ COMMITTED, only a deadlock (1213), which says roll back and
// claim again, as 40001 does. A failed statement does not abort tx there.
//
// On the partitioned layout, a claim that finds no partition for its record
// (the store's knowledge of the partitions was out of date) fails with an
// error wrapping ErrPartitionsChanged: roll back and claim again in a new
// transaction, as for a serialization failure. While partition maintenance
// is behind, a claim may wait for a purge that is about to remove the
// partition it would write into (until the claims already writing into it
// have ended): make it the first statement of tx, so that it holds nothing
// others wait for meanwhile.
func (s *Store) ClaimTx(ctx context.Context, tx wsql.ContextExecutor, consumer, key string) (ClaimResult, error) {
	if err := s.ValidateKey(consumer, key); err != nil {
		return ClaimResult{}, err
	}
	return s.claimTx(ctx, tx, consumer, key, nil)
}

// claimTx is ClaimTx for a valid key; a non-nil locked says that tx
// already holds the key's lock, taken for that placement (partitioned
// layout).
func (s *Store) claimTx(ctx context.Context, tx wsql.ContextExecutor, consumer, key string, locked *placement) (ClaimResult, error) {
	if s.mysql {
		return s.claimTxMySQL(ctx, tx, consumer, key)
	}
	insert, args := s.q.get("ClaimInsert"), []any{consumer, key}
	if s.part != nil {
		var err error
		if insert, args, err = s.claimInsertPartitioned(ctx, tx, consumer, key, locked); err != nil {
			return ClaimResult{}, fmt.Errorf("claiming %q for %q: %w", key, consumer, err)
		}
	}
	update := s.q.get("CountDuplicate")

	// The loop runs a second time only if the conflicting row was deleted
	// (Forget or Purge) between the two statements.
	for range 3 {
		var firstSeen any
		err := seam.QueryRow(ctx, tx, insert, args, &firstSeen)
		if err == nil {
			return ClaimResult{Claimed: true}, nil
		}
		if !notFound(err) {
			return ClaimResult{}, fmt.Errorf("claiming %q for %q: %w", key, consumer, s.partitionsChanged(err))
		}
		var rec Record
		err = seam.QueryRow(ctx, tx, update, []any{consumer, key}, rec.scanDest()...)
		if notFound(err) {
			continue
		}
		if err != nil {
			return ClaimResult{}, fmt.Errorf("counting duplicate %q for %q: %w", key, consumer, err)
		}
		res, again, err := s.existing(ctx, tx, consumer, key, rec)
		if again {
			continue
		}
		return res, err
	}
	return ClaimResult{}, fmt.Errorf("claiming %q for %q: the record kept disappearing (concurrent Forget or Purge)", key, consumer)
}

// claimTxMySQL is claimTx on MySQL/MariaDB (queries/mysql/claim.sql).
// The INSERT ... ON DUPLICATE KEY UPDATE either inserts the record
// (affected rows 1: claimed) or finds the key's row, waiting for the
// transaction that holds it, and counts the duplicate on it in the same
// statement when it is settled (2: changed, 0: left as it was); either way
// tx then holds the row's exclusive lock, and reads the record with a
// locking read, which sees the latest committed row under every isolation
// level. It needs the driver's default of affected rows (clientFoundRows
// off: with it, a row left as it was would count 1, as an insert).
func (s *Store) claimTxMySQL(ctx context.Context, tx wsql.ContextExecutor, consumer, key string) (ClaimResult, error) {
	for range 3 {
		n, err := seam.Exec(ctx, tx, s.q.get("ClaimInsert"), consumer, key)
		if err != nil {
			return ClaimResult{}, fmt.Errorf("claiming %q for %q: %w", key, consumer, err)
		}
		if n == 1 {
			return ClaimResult{Claimed: true}, nil
		}
		var rec Record
		err = seam.QueryRow(ctx, tx, s.q.get("LockRecord"), []any{consumer, key}, rec.scanDest()...)
		if notFound(err) {
			continue // cannot happen under the row lock; as PostgreSQL's path
		}
		if err != nil {
			return ClaimResult{}, fmt.Errorf("counting duplicate %q for %q: %w", key, consumer, err)
		}
		res, again, err := s.existing(ctx, tx, consumer, key, rec)
		if again {
			continue
		}
		return res, err
	}
	return ClaimResult{}, fmt.Errorf("claiming %q for %q: the record kept disappearing (concurrent Forget or Purge)", key, consumer)
}

// existing is the outcome of a claim that found rec, the key's record
// (its duplicate counted when settled): a duplicate, a released
// transactional park claimed again, or ErrNotDone. again is true when the
// record changed in between: look again.
func (s *Store) existing(ctx context.Context, tx wsql.ContextExecutor, consumer, key string, rec Record) (res ClaimResult, again bool, err error) {
	switch {
	case Settled(rec.Status):
		return ClaimResult{Existing: rec}, false, nil
	case rec.Status == StatusFailed:
		if !rec.ParkedByTransaction {
			return ClaimResult{Existing: rec}, false, notDone(consumer, key, rec)
		}
		ok, err := s.reclaim(ctx, tx, consumer, key)
		if err != nil {
			return ClaimResult{}, false, fmt.Errorf("claiming released %q for %q: %w", key, consumer, err)
		}
		if !ok {
			return ClaimResult{}, true, nil // changed in between: look again
		}
		return ClaimResult{Claimed: true}, false, nil
	}
	return ClaimResult{Existing: rec}, false, notDone(consumer, key, rec)
}

// reclaim takes over a failed record (released by an operator) as done in
// tx, which holds its row lock until it ends; a rollback restores it. It
// reports false when the record is no longer failed.
func (s *Store) reclaim(ctx context.Context, tx wsql.ContextExecutor, consumer, key string) (ok bool, err error) {
	if s.mysql {
		n, err := seam.Exec(ctx, tx, s.q.get("Reclaim"), consumer, key)
		return n > 0, err
	}
	err = seam.QueryRow(ctx, tx, s.q.get("Reclaim"), []any{consumer, key}, &ok)
	if notFound(err) {
		return false, nil
	}
	return ok, err
}

func notDone(consumer, key string, rec Record) error {
	return fmt.Errorf("%w: %q for %q is %s", ErrNotDone, key, consumer, rec.Status)
}

// Park records (consumer, key) as parked with reason, in a statement of its
// own: a transactional-mode handler returned a Permanent error, and its
// transaction was rolled back. A key recorded done in the meantime stays
// done; a failed (released) one is parked again.
//
// The same statement keeps msg, the message the key was parked with, in
// the table of parked messages (replacing what an earlier park of the key
// kept), with the reason, the record's attempts, first-seen time and
// parked time (see ParkedMessage.Row for what is kept of it). A key left
// alone (done, processing, or parked already) keeps nothing new. A nil msg
// keeps nothing.
func (s *Store) Park(ctx context.Context, db wsql.ContextExecutor, consumer, key, reason string, msg *ParkedMessage) error {
	if s.part != nil {
		if err := s.parkPartitioned(ctx, db, consumer, key, pgtext.Truncate(reason), msg); err != nil {
			return fmt.Errorf("parking %q for %q: %w", key, consumer, err)
		}
		return nil
	}
	if s.mysql {
		return s.parkMySQL(ctx, db, consumer, key, pgtext.Truncate(reason), msg)
	}
	q, args := s.q.get("Park"), []any{consumer, key, pgtext.Truncate(reason)}
	if msg != nil {
		q, args = s.q.get("ParkKeep"), append(msg.Row().args(), args...)
	}
	return retryStatement(db, func() error {
		if _, err := seam.Exec(ctx, db, q, args...); err != nil {
			return fmt.Errorf("parking %q for %q: %w", key, consumer, err)
		}
		return nil
	})
}
