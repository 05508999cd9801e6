package inboxdb

import (
	"context"
	"errors"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// Lookup returns the record of (consumer, key), or an error wrapping
// ErrNotFound. It sees what db sees: committed rows, or a transaction's own.
func (s *Store) Lookup(ctx context.Context, db wsql.ContextExecutor, consumer, key string) (Record, error) {
	var rec Record
	err := seam.QueryRow(ctx, db,
		`SELECT `+recordColumns+` FROM `+s.table+` WHERE consumer = $1 AND message_key = $2`,
		[]any{consumer, key}, rec.scanDest()...)
	if notFound(err) {
		return Record{}, fmt.Errorf("%w (consumer %q, key %q)", ErrNotFound, consumer, key)
	}
	if err != nil {
		return Record{}, fmt.Errorf("lookup %q for %q: %w", key, consumer, err)
	}
	return rec, nil
}

// Forget deletes the record of (consumer, key), so that the next delivery of
// that key runs the handler again. It reports whether a record existed. Use
// it to re-process a message on purpose; it does not undo effects.
func (s *Store) Forget(ctx context.Context, db wsql.ContextExecutor, consumer, key string) (bool, error) {
	n, err := seam.Exec(ctx, db, `DELETE FROM `+s.table+` WHERE consumer = $1 AND message_key = $2`, consumer, key)
	if err != nil {
		return false, fmt.Errorf("forget %q for %q: %w", key, consumer, err)
	}
	return n > 0, nil
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
	q := `SELECT status, count(*), coalesce(sum(duplicates), 0)::bigint, min(first_seen_at) FROM ` + s.table
	var args []any
	if consumer != "" {
		q += ` WHERE consumer = $1`
		args = append(args, consumer)
	}
	q += ` GROUP BY status`
	rows, err := db.QueryContext(ctx, q, args...)
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
// status. For processing, failed and parked it reads a small partial index;
// for done it scans, like Stats.
func (s *Store) CountStatus(ctx context.Context, db wsql.ContextExecutor, consumer string, status string) (int64, error) {
	q := `SELECT count(*) FROM ` + s.table + ` WHERE status = $1`
	args := []any{status}
	if status != StatusDone {
		q += ` AND status <> 'done'` // lets the planner use the partial index
	}
	if consumer != "" {
		q += ` AND consumer = $2`
		args = append(args, consumer)
	}
	var n int64
	if err := seam.QueryRow(ctx, db, q, args, &n); err != nil {
		return 0, fmt.Errorf("counting %s records: %w", status, err)
	}
	return n, nil
}

// DefaultPurgeBatchSize is the number of rows one purge statement deletes.
const DefaultPurgeBatchSize = 1000

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
	// MaxBatches stops the purge after this many batches (0: until done).
	MaxBatches int
}

// Purge deletes records in status done or failed that finished more than
// opts.OlderThan ago (by processed_at, never by first_seen_at: a key parked
// for days and completed today is as young as any completed today), in
// batches of opts.BatchSize rows, each batch its own
// statement that skips rows locked by others. Records processing (a live
// lease) or parked (waiting for an operator) are never purged. db must not
// be a transaction you want to keep short: pass the pool or *sql.DB. It
// returns the number of rows deleted, also when ctx ends it early.
func (s *Store) Purge(ctx context.Context, db wsql.ContextExecutor, opts PurgeOptions) (int64, error) {
	if opts.OlderThan <= 0 {
		return 0, errors.New("PurgeOptions.OlderThan must be > 0")
	}
	if opts.BatchSize == 0 {
		opts.BatchSize = DefaultPurgeBatchSize
	}
	if opts.BatchSize < 0 {
		return 0, errors.New("PurgeOptions.BatchSize must be >= 0")
	}
	// A done or failed record the library wrote always has processed_at;
	// first_seen_at only stands in for rows written by hand without one.
	filter := `coalesce(processed_at, first_seen_at) < now() - make_interval(secs => $1) AND status IN ('done', 'failed')`
	args := []any{opts.OlderThan.Seconds(), opts.BatchSize}
	if opts.Consumer != "" {
		filter += ` AND consumer = $3`
		args = append(args, opts.Consumer)
	}
	q := `DELETE FROM ` + s.table + ` WHERE (consumer, message_key) IN (
SELECT consumer, message_key FROM ` + s.table + ` WHERE ` + filter + `
LIMIT $2 FOR UPDATE SKIP LOCKED)`

	var total int64
	for batch := 0; opts.MaxBatches == 0 || batch < opts.MaxBatches; batch++ {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		n, err := seam.Exec(ctx, db, q, args...)
		if err != nil {
			return total, fmt.Errorf("purge: %w", err)
		}
		total += n
		if n < int64(opts.BatchSize) {
			break
		}
	}
	return total, nil
}
