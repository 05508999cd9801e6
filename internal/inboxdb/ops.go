package inboxdb

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/tenant"
)

// Lookup returns the record of (consumer, key), or an error wrapping
// ErrNotFound. It sees what db sees: committed rows, or a transaction's own.
func (s *Store) Lookup(ctx context.Context, db wsql.ContextExecutor, consumer, key string) (Record, error) {
	var rec Record
	err := seam.QueryRow(ctx, db, s.q.get("Lookup"), []any{consumer, key}, rec.scanDest()...)
	if notFound(err) {
		return Record{}, fmt.Errorf("%w (consumer %q, key %q)", ErrNotFound, consumer, key)
	}
	if err != nil {
		return Record{}, fmt.Errorf("lookup %q for %q: %w", key, consumer, err)
	}
	return rec, nil
}

// Forget deletes the record of (consumer, key), so that the next delivery of
// that key runs the handler again, and, in the same statement, the message
// kept when the key was parked. It reports whether a record existed. Use
// it to re-process a message on purpose; it does not undo effects.
//
// On the partitioned layout a purge may move the record to another
// partition meanwhile; a DELETE that met the move fails with a
// serialization failure, and is run again when db is not a transaction.
func (s *Store) Forget(ctx context.Context, db wsql.ContextExecutor, consumer, key string) (bool, error) {
	record, _, err := s.forget(ctx, db, consumer, key, false)
	return record, err
}

// forget deletes the record of (consumer, key) (with waitingOnly, only
// while it waits for an operator: parked or failed) and its parked message
// in one statement, and reports which of the two it deleted.
func (s *Store) forget(ctx context.Context, db wsql.ContextExecutor, consumer, key string, waitingOnly bool) (record, message bool, err error) {
	if s.mysql {
		return s.forgetMySQL(ctx, db, consumer, key, waitingOnly)
	}
	q := s.q.get("Forget")
	if waitingOnly {
		q = s.q.get("ForgetWaiting")
	}
	// The record first (rec is read first), then the parked message: the
	// lock order of parked.go.
	err = retryStatement(db, func() error {
		return seam.QueryRow(ctx, db, q, []any{consumer, key}, &record, &message)
	})
	if err != nil {
		return false, false, fmt.Errorf("forget %q for %q: %w", key, consumer, err)
	}
	return record, message, nil
}

// Stats summarises the inbox, or one consumer's part of it.
type Stats struct {
	// Rows counts records by status.
	Rows map[string]int64
	// Total is the number of records.
	Total int64
	// Duplicates is the number of deliveries recognised as duplicates of
	// the records still in the table.
	Duplicates int64
	// OldestFirstSeen is the first_seen_at of the oldest record; nil when
	// the table is empty.
	OldestFirstSeen *time.Time
}

// Stats counts the records of consumer, or of every consumer when consumer
// is empty. It scans the table (or the consumer's part of the primary key):
// meant for operators and periodic metrics, not for every message.
func (s *Store) Stats(ctx context.Context, db wsql.ContextExecutor, consumer string) (Stats, error) {
	return s.TenantStats(ctx, db, consumer, "")
}

// TenantStats is Stats of the keys of one tenant (keys scoped by
// exactlyonce.KeyByTenant); an empty tenant means every key.
func (s *Store) TenantStats(ctx context.Context, db wsql.ContextExecutor, consumer, tenantName string) (Stats, error) {
	// ops.sql's Stats, of one consumer and/or one tenant's prefix when
	// given: a statement per case, so that each is planned for its
	// conditions.
	name, args := "Stats", []any(nil)
	if consumer != "" {
		name, args = "StatsOf", append(args, consumer)
	}
	if tenantName != "" {
		if err := tenant.Check(tenantName); err != nil {
			return Stats{}, err
		}
		if consumer != "" {
			name = "StatsOfConsumerTenant"
		} else {
			name = "StatsOfTenant"
		}
		args = append(args, s.prefixArg(tenant.Prefix(tenantName)))
	}
	rows, err := db.QueryContext(ctx, s.q.get(name), args...)
	if err != nil {
		return Stats{}, fmt.Errorf("stats: %w", err)
	}
	st := Stats{Rows: map[string]int64{}}
	for rows.Next() {
		var status string
		var n, dups int64
		var oldest *time.Time
		if err := rows.Scan(&status, &n, &dups, &oldest); err != nil {
			_ = rows.Close()
			return Stats{}, fmt.Errorf("stats: %w", err)
		}
		st.Rows[status] = n
		st.Total += n
		st.Duplicates += dups
		if oldest != nil && (st.OldestFirstSeen == nil || oldest.Before(*st.OldestFirstSeen)) {
			st.OldestFirstSeen = oldest
		}
	}
	if err := seam.Close(rows); err != nil {
		return Stats{}, fmt.Errorf("stats: %w", err)
	}
	return st, nil
}

// CountStatus counts the records of consumer (every consumer when empty) in
// status. For processing, failed, parked and discarded it reads a small
// partial index;
// for done it scans, like Stats.
func (s *Store) CountStatus(ctx context.Context, db wsql.ContextExecutor, consumer string, status string) (int64, error) {
	// CountOpen says status <> 'done': that lets the planner use the
	// partial index.
	name, args := "CountDone", []any(nil)
	if status != StatusDone {
		name, args = "CountOpen", append(args, status)
	}
	if consumer != "" {
		name, args = name+"Of", append(args, consumer)
	}
	q := s.q.get(name)
	var n int64
	if err := seam.QueryRow(ctx, db, q, args, &n); err != nil {
		return 0, fmt.Errorf("counting %s records: %w", status, err)
	}
	return n, nil
}

// DefaultPurgeBatchSize is the number of rows one purge statement deletes.
const DefaultPurgeBatchSize = 1000

// ErrPurgeRunning is returned by Purge when another purge of the same inbox
// table holds the purge lock: at its first batch (nothing was deleted), or
// between two batches (it stopped; the other purge carries on).
var ErrPurgeRunning = errors.New("another purge of this inbox table is running")

// PurgeOptions selects what Purge deletes.
type PurgeOptions struct {
	// OlderThan deletes records that finished (processed_at: done, failed,
	// or released by an operator) more than this long ago, however long ago
	// they were first seen. Required (> 0). Choose it longer than the longest
	// time your broker may still redeliver a message after it was processed.
	OlderThan time.Duration
	// Consumer limits the purge to one consumer. Empty means all.
	Consumer string
	// BatchSize is the number of rows each DELETE statement removes; each
	// batch is its own short statement, so no lock is held for long.
	// Defaults to 1000.
	BatchSize int
	// MaxBatches stops the purge after this many batches (0: until done);
	// on the partitioned layout, after this many partitions dropped.
	MaxBatches int
	// Progress, when set, is called after each batch (or dropped
	// partition) with the number of rows it removed.
	Progress func(deleted int64)
	// Tenant limits the purge to the keys of one tenant (see
	// exactlyonce.KeyByTenant). Empty means all. On the partitioned layout
	// it deletes rows, as Consumer does: a partition holds every tenant.
	Tenant string
}

// purgeLockClass is the first key of the purge lock, in the two-key
// advisory lock space (the claims' per-key locks use the one-key space);
// the second is a hash of the table's name.
const purgeLockClass = 0x656f7075 // "eopu"

// underPurgeLock runs fn in a READ COMMITTED transaction of its own that
// first takes the table's purge lock without waiting. It reports false,
// running nothing, when another purge holds it. Transaction-scoped, the
// lock keeps no session state (PgBouncer's transaction pooling).
//
// On MySQL the lock is a named lock of the session (GET_LOCK: MySQL has no
// transaction-scoped one), released before the transaction ends.
func (s *Store) underPurgeLock(ctx context.Context, db wsql.Beginner, fn func(tx wsql.Tx) error) (bool, error) {
	tx, err := db.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return false, err
	}
	if s.mysql {
		return s.underPurgeLockMySQL(ctx, tx, fn)
	}
	var locked bool
	if err := seam.QueryRow(ctx, tx, s.q.get("PurgeLock"), nil, &locked); err != nil || !locked {
		_ = tx.Rollback()
		return false, err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return true, err
	}
	return true, tx.Commit()
}

func (s *Store) underPurgeLockMySQL(ctx context.Context, tx wsql.Tx, fn func(tx wsql.Tx) error) (bool, error) {
	name := s.purgeLockName()
	var locked bool
	if err := seam.QueryRow(ctx, tx, s.q.get("PurgeLock"), []any{name}, &locked); err != nil || !locked {
		_ = tx.Rollback()
		return false, err
	}
	err := fn(tx)
	var released int64
	if uerr := seam.QueryRow(ctx, tx, s.q.get("PurgeUnlock"), []any{name}, &released); err == nil {
		err = uerr
	}
	if err != nil {
		_ = tx.Rollback()
		return true, err
	}
	return true, tx.Commit()
}

// prefixArg is the argument of a key-prefix condition: the prefix
// (PostgreSQL's starts_with), or its LIKE pattern on MySQL.
func (s *Store) prefixArg(prefix string) string {
	if s.mysql {
		return likePrefix(prefix)
	}
	return prefix
}

// Purge deletes records in status done, failed or discarded that finished more than
// opts.OlderThan ago (by processed_at, never by first_seen_at: a key parked
// for days and completed today is as young as any completed today), in
// batches of opts.BatchSize rows. Records processing (a live lease) or
// parked (waiting for an operator) are never purged. db must not be a
// transaction: pass the pool or *sql.DB. It returns the number of rows
// deleted, also when ctx ends it early.
//
// Each batch is a READ COMMITTED transaction that first takes the table's
// purge lock (pg_try_advisory_xact_lock), then deletes with SKIP LOCKED: no
// two purges of one table delete at the same moment. A purge that finds the
// lock taken returns ErrPurgeRunning: at once when it is its first batch,
// or, between batches, after the rows it already deleted.
//
// On the partitioned layout (without opts.Consumer) whole partitions are
// dropped instead: see purgePartitions. No record that finished within
// OlderThan is removed, also when it commits into a partition while that
// partition is being removed: the purge first makes sure a partition covers
// now, then waits for the claims in flight into older partitions, and only
// then moves the records to keep out of the partitions it removes. With
// opts.Consumer it deletes rows as on the plain layout.
func (s *Store) Purge(ctx context.Context, db wsql.Beginner, opts PurgeOptions) (int64, error) {
	if opts.OlderThan <= 0 {
		return 0, errors.New("PurgeOptions.OlderThan must be > 0")
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = DefaultPurgeBatchSize
	}
	if opts.BatchSize < 0 {
		return 0, errors.New("PurgeOptions.BatchSize must be >= 0")
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	if s.part != nil && opts.Consumer == "" && opts.Tenant == "" {
		return s.purgePartitions(ctx, db, opts)
	}
	// ops.sql's PurgeRows, with the consumer and the tenant's prefix
	// from $3 when given.
	name, args := "PurgeRows", []any{opts.OlderThan.Seconds(), opts.BatchSize}
	if opts.Consumer != "" {
		name, args = "PurgeRowsOf", append(args, opts.Consumer)
	}
	if opts.Tenant != "" {
		if err := tenant.Check(opts.Tenant); err != nil {
			return 0, fmt.Errorf("PurgeOptions.Tenant: %w", err)
		}
		if opts.Consumer != "" {
			name = "PurgeRowsOfConsumerTenant"
		} else {
			name = "PurgeRowsOfTenant"
		}
		args = append(args, s.prefixArg(tenant.Prefix(opts.Tenant)))
	}
	if s.mysql {
		// PurgePick's, the limit last; the age in microseconds.
		name = strings.Replace(name, "PurgeRows", "PurgePick", 1)
		args = append(append([]any{opts.OlderThan.Microseconds()}, args[2:]...), opts.BatchSize)
	}
	q := s.q.get(name)

	var total int64
	for batch := 0; opts.MaxBatches == 0 || batch < opts.MaxBatches; batch++ {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		var n int64
		locked, err := s.underPurgeLock(ctx, db, func(tx wsql.Tx) error {
			var err error
			if s.mysql {
				n, err = s.purgeBatchMySQL(ctx, tx, q, args)
			} else {
				n, err = seam.Exec(ctx, tx, q, args...)
			}
			return err
		})
		if err != nil {
			return total, fmt.Errorf("purge: %w", err)
		}
		if !locked {
			return total, ErrPurgeRunning
		}
		total += n
		if opts.Progress != nil {
			opts.Progress(n)
		}
		if n < int64(opts.BatchSize) {
			break
		}
	}
	return total, nil
}

// KnownConsumer reports whether consumer has a record or a parked message:
// two primary-key look-ups (consumer is the keys' first column).
func (s *Store) KnownConsumer(ctx context.Context, db wsql.ContextExecutor, consumer string) (bool, error) {
	var known bool
	args := []any{consumer}
	if s.mysql {
		args = append(args, consumer) // no numbered placeholders
	}
	err := seam.QueryRow(ctx, db, s.q.get("KnownConsumer"), args, &known)
	return known, err
}

// Now returns the database's clock (now(): the start of db's transaction,
// when db is one; on MySQL UTC_TIMESTAMP(6), the statement's time).
func (s *Store) Now(ctx context.Context, db wsql.ContextExecutor) (time.Time, error) {
	var now time.Time
	err := seam.QueryRow(ctx, db, s.q.get("Now"), nil, &now)
	return now, err
}

// Consumers returns the distinct consumers of the inbox table (parked
// false) or of the table of parked messages (true), in order, at most
// limit: a loose index scan of the primary key (consumer, message_key[,
// partition_at]), one index descent per consumer whatever the number of
// records, where SELECT DISTINCT would read them all.
func (s *Store) Consumers(ctx context.Context, db wsql.ContextExecutor, parked bool, limit int) ([]string, error) {
	q := s.q.get("Consumers")
	if parked {
		q = s.q.get("ParkedConsumers")
	}
	rows, err := db.QueryContext(ctx, q, limit)
	if err != nil {
		return nil, err
	}
	var out []string
	for rows.Next() {
		var c string
		if err := rows.Scan(&c); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, c)
	}
	return out, seam.Close(rows)
}
