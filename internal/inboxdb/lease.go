package inboxdb

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// ErrLeaseLost means the caller's attempt no longer owns the key: its lease
// expired and another worker took the key over (the key's lease token moved
// on), or an operator changed or forgot the record.
var ErrLeaseLost = errors.New("lease lost")

// LeaseOutcome is what ClaimLease decided.
type LeaseOutcome int

const (
	// LeaseAcquired: the caller owns the key until LeaseUntil and runs the
	// handler as attempt Attempt, fenced by Token.
	LeaseAcquired LeaseOutcome = iota + 1
	// LeaseDuplicate: the key is done; do not run it.
	LeaseDuplicate
	// LeaseBusy: another worker holds a live lease, or is in the middle of
	// its claim, extension or completion; do not run it, and do not ack
	// either: the holder may still fail.
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

// LeaseOptions configures ClaimLease.
type LeaseOptions struct {
	// Lease is how long the claim keeps other workers off the key. Required
	// (> 0).
	Lease time.Duration
	// MaxInterrupted parks a key once this many of
	// its attempts were interrupted. 0 means no bound.
	MaxInterrupted int
	// Message is the message being delivered: the claim that parks the
	// key (MaxInterrupted reached) keeps it with the park, as Park does.
	// Nil keeps nothing.
	Message *ParkedMessage
}

// LeaseClaim is the result of ClaimLease.
type LeaseClaim struct {
	Outcome LeaseOutcome
	// Attempt is the attempt number the caller runs (LeaseAcquired), or
	// the record's attempts otherwise.
	Attempt int
	// Token fences the attempt (LeaseAcquired): ExtendLease, CompleteTx,
	// Fail and ParkInterrupted act only while the record still carries it.
	// Every claim gets a new one.
	Token string
	// Interrupted is true when this attempt follows one whose outcome is
	// unknown (its lease expired while processing, or its completion failed
	// after the handler ran).
	Interrupted bool
	// ParkedNow is true when this call parked the key (MaxInterrupted
	// reached).
	ParkedNow bool
	// LeaseUntil is when the caller's lease ends (LeaseAcquired), or the
	// holder's (LeaseBusy, when known).
	LeaseUntil time.Time
	// Record is the key's record after the claim (zero for LeaseBusy when
	// the record was locked by another transaction).
	Record Record
}

// claimLockTimeout bounds how long a claim waits for another transaction
// holding the key's record (another claim, or a completion about to commit)
// before it reports LeaseBusy: long enough for a commit, short enough that
// redeliveries of a key whose holder keeps its completion transaction open
// never pile up on its row lock.
const claimLockTimeout = time.Second

// lockNotAvailable is PostgreSQL's SQLSTATE when lock_timeout expires.
const lockNotAvailable = "55P03"

// claimRestoreTimeout bounds the statement that puts a MySQL session's
// innodb_lock_wait_timeout back after a claim (claimLeaseMySQL), which
// runs also when the claim's context ended.
const claimRestoreTimeout = 5 * time.Second

// mysqlLockWaitTimeout is MySQL's error when innodb_lock_wait_timeout
// expires (ER_LOCK_WAIT_TIMEOUT).
const mysqlLockWaitTimeout = 1205

// lockWaitExpired reports whether err says that a claim waited its
// claimLockTimeout for a record another transaction holds.
func lockWaitExpired(err error) bool {
	if n, ok := pgerr.MySQLNumber(err); ok {
		return n == mysqlLockWaitTimeout
	}
	return pgerr.Code(err) == lockNotAvailable
}

// leaseMySQL reports whether s runs lease.sql's MySQL statements, which
// stand in for RETURNING with a read after each change (claimLeaseMySQL).
func (s *Store) leaseMySQL() bool { return s.cfg.Tables.Dialect == sqlschema.MySQL }

// ClaimLease claims (consumer, key) for lease mode in a short transaction of
// its own (READ COMMITTED, whatever the database's default), committed
// before it returns, so that other workers see the lease while the caller
// runs its handler:
//
//   - no record: inserted as processing, attempt 1 (LeaseAcquired);
//   - done: duplicate counted (LeaseDuplicate);
//   - parked: duplicate counted (LeaseParked);
//   - failed (a previous attempt returned an error, or an operator released
//     the key): processing again, attempts+1 (LeaseAcquired);
//   - processing with a live lease, or held by another transaction for
//     longer than a moment: LeaseBusy, nothing changed;
//   - processing with an expired lease: the attempt was interrupted
//     (interruptions+1); by policy, processing again with attempts+1 and
//     Interrupted, or, once MaxInterrupted of its attempts were interrupted,
//     parked with the reason in last_error (LeaseParked with ParkedNow).
//
// Each acquired claim carries a new Token. On the partitioned layout, a
// claim that met ErrPartitionsChanged runs again in a new transaction; on
// MySQL/MariaDB, so does a claim InnoDB chose as a deadlock's victim.
func (s *Store) ClaimLease(ctx context.Context, db wsql.Beginner, consumer, key string, opts LeaseOptions) (LeaseClaim, error) {
	if err := s.ValidateKey(consumer, key); err != nil {
		return LeaseClaim{}, err
	}
	if opts.Lease <= 0 {
		return LeaseClaim{}, fmt.Errorf("lease must be > 0, got %s", opts.Lease)
	}
	if opts.MaxInterrupted < 0 {
		return LeaseClaim{}, fmt.Errorf("MaxInterrupted must be >= 0, got %d", opts.MaxInterrupted)
	}
	for try := 1; ; try++ {
		beginCtx := ctx
		if s.leaseMySQL() {
			// The transaction outlives ctx (database/sql would roll it back
			// and pool its connection the moment ctx ends), so that the
			// claim can put the session's setting back first
			// (claimLeaseMySQL); its statements still end with ctx.
			beginCtx = context.WithoutCancel(ctx)
		}
		tx, err := db.BeginTx(beginCtx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
		if err != nil {
			return LeaseClaim{}, fmt.Errorf("lease claim of %q for %q: begin: %w", key, consumer, err)
		}
		var lc LeaseClaim
		if s.leaseMySQL() {
			lc, err = s.claimLeaseMySQL(ctx, tx, consumer, key, opts)
		} else {
			lc, err = s.claimLease(ctx, tx, consumer, key, opts, 3)
		}
		if err != nil {
			_ = tx.Rollback()
			if lockWaitExpired(err) {
				return LeaseClaim{Outcome: LeaseBusy}, nil
			}
			if s.leaseMySQL() && try < claimRetries && pgerr.SerializationFailure(err) {
				continue // a deadlock's victim (1213), rolled back: claim again
			}
			if err = s.partitionsChanged(err); try < claimRetries && errors.Is(err, ErrPartitionsChanged) {
				continue // the partitions changed: claim again where the database says
			}
			return LeaseClaim{}, fmt.Errorf("lease claim of %q for %q: %w", key, consumer, err)
		}
		if err := ctx.Err(); err != nil && s.leaseMySQL() {
			_ = tx.Rollback() // ended meanwhile: as the transaction bound to ctx would
			return LeaseClaim{}, fmt.Errorf("lease claim of %q for %q: %w", key, consumer, err)
		}
		if err := tx.Commit(); err != nil {
			return LeaseClaim{}, fmt.Errorf("lease claim of %q for %q: commit: %w", key, consumer, err)
		}
		return lc, nil
	}
}

func (s *Store) claimLease(ctx context.Context, tx wsql.Tx, consumer, key string, opts LeaseOptions, tries int) (LeaseClaim, error) {
	leaseSecs := opts.Lease.Seconds()
	token := watermill.NewUUID() // random (version 4): every claim its own
	var rec Record
	lockTimeout := strconv.FormatInt(claimLockTimeout.Milliseconds(), 10)
	// The plain layout's insert sets the transaction's lock_timeout for
	// the statements that follow (the row lock below), in the same round
	// trip (a CTE).
	insert, args := s.q.get("LeaseInsert"), []any{consumer, key, leaseSecs, token, lockTimeout}
	if s.part != nil {
		// The key's lock, waiting at most lock_timeout, then the insert.
		var err error
		if insert, args, err = s.leaseInsertPartitioned(ctx, tx, consumer, key, leaseSecs, token, lockTimeout); err != nil {
			return LeaseClaim{}, err
		}
	}
	err := seam.QueryRow(ctx, tx, insert, args, rec.scanDest()...)
	if err == nil {
		return LeaseClaim{Outcome: LeaseAcquired, Attempt: 1, Token: token, LeaseUntil: *rec.LeaseUntil, Record: rec}, nil
	}
	if !notFound(err) {
		return LeaseClaim{}, err
	}

	var expired bool
	err = seam.QueryRow(ctx, tx, s.q.get("LeaseLockRecord"), []any{consumer, key}, append(rec.scanDest(), &expired)...)
	if notFound(err) {
		// Deleted between the two statements (Forget, Purge): a
		// conflict-free retry of the insert is the simplest correct answer.
		if tries <= 1 {
			return LeaseClaim{}, errors.New("the record kept disappearing (concurrent Forget or Purge)")
		}
		return s.claimLease(ctx, tx, consumer, key, opts, tries-1)
	}
	if err != nil {
		return LeaseClaim{}, err
	}

	// update runs one of lease.sql's updates of the record ($1 consumer,
	// $2 key, then args).
	update := func(name string, args ...any) (Record, error) {
		var out Record
		err := seam.QueryRow(ctx, tx, s.q.get(name), append([]any{consumer, key}, args...), out.scanDest()...)
		return out, err
	}
	park := func(reason string) (Record, error) {
		if opts.Message == nil {
			return update("LeasePark", reason)
		}
		// The message is kept by the same statement.
		var out Record
		err := seam.QueryRow(ctx, tx, s.q.get("LeaseParkKeep"), append(opts.Message.Row().args(), consumer, key, reason), out.scanDest()...)
		return out, err
	}
	return decideLease(rec, expired, token, leaseSecs, opts, update, park)
}

// decideLease is what a claim does with the key's record rec, which its
// transaction holds (locked), when the claim did not insert it: see
// ClaimLease. expired tells whether rec's lease is over; token and lease
// (the dialect's parameter) are the ones a new attempt gets. update runs
// one of lease.sql's updates of the record with args and returns the
// record after it; park parks the record with reason (keeping
// opts.Message).
func decideLease(rec Record, expired bool, token string, lease any, opts LeaseOptions,
	update func(name string, args ...any) (Record, error), park func(reason string) (Record, error)) (LeaseClaim, error) {
	switch {
	case rec.Status == StatusDone, rec.Status == StatusDiscarded:
		out, err := update("LeaseCountDuplicate")
		return LeaseClaim{Outcome: LeaseDuplicate, Attempt: out.Attempts, Record: out}, err
	case rec.Status == StatusParked:
		out, err := update("LeaseCountDuplicate")
		return LeaseClaim{Outcome: LeaseParked, Attempt: out.Attempts, Record: out}, err
	case rec.Status == StatusFailed:
		// A failed record that was parked after an interrupted attempt and
		// then released keeps the interruption: the effect is still unknown.
		out, err := update("LeaseRetry", lease, token)
		if err != nil {
			return LeaseClaim{}, err
		}
		return LeaseClaim{Outcome: LeaseAcquired, Attempt: out.Attempts, Token: token, Interrupted: rec.Interrupted,
			LeaseUntil: *out.LeaseUntil, Record: out}, nil
	case !expired:
		lc := LeaseClaim{Outcome: LeaseBusy, Attempt: rec.Attempts, Record: rec}
		if rec.LeaseUntil != nil {
			lc.LeaseUntil = *rec.LeaseUntil
		}
		return lc, nil
	case opts.MaxInterrupted > 0 && rec.Interruptions+1 >= opts.MaxInterrupted:
		reason := fmt.Sprintf("lease expired during attempt %d: the worker stopped mid-attempt; whether its effect happened is unknown", rec.Attempts)
		reason += fmt.Sprintf(" (%d interrupted attempts; retries stop at %d)", rec.Interruptions+1, opts.MaxInterrupted)
		out, err := park(reason)
		return LeaseClaim{Outcome: LeaseParked, ParkedNow: true, Attempt: out.Attempts, Record: out}, err
	default:
		out, err := update("LeaseRetryInterrupted", lease, token)
		if err != nil {
			return LeaseClaim{}, err
		}
		return LeaseClaim{Outcome: LeaseAcquired, Attempt: out.Attempts, Token: token, Interrupted: true,
			LeaseUntil: *out.LeaseUntil, Record: out}, nil
	}
}

// claimLeaseMySQL is claimLease on MySQL/MariaDB (queries/mysql/lease.sql),
// where no statement returns the rows it changed. The session's
// innodb_lock_wait_timeout is claimLockTimeout for the claim's statements
// (LeaseLockWait), and put back before the claim commits. LeaseInsert
// inserts the record as attempt 1 with the claim's token, or takes the
// existing record's row lock (waiting for the transaction that holds it);
// either way tx then holds the record, and LeaseLockRecord reads it with a
// locking read, which sees the latest committed row under any isolation
// level. The record carries the claim's token only when LeaseInsert
// inserted it (every claim's token is new); otherwise decideLease decides,
// each update followed by a read of the record (LeaseRecord) in tx.
func (s *Store) claimLeaseMySQL(ctx context.Context, tx wsql.Tx, consumer, key string, opts LeaseOptions) (lc LeaseClaim, err error) {
	if _, err := seam.Exec(ctx, tx, s.q.get("LeaseLockWait")); err != nil {
		return LeaseClaim{}, err
	}
	defer func() {
		// Not transactional: put back also after a failure, and after ctx
		// ended (a connection a statement failed on for good, or that ctx
		// interrupted mid-statement, is closed by the driver, never
		// pooled).
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), claimRestoreTimeout)
		defer cancel()
		if _, rerr := seam.Exec(rctx, tx, s.q.get("LeaseLockWaitRestore")); rerr != nil && err == nil {
			lc, err = LeaseClaim{}, rerr
		}
	}()
	lease := opts.Lease.Microseconds()
	token := watermill.NewUUID() // random (version 4): every claim its own
	if _, err := seam.Exec(ctx, tx, s.q.get("LeaseInsert"), consumer, key, lease, token); err != nil {
		return LeaseClaim{}, err
	}
	var rec Record
	var expired bool
	var holder string
	err = seam.QueryRow(ctx, tx, s.q.get("LeaseLockRecord"), []any{consumer, key}, append(rec.scanDest(), &expired, &holder)...)
	if notFound(err) {
		return LeaseClaim{}, errors.New("the record vanished under its row lock")
	}
	if err != nil {
		return LeaseClaim{}, err
	}
	if holder == token {
		return LeaseClaim{Outcome: LeaseAcquired, Attempt: 1, Token: token, LeaseUntil: *rec.LeaseUntil, Record: rec}, nil
	}
	// update runs one of lease.sql's updates of the record (args, then
	// consumer and key) and reads the record back.
	update := func(name string, args ...any) (Record, error) {
		var out Record
		if _, err := seam.Exec(ctx, tx, s.q.get(name), append(args, consumer, key)...); err != nil {
			return out, err
		}
		err := seam.QueryRow(ctx, tx, s.q.get("LeaseRecord"), []any{consumer, key}, out.scanDest()...)
		return out, err
	}
	park := func(reason string) (Record, error) {
		out, err := update("LeasePark", reason)
		if err != nil || opts.Message == nil {
			return out, err
		}
		// The message is kept in the same transaction.
		_, err = seam.Exec(ctx, tx, s.q.get("KeepParked"), append(opts.Message.Row().args(), consumer, key)...)
		return out, err
	}
	return decideLease(rec, expired, token, lease, opts, update, park)
}

// ExtendLease moves the lease of the attempt fenced by token to now +
// lease. It returns the new end, or ErrLeaseLost when the attempt no longer
// owns the key.
//
// On a pool or *sql.DB it commits at once, so that other workers see it. On
// the attempt's own completion transaction it holds the record's row lock
// until that transaction ends, which keeps every other claim off the key
// (they report LeaseBusy) even after lease_until passes; its new end becomes
// visible at commit. Either way it needs no connection beyond the one it is
// given.
func (s *Store) ExtendLease(ctx context.Context, db wsql.ContextExecutor, consumer, key, token string, lease time.Duration) (time.Time, error) {
	if lease <= 0 {
		return time.Time{}, fmt.Errorf("lease must be > 0, got %s", lease)
	}
	if err := s.lockRecord(ctx, db, consumer, key); err != nil {
		return time.Time{}, fmt.Errorf("extending lease of %q for %q: %w", key, consumer, err)
	}
	var until time.Time
	err := retryStatement(db, func() error {
		if s.leaseMySQL() {
			// No RETURNING: the update, then a locking read of what it
			// wrote, fenced by the token too (a record never gets an old
			// token back). Not the update's affected rows: MySQL counts a
			// row whose value did not change as unaffected.
			if _, err := seam.Exec(ctx, db, s.q.get("ExtendLease"), lease.Microseconds(), consumer, key, tokenArg(token)); err != nil {
				return err
			}
			return seam.QueryRow(ctx, db, s.q.get("LeaseUntilOf"), []any{consumer, key, tokenArg(token)}, &until)
		}
		return seam.QueryRow(ctx, db, s.q.get("ExtendLease"), []any{consumer, key, tokenArg(token), lease.Seconds()}, &until)
	})
	if notFound(err) {
		return time.Time{}, fmt.Errorf("%w: %q for %q", ErrLeaseLost, key, consumer)
	}
	if err != nil {
		return time.Time{}, fmt.Errorf("extending lease of %q for %q: %w", key, consumer, err)
	}
	return until, nil
}

// CompleteTx records the attempt fenced by token as done inside tx, the
// transaction that also holds the handler's writes and output messages. It
// returns ErrLeaseLost (and the caller must roll back) when the attempt no
// longer owns the key. On the partitioned layout it first takes the key's
// lock in tx, so that it finds the record where a purge moved it (see
// lockRecord); ExtendLease does the same in a transaction.
func (s *Store) CompleteTx(ctx context.Context, tx wsql.ContextExecutor, consumer, key, token string) error {
	if err := s.lockRecord(ctx, tx, consumer, key); err != nil {
		return fmt.Errorf("completing %q for %q: %w", key, consumer, err)
	}
	n, err := seam.Exec(ctx, tx, s.q.get("CompleteLease"), consumer, key, tokenArg(token))
	if err != nil {
		return fmt.Errorf("completing %q for %q: %w", key, consumer, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %q for %q", ErrLeaseLost, key, consumer)
	}
	return nil
}

// Owns reports whether the attempt fenced by token still owns (consumer,
// key): the record is processing with that token.
func (s *Store) Owns(ctx context.Context, db wsql.ContextExecutor, consumer, key, token string) (bool, error) {
	var n int64
	err := seam.QueryRow(ctx, db, s.q.get("Owns"), []any{consumer, key, tokenArg(token)}, &n)
	if err != nil {
		return false, fmt.Errorf("checking the lease of %q for %q: %w", key, consumer, err)
	}
	return n > 0, nil
}

// Attempt names a lease-mode attempt for Fail and ParkInterrupted: the key
// it processes, the token that fences it (ClaimLease's), and the message a
// park keeps with it, in the same statement (as Park does; nil keeps
// nothing).
type Attempt struct {
	Consumer, Key, Token string
	Message              *ParkedMessage
}

// Fail records that attempt a failed with errText: status failed (the next
// delivery runs it again), or parked when permanent (it waits for an
// operator), keeping a.Message with the park. It returns ErrLeaseLost
// when the attempt no longer owns the key.
func (s *Store) Fail(ctx context.Context, db wsql.ContextExecutor, a Attempt, errText string, permanent bool) error {
	if !permanent {
		return s.finish(ctx, db, finishParams{Attempt: Attempt{Consumer: a.Consumer, Key: a.Key, Token: a.Token},
			what: "recording failure", statement: "FinishFailed", text: pgtext.Truncate(errText)})
	}
	return s.finish(ctx, db, finishParams{Attempt: a, what: "recording failure", statement: "FinishParked", text: pgtext.Truncate(errText)})
}

// ParkInterrupted parks the key of attempt a after its handler ran but its
// completion could never commit (an output the outbox refuses, a
// constraint failing at COMMIT): the external effect probably happened and
// is not recorded, and repeating the attempt would repeat the effect and
// fail the same way. The record is parked with reason, marked interrupted
// (a released attempt is told), and its interruptions counted; a.Message
// is kept with it in the same statement. It returns ErrLeaseLost when the
// attempt no longer owns the key.
func (s *Store) ParkInterrupted(ctx context.Context, db wsql.ContextExecutor, a Attempt, reason string) error {
	return s.finish(ctx, db, finishParams{Attempt: a, what: "parking", statement: "FinishInterrupted", text: pgtext.Truncate(reason)})
}

// finishParams names what finish does: which attempt it ends, with which
// statement of lease.sql (FinishFailed, FinishParked, FinishInterrupted;
// with "Keep" when msg is kept), and the error text or reason it records.
type finishParams struct {
	Attempt          // the message is kept by parking statements only
	what      string // for the error: "recording failure", "parking"
	statement string
	text      string
}

// finish ends the processing attempt p with p.statement, releasing the
// lease and stamping processed_at. With a parking statement, p.Message
// (if any) is kept by the same statement.
func (s *Store) finish(ctx context.Context, db wsql.ContextExecutor, p finishParams) error {
	if err := s.lockRecord(ctx, db, p.Consumer, p.Key); err != nil {
		return fmt.Errorf("%s %q for %q: %w", p.what, p.Key, p.Consumer, err)
	}
	if s.leaseMySQL() {
		return s.finishMySQL(ctx, db, p)
	}
	q, args := s.q.get(p.statement), []any{p.Consumer, p.Key, tokenArg(p.Token), p.text}
	if p.Message != nil {
		// One row kept per record parked: the count is the update's.
		q, args = s.q.get(p.statement+"Keep"), append(p.Message.Row().args(), args...)
	}
	var n int64
	err := retryStatement(db, func() error {
		var err error
		n, err = seam.Exec(ctx, db, q, args...)
		return err
	})
	if err != nil {
		return fmt.Errorf("%s %q for %q: %w", p.what, p.Key, p.Consumer, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %q for %q", ErrLeaseLost, p.Key, p.Consumer)
	}
	return nil
}

// finishMySQL is finish on MySQL/MariaDB: the text first, then the
// attempt (queries/mysql/lease.sql). Its statements change the status, so
// their affected rows say whether the attempt owned the key. A park that
// keeps p.Message runs KeepParked after the update, in db when it is a
// transaction, else in a transaction of its own.
func (s *Store) finishMySQL(ctx context.Context, db wsql.ContextExecutor, p finishParams) error {
	args := []any{p.text, p.Consumer, p.Key, tokenArg(p.Token)}
	run := func(db wsql.ContextExecutor) (int64, error) {
		n, err := seam.Exec(ctx, db, s.q.get(p.statement), args...)
		if err != nil || n == 0 || p.Message == nil {
			return n, err
		}
		_, err = seam.Exec(ctx, db, s.q.get("KeepParked"), append(p.Message.Row().args(), p.Consumer, p.Key)...)
		return n, err
	}
	var n int64
	err := retryStatement(db, func() error {
		_, inTx := db.(wsql.Tx)
		b, beginner := db.(wsql.Beginner)
		if p.Message == nil || inTx || !beginner {
			if p.Message != nil && !inTx {
				return errors.New("keeping the parked message needs a transaction or a handle that begins one")
			}
			var err error
			n, err = run(db)
			return err
		}
		tx, err := b.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if n, err = run(tx); err != nil {
			_ = tx.Rollback()
			return err
		}
		return tx.Commit()
	})
	if err != nil {
		return fmt.Errorf("%s %q for %q: %w", p.what, p.Key, p.Consumer, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %q for %q", ErrLeaseLost, p.Key, p.Consumer)
	}
	return nil
}

// tokenArg passes a token as a uuid parameter; an empty or malformed token
// matches no record instead of failing the statement.
func tokenArg(token string) any {
	if len(token) != 36 {
		return nil
	}
	return token
}

// lockRecord takes the key's lock in db when db is a transaction on the
// partitioned layout, before a statement that updates the key's record by
// (consumer, key) without creating one (an extension, completion or
// failure of a lease-mode attempt). Retention moves a record to another
// partition with one UPDATE under the key's lock, and PostgreSQL cannot
// follow a moved row: an UPDATE that waited for the move, or whose snapshot
// predates it, fails with a serialization failure ("tuple to be locked was
// already moved to another partition due to concurrent update", 40001),
// which would fail the attempt's completion after its handler ran. With
// the lock taken first, the UPDATE is a later statement that, under READ
// COMMITTED, sees the record where the move put it. (Under REPEATABLE READ
// or SERIALIZABLE the transaction's snapshot may still predate the move:
// the 40001 remains possible there.) A statement that is its own
// transaction needs no lock: retryStatement runs it again after a 40001.
//
// The lock is taken before any row lock on the record, in the order the
// move takes them, so the two cannot deadlock.
func (s *Store) lockRecord(ctx context.Context, db wsql.ContextExecutor, consumer, key string) error {
	if s.part == nil {
		return nil
	}
	if _, inTx := db.(wsql.Tx); !inTx {
		return nil
	}
	return s.part.locks.lockKey(ctx, db, consumer, key)
}

// retryStatement runs one statement that is its own transaction (db is a
// pool or *sql.DB, not a transaction) again when it failed with a
// serialization failure: under a REPEATABLE READ or SERIALIZABLE default, an
// UPDATE of a row another transaction changed while it waited fails instead
// of re-reading the row, and the next statement takes a fresh snapshot. In a
// caller's transaction nothing is retried.
func retryStatement(db wsql.ContextExecutor, run func() error) error {
	_, inTx := db.(wsql.Tx)
	for try := 1; ; try++ {
		err := run()
		if err == nil || inTx || try == 3 || !pgerr.SerializationFailure(err) {
			return err
		}
	}
}

// ListParked returns up to limit parked records of consumer (all consumers
// when empty), oldest first.
func (s *Store) ListParked(ctx context.Context, db wsql.ContextExecutor, consumer string, limit int) ([]Record, error) {
	if limit <= 0 {
		limit = 100
	}
	q, args := s.q.get("ListParked"), []any{limit}
	if consumer != "" {
		q, args = s.q.get("ListParkedOf"), []any{consumer, limit}
	}
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("listing parked keys: %w", err)
	}
	var out []Record
	for rows.Next() {
		var rec Record
		if err := rows.Scan(rec.scanDest()...); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("listing parked keys: %w", err)
		}
		out = append(out, rec)
	}
	if err := seam.Close(rows); err != nil {
		return nil, fmt.Errorf("listing parked keys: %w", err)
	}
	return out, nil
}

// Release turns a parked key back into failed, so that its next delivery
// runs again (attempts+1, same idempotency key); for retention the record
// counts as finished now. It reports whether a parked record was found. The broker acked the parked message: the next
// delivery is a re-publish or a later duplicate.
func (s *Store) Release(ctx context.Context, db wsql.ContextExecutor, consumer, key string) (bool, error) {
	var n int64
	err := retryStatement(db, func() error { // a purge's move of the record: see Forget
		var err error
		n, err = seam.Exec(ctx, db, s.q.get("Release"), consumer, key)
		return err
	})
	if err != nil {
		return false, fmt.Errorf("releasing %q for %q: %w", key, consumer, err)
	}
	return n > 0, nil
}
