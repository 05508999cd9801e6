package inboxdb

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// The time-partitioned layout (sqlschema.DB.Partitions).
//
// PostgreSQL has no unique index across partitions: the primary key is
// (consumer, message_key, partition_at), and INSERT ... ON CONFLICT
// (consumer, message_key) cannot detect a key recorded in another
// partition. Every statement that may create a record of (consumer, key)
// therefore first takes a transaction-scoped advisory lock on a hash of
// (table, consumer, key), then looks the key up in every partition, and
// inserts only when it is absent. The lock serialises the creators of one
// key; under READ COMMITTED the look-up, a statement that starts after the
// lock was granted, sees whatever the previous holder committed. A batch
// takes its keys' locks in the order of their hashes, so that two batches
// sharing keys cannot deadlock. Updates by (consumer, key) need no lock.
//
// Under REPEATABLE READ or SERIALIZABLE the transaction's snapshot is taken
// at its first statement, before the lock is granted, so a record committed
// by the previous holder in between would be invisible and inserted again.
// Claims in the caller's transaction (ClaimTx, BeginClaimPgx, ClaimBatchTx)
// refuse those levels with ErrNeedsReadCommitted; the store's own
// transactions (lease claims, Park, retention) are READ COMMITTED.

// ErrNeedsReadCommitted is returned (wrapped) by a claim on the
// partitioned layout in a transaction that is not READ COMMITTED.
var ErrNeedsReadCommitted = errors.New("the partitioned inbox layout needs READ COMMITTED transactions for claims (set default_transaction_isolation = 'read committed' for the consumer's connections, or use the plain layout)")

// isolationMarker starts the text of the error the lock statement raises
// outside READ COMMITTED (an invalid bigint: plain SQL has no RAISE).
const isolationMarker = "watermill-exactlyonce: the partitioned inbox needs READ COMMITTED; this transaction is"

// refreshEvery bounds how often a Store re-reads the newest partition's end.
const refreshEvery = 10 * time.Second

// partitionState caches the end of the newest partition, so that a claim
// at a time with no partition (maintenance fell behind) is recorded in the
// newest one instead of failing.
type partitionState struct {
	layout inboxpart.Layout

	mu      sync.Mutex
	newest  time.Time // end of the newest partition; zero: unknown
	checked time.Time
}

// Partitioned reports whether the store's table uses the partitioned layout.
func (s *Store) Partitioned() bool { return s.part != nil }

// lockKey is the SQL expression of the advisory lock key of (consumer, key)
// given as SQL expressions: a 64-bit hash of the table, the consumer and the
// key, unambiguous because the consumer's length comes first. Two keys
// sharing a hash only wait for each other.
func (s *Store) lockKey(consumer, key string) string {
	return `hashtextextended('` + s.table + `/' || length(` + consumer + `)::text || '/' || ` + consumer + ` || '/' || ` + key + `, 0)`
}

// checkedLock wraps a lock key expression so that it fails outside READ
// COMMITTED with an error naming the isolation level.
func checkedLock(key string) string {
	return `pg_advisory_xact_lock(CASE WHEN current_setting('transaction_isolation') = 'read committed' THEN ` + key +
		` ELSE ('` + isolationMarker + ` ' || current_setting('transaction_isolation'))::bigint END)`
}

// lockErr turns the lock statement's isolation error into
// ErrNeedsReadCommitted.
func lockErr(err error) error {
	if err != nil && strings.Contains(err.Error(), isolationMarker) {
		return fmt.Errorf("%w: %w", ErrNeedsReadCommitted, err)
	}
	return err
}

// partitionAt is the SQL expression of a new record's partition_at: the
// clock, or the end of the newest partition when the clock has passed it
// (no partition was created ahead for now).
func (s *Store) partitionAt(ctx context.Context, db wsql.ContextExecutor) string {
	p := s.part
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	if (p.newest.IsZero() || now.Add(p.layout.Step()).After(p.newest)) && now.Sub(p.checked) > refreshEvery {
		p.checked = now
		if parts, err := p.layout.List(ctx, db); err == nil && len(parts) > 0 {
			p.newest = parts[len(parts)-1].To
		}
	}
	if p.newest.IsZero() || now.Add(p.layout.Step()).Before(p.newest) {
		return `clock_timestamp()`
	}
	return `least(clock_timestamp(), ` + inboxpart.Literal(p.newest.Add(-time.Microsecond)) + `)`
}

// claimInsertPartitioned locks (consumer, key) unless locked, and returns
// the insert of a done record that inserts only when the key has no record.
func (s *Store) claimInsertPartitioned(ctx context.Context, tx wsql.ContextExecutor, consumer, key string, locked bool) (string, error) {
	if !locked {
		if _, err := tx.ExecContext(ctx, `SELECT `+checkedLock(s.lockKey("$1::text", "$2::text")), consumer, key); err != nil {
			return "", lockErr(err)
		}
	}
	return `INSERT INTO ` + s.table + ` (consumer, message_key, status, attempts, processed_at, partition_at)
SELECT $1, $2, 'done', 1, now(), ` + s.partitionAt(ctx, tx) + `
WHERE NOT EXISTS (SELECT 1 FROM ` + s.table + ` WHERE consumer = $1 AND message_key = $2)
RETURNING first_seen_at`, nil
}

// beginClaimPgxPartitioned is BeginClaimPgx on the partitioned layout, in
// two round trips: BEGIN with the key's lock (one simple-protocol query),
// then ClaimTx's statements, which pgx prepares once per connection. One
// round trip would need the look-up and insert in the simple protocol,
// planned anew each time: planning a statement over every partition costs
// more (about 0.3 ms for 13 partitions) than the second round trip.
func (s *Store) beginClaimPgxPartitioned(ctx context.Context, conn *pgx.Conn, consumer, key, qc, qk string) (pgx.Tx, ClaimResult, error) {
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: `BEGIN; SELECT ` + checkedLock(s.lockKey(`'`+qc+`'`, `'`+qk+`'`))})
	if err != nil {
		// A failed BEGIN query may leave conn in an aborted transaction.
		if conn.PgConn().TxStatus() != 'I' && !conn.IsClosed() {
			if _, rbErr := conn.Exec(context.WithoutCancel(ctx), "ROLLBACK"); rbErr != nil {
				return nil, ClaimResult{}, fmt.Errorf("rolling back a failed claim of %q for %q: %w", key, consumer, rbErr)
			}
		}
		return nil, ClaimResult{}, fmt.Errorf("claiming %q for %q: %w", key, consumer, lockErr(err))
	}
	claim, err := s.claimTx(ctx, wsql.TxFromPgx(tx), consumer, key, true)
	if err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, claim, err
	}
	if !claim.Claimed {
		// The duplicate is counted in tx: commit it (the key is recorded
		// whether or not the counter commits).
		_ = tx.Commit(ctx)
		return nil, claim, nil
	}
	return tx, claim, nil
}

// claimBatchPartitioned locks the keys (sorted by lock key) and inserts
// those without a record, returning the keys inserted.
func (s *Store) claimBatchPartitioned(ctx context.Context, tx wsql.ContextExecutor, consumer string, sorted []string) (map[string]bool, error) {
	args := make([]any, 0, len(sorted)+1)
	args = append(args, consumer)
	var values strings.Builder
	for i, k := range sorted {
		if i > 0 {
			values.WriteString(", ")
		}
		values.WriteString("($" + strconv.Itoa(i+2) + "::text)")
		args = append(args, k)
	}
	if _, err := tx.ExecContext(ctx, `SELECT `+checkedLock("h")+` FROM (SELECT DISTINCT `+s.lockKey("$1::text", "v.k")+
		` AS h FROM (VALUES `+values.String()+`) v(k) ORDER BY 1) l`, args...); err != nil {
		return nil, fmt.Errorf("claiming %d keys for %q: %w", len(sorted), consumer, lockErr(err))
	}
	rows, err := tx.QueryContext(ctx, `INSERT INTO `+s.table+` (consumer, message_key, status, attempts, processed_at, partition_at)
SELECT $1, v.k, 'done', 1, now(), `+s.partitionAt(ctx, tx)+` FROM (VALUES `+values.String()+`) v(k)
WHERE NOT EXISTS (SELECT 1 FROM `+s.table+` t WHERE t.consumer = $1 AND t.message_key = v.k)
RETURNING message_key`, args...)
	return claimedKeys(rows, err, len(sorted), consumer)
}

// leaseInsertPartitioned locks (consumer, key), waiting at most
// lockTimeout (then 55P03: busy), and returns lease mode's insert of a
// processing record for an absent key ($1 consumer, $2 key, $3 lease
// seconds, $4 token).
func (s *Store) leaseInsertPartitioned(ctx context.Context, tx wsql.ContextExecutor, consumer, key, lockTimeout string) (string, error) {
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+s.lockKey("$1::text", "$2::text")+
		`) FROM (SELECT set_config('lock_timeout', $3, true)) l`, consumer, key, lockTimeout); err != nil {
		return "", err
	}
	return `INSERT INTO ` + s.table + ` (consumer, message_key, status, attempts, lease_until, lease_token, idempotency_key_format, partition_at)
SELECT $1, $2, 'processing', 1, now() + make_interval(secs => $3), $4::uuid, ` + keyFormatLiteral + `, ` + s.partitionAt(ctx, tx) + `
WHERE NOT EXISTS (SELECT 1 FROM ` + s.table + ` WHERE consumer = $1 AND message_key = $2)
RETURNING ` + recordColumns, nil
}

// parkPartitioned is Park on the partitioned layout, in a READ COMMITTED
// transaction of its own when db can begin one.
func (s *Store) parkPartitioned(ctx context.Context, db wsql.ContextExecutor, consumer, key, reason string) error {
	run := func(tx wsql.ContextExecutor) error {
		if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+s.lockKey("$1::text", "$2::text")+`)`, consumer, key); err != nil {
			return err
		}
		_, err := seam.Exec(ctx, tx, `WITH released AS (
UPDATE `+s.table+` SET status = 'parked', attempts = attempts + 1, processed_at = now(), last_error = $3
WHERE consumer = $1 AND message_key = $2 AND status = 'failed' AND parked_by_transaction RETURNING 1)
INSERT INTO `+s.table+` (consumer, message_key, status, attempts, processed_at, last_error, parked_by_transaction, idempotency_key_format, partition_at)
SELECT $1, $2, 'parked', 1, now(), $3, true, `+keyFormatLiteral+`, `+s.partitionAt(ctx, tx)+`
WHERE NOT EXISTS (SELECT 1 FROM `+s.table+` WHERE consumer = $1 AND message_key = $2)`, consumer, key, reason)
		return err
	}
	b, ok := db.(wsql.Beginner)
	if !ok {
		return run(db)
	}
	tx, err := b.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return err
	}
	if err := run(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// MaintainPartitions creates the partitions missing among the current
// interval and the Ahead intervals after it, and finishes the removal of a
// partition whose DETACH ... CONCURRENTLY was interrupted (it was being
// dropped by retention: every record it still holds is past retention). It
// returns the names of the partitions created. db must not be a
// transaction.
func (s *Store) MaintainPartitions(ctx context.Context, db wsql.Beginner) ([]string, error) {
	if s.part == nil {
		return nil, errors.New("the inbox table is not partitioned (sqlschema.DB.Partitions is nil)")
	}
	l := s.part.layout
	parts, err := l.List(ctx, db)
	if err != nil {
		return nil, err
	}
	for _, p := range parts {
		if p.DetachPending {
			if _, err := db.ExecContext(ctx, `ALTER TABLE `+l.Parent()+` DETACH PARTITION `+l.Quoted(p.Name)+` FINALIZE`); err != nil {
				return nil, fmt.Errorf("finishing the detach of %s: %w", p.Name, err)
			}
			if _, err := db.ExecContext(ctx, `DROP TABLE `+l.Quoted(p.Name)); err != nil {
				return nil, fmt.Errorf("dropping %s: %w", p.Name, err)
			}
		}
	}
	tx, err := db.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return nil, err
	}
	created, err := l.Ensure(ctx, tx)
	if err != nil {
		_ = tx.Rollback()
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, err
	}
	s.part.mu.Lock()
	s.part.checked = time.Time{} // re-read the newest partition at the next claim
	s.part.mu.Unlock()
	return created, nil
}

// keepCondition selects the records retention must keep although their
// partition is past retention: not done (processing, failed, parked), or
// done but finished after the cutoff ($1). It uses the partial index of
// open records and the BRIN index of finish times.
const keepCondition = `(status <> 'done' OR coalesce(processed_at, first_seen_at) >= $1)`

// liveLease selects lease-mode records whose attempt still holds its lease:
// they are not moved (a completion racing the move would fail), so their
// partition waits for the next purge.
const liveLease = `(status = 'processing' AND lease_until > now())`

// purgePartitions is Purge on the partitioned layout: every partition that
// ended before the cutoff has the records it must keep moved into the
// current partition (under their keys' locks), then is detached
// concurrently and dropped.
func (s *Store) purgePartitions(ctx context.Context, db wsql.Beginner, opts PurgeOptions) (int64, error) {
	l := s.part.layout
	var cutoff time.Time
	var parts []inboxpart.Partition
	locked, err := s.underPurgeLock(ctx, db, func(tx wsql.Tx) error {
		if err := seam.QueryRow(ctx, tx, `SELECT now() - make_interval(secs => $1)`, []any{opts.OlderThan.Seconds()}, &cutoff); err != nil {
			return err
		}
		var err error
		parts, err = l.List(ctx, tx)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("purge: %w", err)
	}
	if !locked {
		return 0, ErrPurgeRunning
	}
	if _, err := s.MaintainPartitions(ctx, db); err != nil {
		return 0, fmt.Errorf("purge: %w", err)
	}

	var total int64
	dropped := 0
	for _, p := range parts {
		if !p.To.After(cutoff) && !p.DetachPending && (opts.MaxBatches == 0 || dropped < opts.MaxBatches) {
			n, done, err := s.dropPartition(ctx, db, p, cutoff, opts.BatchSize)
			total += n
			if err != nil {
				return total, err
			}
			if done {
				dropped++
				if opts.Progress != nil {
					opts.Progress(n)
				}
			}
		}
	}
	return total, nil
}

// dropPartition moves the records p must keep, then detaches and drops p.
// It returns the records dropped, and false when p was kept because a
// record in it holds a live lease.
func (s *Store) dropPartition(ctx context.Context, db wsql.Beginner, p inboxpart.Partition, cutoff time.Time, batch int) (int64, bool, error) {
	l := s.part.layout
	q := l.Quoted(p.Name)
	inRange := `partition_at >= ` + inboxpart.Literal(p.From) + ` AND partition_at < ` + inboxpart.Literal(p.To)
	for {
		if err := ctx.Err(); err != nil {
			return 0, false, err
		}
		var moved int64
		var live bool
		locked, err := s.underPurgeLock(ctx, db, func(tx wsql.Tx) error {
			rows, err := tx.QueryContext(ctx, `SELECT consumer, message_key FROM `+q+` WHERE `+keepCondition+` AND NOT `+liveLease+` LIMIT $2`, cutoff, batch)
			if err != nil {
				return err
			}
			var cs, ks []any
			var values []string
			for rows.Next() {
				var c, k string
				if err := rows.Scan(&c, &k); err != nil {
					_ = rows.Close()
					return err
				}
				values = append(values, "($"+strconv.Itoa(2*len(cs)+2)+"::text, $"+strconv.Itoa(2*len(cs)+3)+"::text)")
				cs, ks = append(cs, c), append(ks, k)
			}
			if err := seam.Close(rows); err != nil {
				return err
			}
			if len(cs) == 0 {
				return seam.QueryRow(ctx, tx, `SELECT EXISTS (SELECT 1 FROM `+q+` WHERE `+liveLease+`)`, nil, &live)
			}
			args := []any{cutoff}
			for i := range cs {
				args = append(args, cs[i], ks[i])
			}
			vals := strings.Join(values, ", ")
			// The keys' locks, in hash order, as every claim takes them:
			// no claim runs for these keys while their records move.
			lockVals := make([]string, len(cs))
			for i := range cs {
				lockVals[i] = "($" + strconv.Itoa(2*i+1) + "::text, $" + strconv.Itoa(2*i+2) + "::text)"
			}
			if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock(h) FROM (SELECT DISTINCT `+s.lockKey("v.c", "v.k")+
				` AS h FROM (VALUES `+strings.Join(lockVals, ", ")+`) v(c, k) ORDER BY 1) l`, args[1:]...); err != nil {
				return err
			}
			moved, err = seam.Exec(ctx, tx, `UPDATE `+s.table+` SET partition_at = `+s.partitionAt(ctx, tx)+`
WHERE `+inRange+` AND (consumer, message_key) IN (SELECT v.c, v.k FROM (VALUES `+vals+`) v(c, k))
AND `+keepCondition+` AND NOT `+liveLease, args...)
			return err
		})
		if err != nil {
			return 0, false, fmt.Errorf("purge: moving the records to keep out of %s: %w", p.Name, err)
		}
		if !locked {
			return 0, false, ErrPurgeRunning
		}
		if live {
			return 0, false, nil
		}
		if moved == 0 {
			break
		}
	}

	// No lock is held from here: DETACH ... CONCURRENTLY cannot run in a
	// transaction. Its SHARE UPDATE EXCLUSIVE lock on the table excludes
	// another purge's detach; one that finds p gone stops.
	if _, err := db.ExecContext(ctx, `ALTER TABLE `+l.Parent()+` DETACH PARTITION `+q+` CONCURRENTLY`); err != nil {
		if still, lerr := s.attached(ctx, db, p.Name); lerr == nil && !still {
			return 0, false, fmt.Errorf("%w (%s was detached by it): %w", ErrPurgeRunning, p.Name, err)
		}
		return 0, false, fmt.Errorf("purge: detaching %s: %w", p.Name, err)
	}
	var n int64
	var open bool
	if err := seam.QueryRow(ctx, db, `SELECT count(*), coalesce(bool_or(status <> 'done'), false) FROM `+q, nil, &n, &open); err != nil {
		return 0, false, fmt.Errorf("purge: counting %s: %w", p.Name, err)
	}
	if open {
		// Never expected (the records to keep were moved, and no claim
		// writes into a past partition); put it back rather than lose one.
		_, aerr := db.ExecContext(ctx, `ALTER TABLE `+l.Parent()+` ATTACH PARTITION `+q+
			` FOR VALUES FROM (`+inboxpart.Literal(p.From)+`) TO (`+inboxpart.Literal(p.To)+`)`)
		if aerr != nil {
			return 0, false, fmt.Errorf("purge: %s still held open records after they were moved, and attaching it again failed: %w", p.Name, aerr)
		}
		return 0, false, fmt.Errorf("purge: %s still held open records after they were moved; it was attached again", p.Name)
	}
	if _, err := db.ExecContext(ctx, `DROP TABLE `+q); err != nil {
		return 0, false, fmt.Errorf("purge: dropping %s: %w", p.Name, err)
	}
	return n, true, nil
}

// attached reports whether name is still an attached partition of the table.
func (s *Store) attached(ctx context.Context, db wsql.ContextExecutor, name string) (bool, error) {
	parts, err := s.part.layout.List(ctx, db)
	if err != nil {
		return false, err
	}
	for _, p := range parts {
		if p.Name == name && !p.DetachPending {
			return true, nil
		}
	}
	return false, nil
}
