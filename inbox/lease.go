package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// ErrLeaseLost means the caller's attempt no longer owns the key: its lease
// expired and another worker took the key over (the attempt number moved
// on), or an operator changed the record.
var ErrLeaseLost = errors.New("inbox: lease lost")

// ExpiredPolicy decides what ClaimLease does with a key whose lease expired
// while its record was still processing: the worker died, or hung, in the
// middle of its attempt, and whether the external effect happened is
// unknown.
type ExpiredPolicy int

const (
	// RetryExpired runs the key again (attempts+1) with the same
	// idempotency key: right when the external provider deduplicates on
	// that key. The default.
	RetryExpired ExpiredPolicy = iota
	// ParkExpired records the key as parked and does not run it again
	// until an operator releases it (Store.Release).
	ParkExpired
)

// LeaseOutcome is what ClaimLease decided.
type LeaseOutcome int

const (
	// LeaseAcquired: the caller owns the key until LeaseUntil and runs the
	// handler as attempt Attempt.
	LeaseAcquired LeaseOutcome = iota + 1
	// LeaseDuplicate: the key is done; do not run it.
	LeaseDuplicate
	// LeaseBusy: another worker holds a live lease; do not run it, and do
	// not ack either: the holder may still fail.
	LeaseBusy
	// LeaseParked: the key is parked (now or earlier) for an operator; do
	// not run it.
	LeaseParked
)

// String names the outcome.
func (o LeaseOutcome) String() string {
	switch o {
	case LeaseAcquired:
		return "acquired"
	case LeaseDuplicate:
		return "duplicate"
	case LeaseBusy:
		return "busy"
	case LeaseParked:
		return "parked"
	}
	return "unknown"
}

// LeaseClaim is the result of ClaimLease.
type LeaseClaim struct {
	Outcome LeaseOutcome
	// Attempt is the attempt number the caller runs (LeaseAcquired), or
	// the record's attempts otherwise.
	Attempt int
	// Interrupted is true when this attempt follows one whose lease expired
	// while processing (the previous worker died or hung mid-call).
	Interrupted bool
	// ParkedNow is true when this call parked the key (ParkExpired).
	ParkedNow bool
	// LeaseUntil is when the caller's lease ends (LeaseAcquired), or the
	// holder's (LeaseBusy).
	LeaseUntil time.Time
	// Record is the key's record after the claim.
	Record Record
}

// ClaimLease claims (consumer, key) for lease mode in a short transaction of
// its own, committed before it returns, so that other workers see the lease
// while the caller runs its handler:
//
//   - no record: inserted as processing, attempt 1 (LeaseAcquired);
//   - done: duplicate counted (LeaseDuplicate);
//   - parked: duplicate counted (LeaseParked);
//   - failed (a previous attempt returned an error): processing again,
//     attempts+1 (LeaseAcquired);
//   - processing with a live lease: LeaseBusy, nothing changed;
//   - processing with an expired lease: by policy, processing again with
//     attempts+1 and Interrupted (RetryExpired), or parked with the reason in
//     last_error (ParkExpired, LeaseParked with ParkedNow).
func (s *Store) ClaimLease(ctx context.Context, db wsql.Beginner, consumer, key string, lease time.Duration, policy ExpiredPolicy) (LeaseClaim, error) {
	if err := s.ValidateKey(consumer, key); err != nil {
		return LeaseClaim{}, err
	}
	if lease <= 0 {
		return LeaseClaim{}, fmt.Errorf("inbox: lease must be > 0, got %s", lease)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return LeaseClaim{}, fmt.Errorf("inbox: lease claim of %q for %q: begin: %w", key, consumer, err)
	}
	lc, err := s.claimLease(ctx, tx, consumer, key, lease.Seconds(), policy)
	if err != nil {
		_ = tx.Rollback()
		return LeaseClaim{}, fmt.Errorf("inbox: lease claim of %q for %q: %w", key, consumer, err)
	}
	if err := tx.Commit(); err != nil {
		return LeaseClaim{}, fmt.Errorf("inbox: lease claim of %q for %q: commit: %w", key, consumer, err)
	}
	return lc, nil
}

func (s *Store) claimLease(ctx context.Context, tx wsql.Tx, consumer, key string, leaseSecs float64, policy ExpiredPolicy) (LeaseClaim, error) {
	return s.claimLeaseTry(ctx, tx, consumer, key, leaseSecs, policy, 3)
}

func (s *Store) claimLeaseTry(ctx context.Context, tx wsql.Tx, consumer, key string, leaseSecs float64, policy ExpiredPolicy, tries int) (LeaseClaim, error) {
	var rec Record
	err := seam.QueryRow(ctx, tx, `INSERT INTO `+s.table+` (consumer, message_key, status, attempts, lease_until)
VALUES ($1, $2, 'processing', 1, now() + make_interval(secs => $3))
ON CONFLICT (consumer, message_key) DO NOTHING
RETURNING `+recordColumns, []any{consumer, key, leaseSecs}, rec.scanDest()...)
	if err == nil {
		return LeaseClaim{Outcome: LeaseAcquired, Attempt: 1, LeaseUntil: *rec.LeaseUntil, Record: rec}, nil
	}
	if !notFound(err) {
		return LeaseClaim{}, err
	}

	var expired bool
	err = seam.QueryRow(ctx, tx, `SELECT `+recordColumns+`, coalesce(lease_until < now(), true) FROM `+s.table+`
WHERE consumer = $1 AND message_key = $2 FOR UPDATE`, []any{consumer, key}, append(rec.scanDest(), &expired)...)
	if notFound(err) {
		// Deleted between the two statements (Forget, Purge): a
		// conflict-free retry of the insert is the simplest correct answer.
		if tries <= 1 {
			return LeaseClaim{}, errors.New("the record kept disappearing (concurrent Forget or Purge)")
		}
		return s.claimLeaseTry(ctx, tx, consumer, key, leaseSecs, policy, tries-1)
	}
	if err != nil {
		return LeaseClaim{}, err
	}

	update := func(set string, args ...any) (Record, error) {
		var out Record
		err := seam.QueryRow(ctx, tx, `UPDATE `+s.table+` SET `+set+`
WHERE consumer = $1 AND message_key = $2 RETURNING `+recordColumns,
			append([]any{consumer, key}, args...), out.scanDest()...)
		return out, err
	}
	retry := `status = 'processing', attempts = attempts + 1, lease_until = now() + make_interval(secs => $3), interrupted = false`

	switch {
	case rec.Status == StatusDone:
		out, err := update(`duplicates = duplicates + 1`)
		return LeaseClaim{Outcome: LeaseDuplicate, Attempt: out.Attempts, Record: out}, err
	case rec.Status == StatusParked:
		out, err := update(`duplicates = duplicates + 1`)
		return LeaseClaim{Outcome: LeaseParked, Attempt: out.Attempts, Record: out}, err
	case rec.Status == StatusFailed:
		// A failed record that was parked after an interrupted attempt and
		// then released keeps the interruption: the effect is still unknown.
		out, err := update(retry, leaseSecs)
		if err != nil {
			return LeaseClaim{}, err
		}
		return LeaseClaim{Outcome: LeaseAcquired, Attempt: out.Attempts, Interrupted: rec.Interrupted, LeaseUntil: *out.LeaseUntil, Record: out}, nil
	case !expired:
		lc := LeaseClaim{Outcome: LeaseBusy, Attempt: rec.Attempts, Record: rec}
		if rec.LeaseUntil != nil {
			lc.LeaseUntil = *rec.LeaseUntil
		}
		return lc, nil
	case policy == ParkExpired:
		out, err := update(`status = 'parked', lease_until = NULL, interrupted = true,
last_error = 'lease expired during attempt ' || attempts || ': the worker stopped mid-attempt; whether its effect happened is unknown'`)
		return LeaseClaim{Outcome: LeaseParked, ParkedNow: true, Attempt: out.Attempts, Record: out}, err
	default:
		out, err := update(retry, leaseSecs)
		if err != nil {
			return LeaseClaim{}, err
		}
		return LeaseClaim{Outcome: LeaseAcquired, Attempt: out.Attempts, Interrupted: true, LeaseUntil: *out.LeaseUntil, Record: out}, nil
	}
}

// ExtendLease moves the lease of attempt `attempt` of (consumer, key) to
// now + lease. It runs on its own (pass the pool or *sql.DB, not the
// completion transaction, whose writes nobody sees before it commits). It
// returns the new end, or ErrLeaseLost when the attempt no longer owns the
// key.
func (s *Store) ExtendLease(ctx context.Context, db wsql.ContextExecutor, consumer, key string, attempt int, lease time.Duration) (time.Time, error) {
	if lease <= 0 {
		return time.Time{}, fmt.Errorf("inbox: lease must be > 0, got %s", lease)
	}
	var until time.Time
	err := seam.QueryRow(ctx, db, `UPDATE `+s.table+` SET lease_until = now() + make_interval(secs => $4)
WHERE consumer = $1 AND message_key = $2 AND status = 'processing' AND attempts = $3
RETURNING lease_until`, []any{consumer, key, attempt, lease.Seconds()}, &until)
	if notFound(err) {
		return time.Time{}, fmt.Errorf("%w: %q for %q, attempt %d", ErrLeaseLost, key, consumer, attempt)
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("inbox: extending lease of %q for %q: %w", key, consumer, err)
	}
	return until, nil
}

// CompleteTx records attempt `attempt` of (consumer, key) as done inside tx,
// the transaction that also holds the handler's writes and output messages.
// It returns ErrLeaseLost (and the caller must roll back) when the attempt
// no longer owns the key.
func (s *Store) CompleteTx(ctx context.Context, tx wsql.ContextExecutor, consumer, key string, attempt int) error {
	n, err := seam.Exec(ctx, tx, `UPDATE `+s.table+`
SET status = 'done', processed_at = now(), lease_until = NULL, last_error = NULL
WHERE consumer = $1 AND message_key = $2 AND status = 'processing' AND attempts = $3`, consumer, key, attempt)
	if err != nil {
		return fmt.Errorf("inbox: completing %q for %q: %w", key, consumer, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %q for %q, attempt %d", ErrLeaseLost, key, consumer, attempt)
	}
	return nil
}

// maxErrorText bounds last_error.
const maxErrorText = 4000

// Fail records that attempt `attempt` of (consumer, key) failed with
// errText: status failed (the next delivery runs it again), or parked when
// permanent (it waits for an operator). It returns ErrLeaseLost when the
// attempt no longer owns the key.
func (s *Store) Fail(ctx context.Context, db wsql.ContextExecutor, consumer, key string, attempt int, errText string, permanent bool) error {
	status := StatusFailed
	if permanent {
		status = StatusParked
	}
	errText = pgtext.Storable(errText, maxErrorText)
	n, err := seam.Exec(ctx, db, `UPDATE `+s.table+`
SET status = $4, last_error = $5, lease_until = NULL
WHERE consumer = $1 AND message_key = $2 AND status = 'processing' AND attempts = $3`,
		consumer, key, attempt, string(status), errText)
	if err != nil {
		return fmt.Errorf("inbox: recording failure of %q for %q: %w", key, consumer, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %q for %q, attempt %d", ErrLeaseLost, key, consumer, attempt)
	}
	return nil
}

// ListParked returns up to limit parked records of consumer (all consumers
// when empty), oldest first.
func (s *Store) ListParked(ctx context.Context, db wsql.ContextExecutor, consumer string, limit int) ([]Record, error) {
	if limit <= 0 {
		limit = 100
	}
	q := `SELECT ` + recordColumns + ` FROM ` + s.table + ` WHERE status = 'parked'`
	args := []any{limit}
	if consumer != "" {
		q += ` AND consumer = $2`
		args = append(args, consumer)
	}
	q += ` ORDER BY first_seen_at LIMIT $1`
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("inbox: listing parked keys: %w", err)
	}
	var out []Record
	for rows.Next() {
		var rec Record
		if err := rows.Scan(rec.scanDest()...); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("inbox: listing parked keys: %w", err)
		}
		out = append(out, rec)
	}
	if err := seam.Close(rows); err != nil {
		return nil, fmt.Errorf("inbox: listing parked keys: %w", err)
	}
	return out, nil
}

// Release turns a parked key back into failed, so that its next delivery
// runs again (attempts+1, same idempotency key). It reports whether a
// parked record was found. The broker acked the parked message: the next
// delivery is a re-publish or a later duplicate.
func (s *Store) Release(ctx context.Context, db wsql.ContextExecutor, consumer, key string) (bool, error) {
	n, err := seam.Exec(ctx, db, `UPDATE `+s.table+` SET status = 'failed'
WHERE consumer = $1 AND message_key = $2 AND status = 'parked'`, consumer, key)
	if err != nil {
		return false, fmt.Errorf("inbox: releasing %q for %q: %w", key, consumer, err)
	}
	return n > 0, nil
}
