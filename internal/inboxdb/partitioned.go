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
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
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
// outside READ COMMITTED (an invalid bigint: plain SQL has no RAISE), and
// the claim functions' (RAISE).
const isolationMarker = inboxpart.IsolationMarker

// refreshEvery bounds how often a Store re-reads the newest partition's end.
const refreshEvery = 10 * time.Second

// fallbackLockClass is the first key of the fallback lock, in the two-key
// advisory lock space (the claims' per-key locks use the one-key space);
// the second is a hash of the table's name. Every statement that may
// record a key in the newest partition rather than in the one covering now
// (a fallback write, see placement) holds it shared from its transaction's
// first statement to its end; Purge takes it exclusively, once a partition
// covers now, before it looks for the records a partition past retention
// must keep (fenceFallbackWrites).
const fallbackLockClass = 0x656f7066 // "eopf"

// partitionState caches the end of the newest partition, so that claims
// can tell, without asking the database, whether a partition covers now
// (the usual case: they record their key at clock_timestamp()) or
// maintenance fell behind (they record it in the newest partition, see
// placement).
type partitionState struct {
	layout inboxpart.Layout
	// newestEnd is the SQL expression of the newest attached partition's
	// end, read from the catalog by the statement that uses it.
	newestEnd string

	// mu guards the fields below, and is never held across a round trip:
	// a claim waiting for it in a transaction holds a connection (behind
	// PgBouncer, a server connection), and a look-up made under it could
	// be the one waiting for that connection.
	mu      sync.Mutex
	newest  time.Time // end of the newest partition; zero: unknown
	checked time.Time
	// gen counts what made the cache stale (a claim found no partition,
	// maintenance created some): a look-up that began before does not
	// store what it read.
	gen    uint64
	pinned time.Time // tests only: the newest partition's end, instead of newestEnd

	funcs funcState // the claim functions (partitioned_func.go)
}

// newestEndSQL is the SQL expression of the end of l's newest attached
// partition (detached or being detached ones excluded), read from the
// catalog: partition names encode their start (inboxpart), and the largest
// name is the newest. NULL when the table has none.
func newestEndSQL(l inboxpart.Layout) string {
	digits, hour, step := "8", "0", "1 day"
	if l.Hourly {
		digits, hour, step = "10", "substr(n.d, 9, 2)::int", "1 hour"
	}
	prefix := l.Table + "_p"
	// relname::text keeps the planner from scanning pg_class's name index
	// for the prefix in every schema: the look-up starts from pg_inherits.
	return `(SELECT make_timestamptz(substr(n.d, 1, 4)::int, substr(n.d, 5, 2)::int, substr(n.d, 7, 2)::int, ` + hour + `, 0, 0, 'UTC') + interval '` + step + `'
FROM (SELECT substr(max(c.relname::text), ` + strconv.Itoa(len(prefix)+1) + `) AS d FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = '` + l.Parent() + `'::regclass AND NOT i.inhdetachpending AND c.relname::text ~ '^` + prefix + `[0-9]{` + digits + `}$') n)`
}

// placement is where a claim records a new key, decided once per claim
// before its first statement, so that its lock statement and its insert
// agree.
//
// Usually a partition covers now and the record goes in at
// clock_timestamp(): retention never removes that partition (it ends after
// now, so after any cutoff). When maintenance fell behind (no partition
// covers now, or the newest ends within one interval), the record goes into
// the newest partition, at least(clock_timestamp(), its end - 1µs): a
// fallback write. That partition may be past retention and about to be
// removed, so a fallback write
//
//  1. holds the fallback lock shared, taken in its transaction's first
//     statement, the one that takes the key's lock, before any access to the
//     table; and
//  2. reads the newest partition's end from the catalog in its insert, a
//     later statement, never from this cache, which may predate the
//     partitions a purge just created.
//
// Purge creates the partitions due, then takes the fallback lock
// exclusively (and lets it go): every fallback write that began before has
// committed or rolled back by then, and is seen by the purge's look-up of
// the records to keep; every later one reads a catalog in which the newest
// partition covers now, and never writes into a partition past retention.
type placement struct {
	fallback bool
}

// lockSQL is what the placement adds to the claim's lock statement, before
// the key locks: the fallback lock, shared. Empty for a write at now.
func (s *Store) lockSQL(pl placement) string {
	if !pl.fallback {
		return ""
	}
	return `pg_advisory_xact_lock_shared(` + strconv.Itoa(fallbackLockClass) + `, hashtext('` + s.table + `'))`
}

// partitionAtSQL is the SQL expression of a new record's partition_at.
func (s *Store) partitionAtSQL(pl placement) string {
	if !pl.fallback {
		return `clock_timestamp()`
	}
	return s.fallbackAt()
}

// fallbackAt is the partition_at of a fallback write: the clock, or just
// before the end of the newest partition when the clock has passed it.
// Only under the fallback lock (or in a purge, after its partitions were
// created).
func (s *Store) fallbackAt() string {
	p := s.part
	p.mu.Lock()
	pinned := p.pinned
	p.mu.Unlock()
	end := p.newestEnd
	if !pinned.IsZero() {
		end = inboxpart.Literal(pinned)
	}
	return `least(clock_timestamp(), ` + end + ` - interval '1 microsecond')`
}

// place decides where a new record of a claim made now goes: a fallback
// write when no partition is known to cover now and the next interval. It
// re-reads the partitions through db at most every refreshEvery, and only
// near or past the newest one's end.
func (s *Store) place(ctx context.Context, db wsql.ContextExecutor) placement {
	p := s.part
	now := time.Now()
	p.mu.Lock()
	if !p.pinned.IsZero() {
		p.mu.Unlock()
		return placement{fallback: true}
	}
	newest, gen := p.newest, p.gen
	refresh := (newest.IsZero() || now.Add(p.layout.Step()).After(newest)) && now.Sub(p.checked) > refreshEvery
	if refresh {
		p.checked = now // the other claims meanwhile go by what is known
	}
	p.mu.Unlock()
	if refresh {
		if parts, err := p.layout.List(ctx, db); err == nil && len(parts) > 0 {
			newest = parts[len(parts)-1].To
			p.mu.Lock()
			if p.gen == gen {
				p.newest = newest
			}
			p.mu.Unlock()
		}
	}
	return placement{fallback: newest.IsZero() || !now.Add(p.layout.Step()).Before(newest)}
}

// ErrPartitionsChanged is returned (wrapped) by a claim on the partitioned
// layout that found no partition for its record (SQLSTATE 23514): the
// partitions changed since the store last looked (removed by hand, or a
// clock far from the database's). The store forgot what it knew; the claim
// succeeds in a new transaction, which records the key wherever the
// database says. The claims that run in a transaction of the store's own
// (BeginClaimPgx, ClaimLease, Park) retry by themselves; the middleware
// retries ClaimTx and ClaimBatchTx.
var ErrPartitionsChanged = errors.New("no partition of the inbox table takes the record (its partitions changed); claim again in a new transaction")

// noPartition is SQLSTATE check_violation, which an insert into the
// partitioned inbox raises for a row no partition takes (the status CHECK
// constraint cannot fail for the library's own statuses).
const noPartition = "23514"

// partitionsChanged wraps err in ErrPartitionsChanged when no partition
// took the record, and makes the store's next claims fallback writes,
// which ask the catalog, until it next re-reads the partitions.
//
// It also turns the claim functions' isolation error into
// ErrNeedsReadCommitted, and their absence (dropped since the store looked
// for them) into ErrPartitionsChanged: the store then claims by statements
// of its own, in a new transaction.
func (s *Store) partitionsChanged(err error) error {
	if s.part == nil || err == nil {
		return err
	}
	if s.claimFunctionGone(err) {
		s.functionMissing()
		return fmt.Errorf("%w (the claim functions of the partitioned layout are missing: run sqlschema.Migrate): %w", ErrPartitionsChanged, err)
	}
	if pgerr.Code(err) != noPartition {
		return lockErr(err)
	}
	p := s.part
	p.mu.Lock()
	p.newest = time.Time{}
	p.checked = time.Now()
	p.gen++
	p.mu.Unlock()
	return fmt.Errorf("%w: %w", ErrPartitionsChanged, err)
}

// claimRetries bounds the attempts of a claim in a transaction of the
// store's own that met ErrPartitionsChanged; the second one is a fallback
// write, which the database places.
const claimRetries = 3

// Partitioned reports whether the store's table uses the partitioned layout.
func (s *Store) Partitioned() bool { return s.part != nil }

// lockKey is the SQL expression of the advisory lock key of (consumer, key)
// given as SQL expressions: a 64-bit hash of the table, the consumer and the
// key, unambiguous because the consumer's length comes first. Two keys
// sharing a hash only wait for each other.
func (s *Store) lockKey(consumer, key string) string {
	return inboxpart.LockKey(s.table, consumer, key)
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

// claimInsertPartitioned locks (consumer, key) with pl unless locked
// (then pl is the placement the lock statement was made for), and returns
// the insert of a done record that inserts only when the key has no record.
func (s *Store) claimInsertPartitioned(ctx context.Context, tx wsql.ContextExecutor, consumer, key string, locked *placement) (string, error) {
	var pl placement
	if locked != nil {
		pl = *locked
	} else {
		pl = s.place(ctx, tx)
		if !pl.fallback && s.useFunctions(ctx, tx) {
			return s.claimStatementFunc(), nil
		}
		if _, err := tx.ExecContext(ctx, `SELECT `+join(s.lockSQL(pl), checkedLock(s.lockKey("$1::text", "$2::text"))), consumer, key); err != nil {
			return "", lockErr(err)
		}
	}
	return `INSERT INTO ` + s.table + ` (consumer, message_key, status, attempts, processed_at, partition_at)
SELECT $1, $2, 'done', 1, now(), ` + s.partitionAtSQL(pl) + `
WHERE NOT EXISTS (SELECT 1 FROM ` + s.table + ` WHERE consumer = $1 AND message_key = $2)
RETURNING first_seen_at`, nil
}

// join joins the non-empty SQL select-list items with commas, in order:
// PostgreSQL evaluates a select list left to right, so the locks in it are
// taken in that order.
func join(items ...string) string {
	out := make([]string, 0, len(items))
	for _, it := range items {
		if it != "" {
			out = append(out, it)
		}
	}
	return strings.Join(out, ", ")
}

// beginClaimPgxPartitioned is BeginClaimPgx on the partitioned layout. A
// claim at clock_timestamp() calls the claim function with its BEGIN, in
// one round trip (beginClaimPgxFunc). A fallback write, or a table whose
// claim functions are missing, takes two: BEGIN with the key's lock (one
// simple-protocol query), then ClaimTx's statements, which pgx prepares
// once per connection (in the simple protocol the look-up and insert
// would be planned anew each time: planning a statement over every
// partition costs more, about 0.3 ms for 13 partitions, than the second
// round trip).
func (s *Store) beginClaimPgxPartitioned(ctx context.Context, conn *pgx.Conn, consumer, key, qc, qk string) (pgx.Tx, ClaimResult, error) {
	for try := 1; ; try++ {
		tx, claim, err := s.beginClaimPgxPartitionedOnce(ctx, conn, consumer, key, qc, qk)
		if try == claimRetries || !errors.Is(err, ErrPartitionsChanged) {
			return tx, claim, err
		}
	}
}

func (s *Store) beginClaimPgxPartitionedOnce(ctx context.Context, conn *pgx.Conn, consumer, key, qc, qk string) (pgx.Tx, ClaimResult, error) {
	pl := s.place(ctx, wsql.BeginnerFromPgx(conn))
	if !pl.fallback && s.useFunctions(ctx, wsql.BeginnerFromPgx(conn)) {
		tx, claim, done, err := s.beginClaimPgxFunc(ctx, conn, consumer, key, qc, qk)
		if done {
			return tx, claim, err
		}
		pl = s.place(ctx, wsql.BeginnerFromPgx(conn))
	}
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: `BEGIN; SELECT ` + join(s.lockSQL(pl), checkedLock(s.lockKey(`'`+qc+`'`, `'`+qk+`'`)))})
	if err != nil {
		// A failed BEGIN query may leave conn in an aborted transaction.
		if conn.PgConn().TxStatus() != 'I' && !conn.IsClosed() {
			if _, rbErr := conn.Exec(context.WithoutCancel(ctx), "ROLLBACK"); rbErr != nil {
				return nil, ClaimResult{}, fmt.Errorf("rolling back a failed claim of %q for %q: %w", key, consumer, rbErr)
			}
		}
		return nil, ClaimResult{}, fmt.Errorf("claiming %q for %q: %w", key, consumer, lockErr(err))
	}
	claim, err := s.claimTx(ctx, wsql.TxFromPgx(tx), consumer, key, &pl)
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
	// A fallback write takes the fallback lock first, in an init plan that
	// runs before the key locks.
	pl := s.place(ctx, tx)
	if !pl.fallback && s.useFunctions(ctx, tx) {
		return s.claimBatchFunc(ctx, tx, consumer, sorted)
	}
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
	fence := ""
	if f := s.lockSQL(pl); f != "" {
		fence = ` WHERE (SELECT ` + f + `) IS NOT NULL`
	}
	if _, err := tx.ExecContext(ctx, `SELECT `+checkedLock("h")+` FROM (SELECT DISTINCT `+s.lockKey("$1::text", "v.k")+
		` AS h FROM (VALUES `+values.String()+`) v(k) ORDER BY 1) l`+fence, args...); err != nil {
		return nil, fmt.Errorf("claiming %d keys for %q: %w", len(sorted), consumer, lockErr(err))
	}
	rows, err := tx.QueryContext(ctx, `INSERT INTO `+s.table+` (consumer, message_key, status, attempts, processed_at, partition_at)
SELECT $1, v.k, 'done', 1, now(), `+s.partitionAtSQL(pl)+` FROM (VALUES `+values.String()+`) v(k)
WHERE NOT EXISTS (SELECT 1 FROM `+s.table+` t WHERE t.consumer = $1 AND t.message_key = v.k)
RETURNING message_key`, args...)
	keys, err := claimedKeys(rows, err, len(sorted), consumer)
	return keys, s.partitionsChanged(err)
}

// leaseInsertPartitioned locks (consumer, key), waiting at most
// lockTimeout (then 55P03: busy), and returns lease mode's insert of a
// processing record for an absent key ($1 consumer, $2 key, $3 lease
// seconds, $4 token).
func (s *Store) leaseInsertPartitioned(ctx context.Context, tx wsql.ContextExecutor, consumer, key, lockTimeout string) (string, error) {
	// The fallback lock (if any) is taken before lock_timeout is set: a
	// purge's fence may make it wait for longer than a moment.
	pl := s.place(ctx, tx)
	if _, err := tx.ExecContext(ctx, `SELECT `+join(s.lockSQL(pl), `set_config('lock_timeout', $3, true)`,
		`pg_advisory_xact_lock(`+s.lockKey("$1::text", "$2::text")+`)`), consumer, key, lockTimeout); err != nil {
		return "", err
	}
	return `INSERT INTO ` + s.table + ` (consumer, message_key, status, attempts, lease_until, lease_token, partition_at)
SELECT $1, $2, 'processing', 1, now() + make_interval(secs => $3), $4::uuid, ` + s.partitionAtSQL(pl) + `
WHERE NOT EXISTS (SELECT 1 FROM ` + s.table + ` WHERE consumer = $1 AND message_key = $2)
RETURNING ` + recordColumns, nil
}

// parkPartitioned is Park on the partitioned layout, in a READ COMMITTED
// transaction of its own when db can begin one (then it retries after
// ErrPartitionsChanged).
func (s *Store) parkPartitioned(ctx context.Context, db wsql.ContextExecutor, consumer, key, reason string, msg *ParkedMessage) error {
	// Both branches see the statement's snapshot: when released parks the
	// record, the insert finds it and creates none.
	q := `WITH released AS (
UPDATE ` + s.table + ` SET status = 'parked', attempts = attempts + 1, processed_at = now(), last_error = $3
WHERE consumer = $1 AND message_key = $2 AND status = 'failed' AND parked_by_transaction RETURNING ` + parkedReturning + `),
created AS (
INSERT INTO ` + s.table + ` (consumer, message_key, status, attempts, processed_at, last_error, parked_by_transaction, partition_at)
SELECT $1, $2, 'parked', 1, now(), $3, true, {{partition_at}}
WHERE NOT EXISTS (SELECT 1 FROM ` + s.table + ` WHERE consumer = $1 AND message_key = $2) RETURNING ` + parkedReturning + `)
`
	args := []any{consumer, key, reason}
	if msg != nil {
		q += s.keepParked(`(SELECT * FROM released UNION ALL SELECT * FROM created) parked`, 4)
		args = append(args, msg.Row().args()...)
	} else {
		q += `SELECT 1` // data-modifying CTEs run whether or not they are read
	}
	run := func(tx wsql.ContextExecutor) error {
		pl := s.place(ctx, tx)
		if _, err := tx.ExecContext(ctx, `SELECT `+join(s.lockSQL(pl), `pg_advisory_xact_lock(`+s.lockKey("$1::text", "$2::text")+`)`), consumer, key); err != nil {
			return err
		}
		_, err := seam.Exec(ctx, tx, strings.Replace(q, "{{partition_at}}", s.partitionAtSQL(pl), 1), args...)
		return s.partitionsChanged(err)
	}
	b, ok := db.(wsql.Beginner)
	if !ok {
		return run(db)
	}
	for try := 1; ; try++ {
		tx, err := b.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
		if err != nil {
			return err
		}
		if err := run(tx); err != nil {
			_ = tx.Rollback()
			if try < claimRetries && errors.Is(err, ErrPartitionsChanged) {
				continue
			}
			return err
		}
		return tx.Commit()
	}
}

// MaintainPartitions creates the partitions missing among the current
// interval and the Ahead intervals after it, and finishes the removal of a
// partition whose DETACH ... CONCURRENTLY was interrupted (it was being
// dropped by retention, after the records it had to keep were moved out;
// should it still hold a record that is not done, it is attached again and
// MaintainPartitions fails). It returns the names of the partitions
// created. db must not be a transaction.
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
				if pending, lerr := s.detachPending(ctx, db, p.Name); lerr == nil && !pending {
					continue // the purge that was detaching it finished it
				}
				return nil, fmt.Errorf("finishing the detach of %s: %w", p.Name, err)
			}
			if _, err := s.dropDetached(ctx, db, p, `status NOT IN `+dedupOnlySQL); err != nil {
				return nil, err
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
	s.part.gen++
	s.part.mu.Unlock()
	return created, nil
}

// keepCondition selects the records retention must keep although their
// partition is past retention: not done or discarded (processing, failed,
// parked), or done or discarded but finished after the cutoff ($1). It uses the partial index of
// open records and the BRIN index of finish times.
//
// A record finished at processed_at, the start (now()) of the transaction
// that finished it, which commits later: a record whose transaction was
// open for longer than OlderThan is past retention when it commits.
const keepCondition = `(status NOT IN ` + dedupOnlySQL + ` OR coalesce(processed_at, first_seen_at) >= $1)`

// liveLease selects lease-mode records whose attempt still holds its lease:
// they are not moved, so their partition waits for the next purge. (An
// attempt whose lease expired may still complete after its record moved:
// its completion takes the key's lock first, see CompleteTx.)
const liveLease = `(status = 'processing' AND lease_until > now())`

// purgePartitions is Purge on the partitioned layout: every partition that
// ended before the cutoff has the records it must keep moved into the
// current partition (under their keys' locks), then is detached
// concurrently and dropped.
//
// The order is what keeps a record that commits meanwhile: the partitions
// due are created first (MaintainPartitions: a partition covers now), then
// the fallback writes are fenced (fenceFallbackWrites: no write in flight
// or to come targets a partition past retention), and only then does the
// purge look for the records to keep; after the detach, the detached table
// is checked once more before it is dropped.
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

	var due []inboxpart.Partition
	for _, p := range parts {
		if !p.To.After(cutoff) && !p.DetachPending {
			due = append(due, p)
		}
	}
	if len(due) == 0 {
		return 0, nil
	}
	if err := s.fenceFallbackWrites(ctx, db); err != nil {
		return 0, fmt.Errorf("purge: %w", err)
	}
	var total int64
	dropped := 0
	for _, p := range due {
		if opts.MaxBatches != 0 && dropped >= opts.MaxBatches {
			break
		}
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
	return total, nil
}

// fenceFallbackWrites waits until every fallback write in flight has
// committed or rolled back, in a transaction that takes the fallback lock
// exclusively and commits. Called once a partition covers now: fallback
// writes that begin later read the newest partition's end from the catalog
// in a statement that starts after the lock was granted to them, so they
// see the partitions created, and never target a partition past retention
// (see placement).
//
// While it waits, new fallback writes wait for it (PostgreSQL queues them
// behind the exclusive request); they hold nothing yet, since the fallback
// lock is the first lock of their transaction. The fence holds nothing
// else, and ends at once when it is granted.
func (s *Store) fenceFallbackWrites(ctx context.Context, db wsql.Beginner) error {
	tx, err := db.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1, hashtext($2))`, fallbackLockClass, s.table); err != nil {
		_ = tx.Rollback()
		return fmt.Errorf("waiting for the claims in flight into past partitions: %w", err)
	}
	return tx.Commit()
}

// dropPartition moves the records p must keep, then detaches and drops p.
// It returns the records dropped, and false when p was kept because a
// record in it holds a live lease.
func (s *Store) dropPartition(ctx context.Context, db wsql.Beginner, p inboxpart.Partition, cutoff time.Time, batch int) (int64, bool, error) {
	l := s.part.layout
	q := l.Quoted(p.Name)
	inRange := `partition_at >= ` + inboxpart.Literal(p.From) + ` AND partition_at < ` + inboxpart.Literal(p.To)
	// Batches until one finds nothing to move: a batch may move fewer
	// records than it found (a record changed while the batch waited for
	// its key's lock), and only a look-up that finds none shows that none
	// is left.
	for {
		if err := ctx.Err(); err != nil {
			return 0, false, err
		}
		var found int
		var live bool
		locked, err := s.underPurgeLock(ctx, db, func(tx wsql.Tx) error {
			// Through the parent: a partition another purge detached in the
			// meantime has nothing left to move.
			rows, err := tx.QueryContext(ctx, `SELECT consumer, message_key FROM `+s.table+` WHERE `+inRange+` AND `+keepCondition+` AND NOT `+liveLease+` LIMIT $2`, cutoff, batch)
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
			found = len(cs)
			if found == 0 {
				return seam.QueryRow(ctx, tx, `SELECT EXISTS (SELECT 1 FROM `+s.table+` WHERE `+inRange+` AND `+liveLease+`)`, nil, &live)
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
			// Into the newest partition, read from the catalog: the
			// partitions due were created, so it is not past retention.
			_, err = seam.Exec(ctx, tx, `UPDATE `+s.table+` SET partition_at = `+s.fallbackAt()+`
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
		if found == 0 {
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
	n, err := s.dropDetached(ctx, db, p, keepCondition, cutoff)
	if err != nil {
		return 0, false, fmt.Errorf("purge: %w", err)
	}
	return n, true, nil
}

// dropDetached drops p, a partition just detached, and returns the rows it
// held; unless a record in it matches keep (a condition whose parameters
// are args), which is never expected (the records to keep were moved out,
// and no claim writes into a partition past retention once the fallback
// writes were fenced): then it attaches p again and fails, and the record
// stays.
func (s *Store) dropDetached(ctx context.Context, db wsql.Beginner, p inboxpart.Partition, keep string, args ...any) (int64, error) {
	l := s.part.layout
	q := l.Quoted(p.Name)
	// Each statement runs again after a deadlock: another process's
	// MaintainPartitions may be finishing the same detach (its DETACH ...
	// FINALIZE waits for older snapshots, this statement's included), and
	// gives up once it sees the partition detached.
	var n, kept int64
	if err := retryStatement(db, func() error {
		return seam.QueryRow(ctx, db, `SELECT count(*), count(*) FILTER (WHERE `+keep+`) FROM `+q, args, &n, &kept)
	}); err != nil {
		return 0, fmt.Errorf("counting the records of %s: %w", p.Name, err)
	}
	if kept > 0 {
		aerr := retryStatement(db, func() error {
			_, err := db.ExecContext(ctx, `ALTER TABLE `+l.Parent()+` ATTACH PARTITION `+q+
				` FOR VALUES FROM (`+inboxpart.Literal(p.From)+`) TO (`+inboxpart.Literal(p.To)+`)`)
			return err
		})
		if aerr != nil {
			return 0, fmt.Errorf("%s, detached, still holds %d records to keep, and attaching it again failed (attach it by hand: it must not be dropped): %w", p.Name, kept, aerr)
		}
		return 0, fmt.Errorf("%s still held %d records to keep after they were moved; it was attached again", p.Name, kept)
	}
	if err := retryStatement(db, func() error {
		_, err := db.ExecContext(ctx, `DROP TABLE `+q)
		return err
	}); err != nil {
		return 0, fmt.Errorf("dropping %s: %w", p.Name, err)
	}
	return n, nil
}

// detachPending reports whether name is still a partition of the table
// whose detach is pending.
func (s *Store) detachPending(ctx context.Context, db wsql.ContextExecutor, name string) (bool, error) {
	parts, err := s.part.layout.List(ctx, db)
	if err != nil {
		return false, err
	}
	for _, p := range parts {
		if p.Name == name && p.DetachPending {
			return true, nil
		}
	}
	return false, nil
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
