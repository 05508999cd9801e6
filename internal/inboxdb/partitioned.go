package inboxdb

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"

	"strings"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlexec"
)

// The time-partitioned layout (sqlschema.DB.Partitions): its locks are
// lockPlan's (lockplan.go), which every writer goes through.

// ErrNeedsReadCommitted is returned (wrapped) by a claim on the
// partitioned layout in a transaction that is not READ COMMITTED.
var ErrNeedsReadCommitted = errors.New("the partitioned inbox layout needs READ COMMITTED transactions for claims")

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
	// locks is the lock plan every writer goes through.
	locks lockPlan

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
	pinned time.Time // tests only: the newest partition's end, instead of the catalog's

	funcs funcState // the claim functions (partitioned_func.go)
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

// pinnedEnd is the last parameter of a fallback write's statement, and of
// a purge's move: the newest partition's end a test pinned
// (PretendNewestPartitionEnds), or nil, and the statement reads it from
// the catalog (fragments.sql's NewestEnd). Only under the fallback lock
// (or in a purge, after its partitions were created).
func (s *Store) pinnedEnd() any {
	p := s.part
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pinned.IsZero() {
		return nil
	}
	return p.pinned
}

// placedArgs are args, with pinnedEnd last for a fallback write.
func (s *Store) placedArgs(pl placement, args ...any) []any {
	if pl.fallback {
		return append(args, s.pinnedEnd())
	}
	return args
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
var ErrPartitionsChanged = errors.New("no partition of the inbox table takes the record (its partitions changed)")

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
// the insert of a done record that inserts only when the key has no
// record, with its arguments.
func (s *Store) claimInsertPartitioned(ctx context.Context, tx wsql.ContextExecutor, consumer, key string, locked *placement) (string, []any, error) {
	var pl placement
	if locked != nil {
		pl = *locked
	} else {
		pl = s.place(ctx, tx)
		if !pl.fallback && s.useFunctions(ctx, tx) {
			return s.q.get("ClaimFuncCall"), []any{consumer, key}, nil
		}
		if err := s.part.locks.claim(ctx, tx, pl, consumer, key); err != nil {
			return "", nil, err
		}
	}
	return s.part.locks.placed("ClaimInsert", pl), s.placedArgs(pl, consumer, key), nil
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
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: s.part.locks.beginClaim(pl, qc, qk)})
	if err != nil {
		// A failed BEGIN query may leave conn in an aborted transaction.
		if conn.PgConn().TxStatus() != 'I' && !conn.IsClosed() {
			if _, rbErr := conn.Exec(context.WithoutCancel(ctx), s.q.get("Rollback")); rbErr != nil {
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
	if err := s.part.locks.claimBatch(ctx, tx, pl, consumer, sorted); err != nil {
		return nil, fmt.Errorf("claiming %d keys for %q: %w", len(sorted), consumer, err)
	}
	rows, err := tx.QueryContext(ctx, s.part.locks.placed("ClaimBatchInsert", pl), s.placedArgs(pl, consumer, sorted)...)
	keys, err := claimedKeys(rows, err, len(sorted), consumer)
	return keys, s.partitionsChanged(err)
}

// leaseInsertPartitioned locks (consumer, key), waiting at most
// lockTimeout (then 55P03: busy), and returns lease mode's insert of a
// processing record for an absent key, with its arguments.
func (s *Store) leaseInsertPartitioned(ctx context.Context, tx wsql.ContextExecutor, consumer, key string, leaseSecs float64, token, lockTimeout string) (string, []any, error) {
	pl := s.place(ctx, tx)
	if err := s.part.locks.leaseClaim(ctx, tx, pl, consumer, key, lockTimeout); err != nil {
		return "", nil, err
	}
	return s.part.locks.placed("LeaseInsert", pl), s.placedArgs(pl, consumer, key, leaseSecs, token), nil
}

// parkPartitioned is Park on the partitioned layout, in a READ COMMITTED
// transaction of its own when db can begin one (then it retries after
// ErrPartitionsChanged).
func (s *Store) parkPartitioned(ctx context.Context, db wsql.ContextExecutor, consumer, key, reason string, msg *ParkedMessage) error {
	// Both branches of Park (placed/claim.sql) see the statement's
	// snapshot: when released parks the record, the insert finds it and
	// creates none.
	name, args := "Park", []any{consumer, key, reason}
	if msg != nil {
		name, args = "ParkKeep", append(msg.Row().args(), args...)
	}
	run := func(tx wsql.ContextExecutor) error {
		pl := s.place(ctx, tx)
		if err := s.part.locks.park(ctx, tx, pl, consumer, key); err != nil {
			return err
		}
		_, err := seam.Exec(ctx, tx, s.part.locks.placed(name, pl), s.placedArgs(pl, args...)...)
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
			if _, err := db.ExecContext(ctx, s.rt.finalize.Fill(l.Quoted(p.Name))); err != nil {
				if pending, lerr := s.detachPending(ctx, db, p.Name); lerr == nil && !pending {
					continue // the purge that was detaching it finished it
				}
				return nil, fmt.Errorf("finishing the detach of %s: %w", p.Name, err)
			}
			if _, err := s.dropDetached(ctx, db, p, s.rt.countOpen); err != nil {
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
		if err := seam.QueryRow(ctx, tx, s.q.get("PurgeCutoff"), []any{opts.OlderThan.Seconds()}, &cutoff); err != nil {
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
	if err := s.part.locks.fence(ctx, tx); err != nil {
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
	// The records to keep (partitions.sql's FindKept): not done or
	// discarded, or finished after the cutoff; never one with a live
	// lease. Batches until one finds nothing to move: a batch may move
	// fewer records than it found (a record changed while the batch waited
	// for its key's lock), and only a look-up that finds none shows that
	// none is left.
	for {
		if err := ctx.Err(); err != nil {
			return 0, false, err
		}
		var found int
		var live bool
		locked, err := s.underPurgeLock(ctx, db, func(tx wsql.Tx) error {
			// Through the parent: a partition another purge detached in the
			// meantime has nothing left to move.
			rows, err := tx.QueryContext(ctx, s.q.get("FindKept"), cutoff, batch, p.From, p.To)
			if err != nil {
				return err
			}
			var cs, ks []string
			for rows.Next() {
				var c, k string
				if err := rows.Scan(&c, &k); err != nil {
					_ = rows.Close()
					return err
				}
				cs, ks = append(cs, c), append(ks, k)
			}
			if err := seam.Close(rows); err != nil {
				return err
			}
			found = len(cs)
			if found == 0 {
				return seam.QueryRow(ctx, tx, s.q.get("LiveLeaseIn"), []any{p.From, p.To}, &live)
			}
			// The keys' locks, in hash order, as every claim takes them:
			// no claim runs for these keys while their records move.
			if err := s.part.locks.lockKeys(ctx, tx, cs, ks); err != nil {
				return err
			}
			// Into the newest partition, read from the catalog: the
			// partitions due were created, so it is not past retention.
			_, err = seam.Exec(ctx, tx, s.q.get("MoveKept"), cutoff, cs, ks, p.From, p.To, s.pinnedEnd())
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
	if _, err := db.ExecContext(ctx, s.rt.detach.Fill(q)); err != nil {
		if still, lerr := s.attached(ctx, db, p.Name); lerr == nil && !still {
			return 0, false, fmt.Errorf("%w (%s was detached by it): %w", ErrPurgeRunning, p.Name, err)
		}
		return 0, false, fmt.Errorf("purge: detaching %s: %w", p.Name, err)
	}
	n, err := s.dropDetached(ctx, db, p, s.rt.countKeptAfter, cutoff)
	if err != nil {
		return 0, false, fmt.Errorf("purge: %w", err)
	}
	return n, true, nil
}

// dropDetached drops p, a partition just detached, and returns the rows it
// held; unless count (CountDetachedAfter or CountDetachedOpen, whose
// parameters are args) finds a record in it to keep, which is never expected (the records to keep were moved out,
// and no claim writes into a partition past retention once the fallback
// writes were fenced): then it attaches p again and fails, and the record
// stays.
func (s *Store) dropDetached(ctx context.Context, db wsql.Beginner, p inboxpart.Partition, count sqlexec.Template, args ...any) (int64, error) {
	l := s.part.layout
	q := l.Quoted(p.Name)
	// Each statement runs again after a deadlock: another process's
	// MaintainPartitions may be finishing the same detach (its DETACH ...
	// FINALIZE waits for older snapshots, this statement's included), and
	// gives up once it sees the partition detached.
	var n, kept int64
	if err := retryStatement(db, func() error {
		return seam.QueryRow(ctx, db, count.Fill(q), args, &n, &kept)
	}); err != nil {
		return 0, fmt.Errorf("counting the records of %s: %w", p.Name, err)
	}
	if kept > 0 {
		aerr := retryStatement(db, func() error {
			_, err := db.ExecContext(ctx, s.rt.attach.Fill(q, inboxpart.Literal(p.From), inboxpart.Literal(p.To)))
			return err
		})
		if aerr != nil {
			return 0, fmt.Errorf("%s, detached, still holds %d records to keep, and attaching it again failed: %w", p.Name, kept, aerr)
		}
		return 0, fmt.Errorf("%s still held %d records to keep after they were moved, and was attached again", p.Name, kept)
	}
	if err := retryStatement(db, func() error {
		_, err := db.ExecContext(ctx, s.rt.drop.Fill(q))
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
