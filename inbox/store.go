package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxwrite"
	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	tenantpkg "github.com/exactlyonce/watermill-exactlyonce/internal/tenant"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// ErrNotFound is returned (wrapped) by Store.Get when the key has no record.
var ErrNotFound = inboxdb.ErrNotFound

// Store reads and edits the inbox table for operators and retention jobs.
// It is safe for concurrent use.
type Store struct {
	db     sqlschema.DB
	names  pgerr.Tables
	s      *inboxdb.Store
	outbox *outboxwrite.Writer // the replays' (ReplayParked)
}

// NewStore returns a Store for db's inbox table. db.Conn is required; the
// table must exist (sqlschema.Migrate). It does not touch the database.
func NewStore(db sqlschema.DB) (*Store, error) {
	if db.Conn == nil {
		return nil, errors.New("inbox: NewStore: DB.Conn is nil: set it to wsql.BeginnerFromPgx(pool) or wsql.BeginnerFromStdSQL(db)")
	}
	db = db.WithDefaults()
	s, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	if err != nil {
		return nil, fmt.Errorf("inbox: NewStore: %w", err)
	}
	ob, err := outboxwrite.New(db)
	if err != nil {
		return nil, fmt.Errorf("inbox: NewStore: %w", err)
	}
	return &Store{db: db, s: s, outbox: ob, names: pgerr.Tables{Schema: db.Schema, Inbox: db.InboxTable, Outbox: db.OutboxTable}}, nil
}

// Record is one row of the inbox.
type Record struct {
	Consumer string
	Key      string
	// Status is "processing" (lease mode: an attempt holds the key),
	// "done", "failed" (lease mode: the last attempt returned an error, or
	// an operator released the key; the next delivery runs again),
	// "parked" (waiting for an operator: see Store.Release) or "discarded"
	// (an operator discarded its parked message: deliveries are
	// acknowledged without running, as for done).
	Status string
	// Attempts counts the runs of the handler that claimed the key.
	Attempts int
	// Duplicates counts the deliveries recognised as duplicates.
	Duplicates int64
	// LeaseUntil is when a processing attempt's lease ends (lease mode).
	LeaseUntil *time.Time
	// FirstSeenAt is when the key was first claimed.
	FirstSeenAt time.Time
	// ProcessedAt is when the record last finished: done, failed, parked,
	// or released. Purge ages records by it.
	ProcessedAt *time.Time
	// LastError is the reason of the last failure or of the parking.
	LastError string
	// Interrupted is true when the key's latest attempt was cut off (lease
	// mode): its lease expired mid-attempt, or its completion failed after
	// the handler ran. Whether its effect happened is unknown.
	Interrupted bool
	// Interruptions counts the key's attempts that ended interrupted.
	Interruptions int

	// Version identifies the record's state: it changes whenever the
	// record is created, attempted, finished (done, failed, parked,
	// discarded) or released; not when a duplicate is counted or a lease
	// extended. Pass it in Expect.Version to forget or release exactly the
	// state that was shown. Compare it; never parse it.
	Version string
}

func record(r inboxdb.Record) Record {
	return Record{Consumer: r.Consumer, Key: r.Key, Status: r.Status, Attempts: r.Attempts, Duplicates: r.Duplicates,
		LeaseUntil: r.LeaseUntil, FirstSeenAt: r.FirstSeenAt, ProcessedAt: r.ProcessedAt, LastError: r.LastError,
		Interrupted: r.Interrupted, Interruptions: r.Interruptions,
		Version: parked.RecordVersion(r.Status, r.Attempts, r.FirstSeenAt, r.ProcessedAt)}
}

// Get returns the record of (consumer, key), or an error wrapping
// ErrNotFound.
func (s *Store) Get(ctx context.Context, consumer, key string) (Record, error) {
	r, err := s.s.Lookup(ctx, s.db.Conn, consumer, key)
	if err != nil {
		return Record{}, s.fail("get", err)
	}
	return record(r), nil
}

// Forget deletes the record of (consumer, key), so that the next delivery of
// that key runs the handler again, and the key's parked message (see
// FindParked) if it has one, in one transaction. It reports whether a
// record or a parked message existed. Use it to re-process a message on
// purpose; it undoes no effect.
//
// With an Expect (the Version, Status or parked MessageUUID that was
// shown), it forgets only while the key is still so, and otherwise returns
// an error wrapping ErrChanged (a key with no record: ErrNotFound), having
// changed nothing: a record done since it was shown parked stays, or its
// next delivery would run again.
func (s *Store) Forget(ctx context.Context, consumer, key string, expect Expect) (bool, error) {
	if err := expect.internal().ValidateRecord(); err != nil {
		return false, s.fail("forget", err)
	}
	var found bool
	err := s.inTx(ctx, func(tx wsql.Tx) error {
		if err := s.checkRecord(ctx, tx, consumer, key, expect); err != nil {
			return err
		}
		record, message, err := s.s.ForgetTx(ctx, tx, consumer, key)
		found = record || message
		return err
	})
	return found, s.fail("forget", err)
}

// checkRecord locks the key and checks expect against its record, when
// expect checks anything.
func (s *Store) checkRecord(ctx context.Context, tx wsql.Tx, consumer, key string, expect Expect) error {
	e := expect.internal()
	if e.Empty() {
		return nil
	}
	rec, uuid, found, err := s.s.LockRecord(ctx, tx, consumer, key)
	if err != nil {
		return err
	}
	if !found {
		return fmt.Errorf("%w (consumer %q, key %q)", ErrNotFound, consumer, key)
	}
	return e.CheckRecord(consumer, key, parked.RecordNow{Status: rec.Status, Attempts: rec.Attempts,
		FirstSeenAt: rec.FirstSeenAt, ProcessedAt: rec.ProcessedAt, MessageUUID: uuid})
}

// Parked returns up to limit parked records of consumer (every consumer
// when empty), oldest first; limit <= 0 means 100. These are the keys;
// FindParked finds the messages they were parked with.
func (s *Store) Parked(ctx context.Context, consumer string, limit int) ([]Record, error) {
	rs, err := s.s.ListParked(ctx, s.db.Conn, consumer, limit)
	if err != nil {
		return nil, s.fail("parked", err)
	}
	out := make([]Record, len(rs))
	for i, r := range rs {
		out[i] = record(r)
	}
	return out, nil
}

// Release turns a parked key into failed, so that its next delivery runs
// again (attempts+1, the same idempotency key in lease mode); for retention
// the record counts as finished now. It reports whether a parked record was
// found. The broker acked the parked message: the next delivery is a
// re-publish or a later duplicate; ReplayParked releases the key and
// re-publishes the parked message in one step.
//
// Release keeps the key's parked message: it stays listed (FindParked,
// with the key's status: failed, then done once a delivery processed it)
// until it is replayed or discarded (DiscardParked), or the key forgotten.
//
// With an Expect (the record's Version that was shown, say), it releases
// only while the key is still so, and otherwise returns an error wrapping
// ErrChanged (a key with no record: ErrNotFound), having changed nothing.
func (s *Store) Release(ctx context.Context, consumer, key string, expect Expect) (bool, error) {
	if err := expect.internal().ValidateRecord(); err != nil {
		return false, s.fail("release", err)
	}
	if expect.internal().Empty() {
		ok, err := s.s.Release(ctx, s.db.Conn, consumer, key)
		return ok, s.fail("release", err)
	}
	var ok bool
	err := s.inTx(ctx, func(tx wsql.Tx) error {
		if err := s.checkRecord(ctx, tx, consumer, key, expect); err != nil {
			return err
		}
		var err error
		ok, err = s.s.Release(ctx, tx, consumer, key)
		return err
	})
	return ok, s.fail("release", err)
}

// Stats summarises the inbox, or one consumer's part of it.
type Stats struct {
	// Rows counts records by status ("processing", "done", "failed",
	// "parked").
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
func (s *Store) Stats(ctx context.Context, consumer string) (Stats, error) {
	st, err := s.s.Stats(ctx, s.db.Conn, consumer)
	if err != nil {
		return Stats{}, s.fail("stats", err)
	}
	return Stats{Rows: st.Rows, Total: st.Total, Duplicates: st.Duplicates, OldestFirstSeen: st.OldestFirstSeen}, nil
}

// TenantStats is Stats of one tenant's keys (keys scoped by
// exactlyonce.KeyByTenant) of consumer, or of every consumer when consumer
// is empty. It reads every key of the consumer (the table has no index on
// the tenant alone): an operator's query.
func (s *Store) TenantStats(ctx context.Context, consumer, tenant string) (Stats, error) {
	if tenant == "" {
		return Stats{}, errors.New("inbox: TenantStats: empty tenant (Stats counts every key)")
	}
	st, err := s.s.TenantStats(ctx, s.db.Conn, consumer, tenant)
	if err != nil {
		return Stats{}, s.fail("stats", err)
	}
	return Stats{Rows: st.Rows, Total: st.Total, Duplicates: st.Duplicates, OldestFirstSeen: st.OldestFirstSeen}, nil
}

// TenantKey is the inbox key exactlyonce.KeyByTenant records for key within
// tenant: what Get, Forget and Release take for a tenant-scoped consumer.
func TenantKey(tenant, key string) (string, error) {
	k, err := tenantpkg.Key(tenant, key)
	if err != nil {
		return "", fmt.Errorf("inbox: TenantKey: %w", err)
	}
	return k, nil
}

// PurgeOptions selects what Purge deletes.
type PurgeOptions struct {
	// OlderThan deletes records that finished (done, or failed) more than
	// this long ago, however long ago they were first seen. Required (> 0).
	// Choose it longer than the longest time your broker may still
	// redeliver a message after it was processed.
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
	// Progress, when set, is called after each batch (or dropped partition)
	// with the number of rows it removed (possibly 0 for the last batch):
	// for metrics and logs. It runs on Purge's goroutine.
	Progress func(deleted int64)
	// Tenant limits the purge to one tenant's keys (keys scoped by
	// exactlyonce.KeyByTenant). Empty means all. On the partitioned layout
	// such a purge deletes rows instead of dropping partitions, which hold
	// every tenant.
	Tenant string
}

// ErrPurgeRunning is returned (wrapped) by Purge when another purge of the
// same inbox table is running (in this process or another): at once,
// having deleted nothing, when the other held the purge lock at the first
// batch; or after some batches, with the rows deleted so far, when the other
// took the lock between two batches. Nothing is wrong: the other purge
// carries on; schedule the next run as usual.
var ErrPurgeRunning = inboxdb.ErrPurgeRunning

// Purge deletes records in status done or failed that finished more than
// opts.OlderThan ago (by processed_at, never by first_seen_at: a key parked
// for days and completed today is as young as any completed today), in
// batches, each its own short transaction that skips rows locked by others.
// Records processing (a live lease) or parked (waiting for an operator) are
// never purged. It returns the number of rows deleted, also when ctx ends it
// early. Run VACUUM (or let autovacuum) afterwards; see docs/operations.
//
// Only one purge of a table runs at a time, across processes: each batch
// takes a transaction-scoped advisory lock first (it works behind PgBouncer
// in transaction pooling), and a purge that finds it taken returns an error
// wrapping ErrPurgeRunning.
//
// On the partitioned layout (sqlschema.DB.Partitions) without
// opts.Consumer, Purge first creates the partitions due (MaintainPartitions),
// then drops each partition that ended more than OlderThan ago, after moving
// the records it must keep (not done — processing, failed, parked — or done
// less than OlderThan ago) into the current partition; a partition holding
// a record whose lease is still live waits for the next purge. A claim
// that commits into a partition while it is being removed (partition
// maintenance was behind, so claims went into the newest, old partition) is
// kept too: the purge waits for such claims before it looks for the records
// to keep. See docs/retention.md. With opts.Consumer it deletes rows as
// above.
func (s *Store) Purge(ctx context.Context, opts PurgeOptions) (int64, error) {
	n, err := s.s.Purge(ctx, s.db.Conn, inboxdb.PurgeOptions{
		OlderThan: opts.OlderThan, Consumer: opts.Consumer, BatchSize: opts.BatchSize, MaxBatches: opts.MaxBatches,
		Progress: opts.Progress, Tenant: opts.Tenant,
	})
	return n, s.fail("purge", err)
}

// MaintainPartitions creates the partitions of the partitioned layout
// (sqlschema.DB.Partitions) that are due: the current interval's and the
// Ahead intervals after it. Migrate and Purge run it too; run it (or Purge)
// at least every Ahead intervals. It returns the names created, and an
// error for the plain layout.
func (s *Store) MaintainPartitions(ctx context.Context) ([]string, error) {
	created, err := s.s.MaintainPartitions(ctx, s.db.Conn)
	return created, s.fail("maintain partitions", err)
}

// fail gives err one "inbox: " prefix and the not-migrated hint when the
// table is missing.
func (s *Store) fail(op string, err error) error {
	if err == nil {
		return nil
	}
	err = pgerr.IfNotMigrated(s.names, err)
	return fmt.Errorf("inbox: %s: %w", op, err)
}
