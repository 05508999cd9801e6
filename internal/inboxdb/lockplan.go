package inboxdb

import (
	"context"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
)

// lockPlan is the partitioned layout's lock plan: the advisory locks every
// writer of the partitioned inbox takes, and in which order. Every writer
// takes its locks through its methods, with the statements of
// queries/postgres/placed and partitioned; lockOrder states the plan as
// data, and TestLockPlan checks the statements against it.
//
// PostgreSQL has no unique index across partitions (the primary key is
// (consumer, message_key, partition_at)), so the plan stands in for one:
//
//  1. The key lock. Every statement that may create a record of (consumer,
//     key) (a claim, by statements or by the claim functions of migration
//     inbox_002, a lease claim, a park) first takes a transaction-scoped
//     advisory lock on a hash of (table, consumer, key) (inboxpart.LockKey,
//     one definition shared with the claim functions), then looks the key
//     up in every partition, in a later statement, and inserts only when it
//     is absent. Under READ COMMITTED the look-up sees what the previous
//     holder committed; claims in the caller's transaction refuse other
//     levels (ErrNeedsReadCommitted). A batch takes its keys' locks in the
//     order of their hashes, so two batches sharing keys cannot deadlock. A
//     lease claim waits for it at most lock_timeout (LeaseBusy).
//  2. The key lock before an update by key in a transaction (lockRecord: a
//     lease step, a lock of a parked message, a forget or discard): a purge
//     moves a record to another partition under its key's lock, and an
//     UPDATE that met the move would fail with 40001; taken first, the
//     update sees the record where the move put it. Taken before any row
//     lock, as the move takes them, so the two cannot deadlock.
//  3. The fallback lock (two-key space: fallbackLockClass, hash of the
//     table). A fallback write (no partition is known to cover now and the
//     next interval: the record goes into the newest partition, see
//     placement) holds it shared from its transaction's first statement,
//     taken before its key's lock, and reads the newest partition's end
//     from the catalog in a later statement. A purge, once the partitions
//     due were created, takes it exclusively and lets it go (the fence):
//     every fallback write in flight has ended, and every later one sees a
//     newest partition that covers now, never one past retention.
//  4. The purge lock (two-key space: purgeLockClass), tried without
//     waiting by each transaction of a purge (both layouts): one purge of a
//     table at a time. A purge moves the records a partition past retention
//     must keep under their keys' locks, in hash order (as a batch claim
//     takes them), inside its purge-lock transaction.
//  5. The maintenance lock (two-key space: inboxpart.MaintenanceLockClass)
//     serialises the creation of partitions (inboxpart.Layout.Ensure).
//  6. Detach and drop take no advisory lock: DETACH ... CONCURRENTLY cannot
//     run in a transaction; its SHARE UPDATE EXCLUSIVE lock on the table
//     excludes another detach, and it runs after the fence and the moves.
//
// The cached end of the newest partition (partitionState) decides the
// placement before a writer's first statement, so that its lock statement
// and its insert agree; a writer never reads a fallback write's partition
// end from the cache.
type lockPlan struct {
	q  queries
	rt runTemplates
}

// lock is one lock of the plan.
type lock uint8

const (
	lockFallbackShared    lock = iota + 1 // the fallback lock, shared
	lockFallbackExclusive                 // the fallback lock, exclusive: the fence
	lockKey                               // one key's lock
	lockKeysHashOrder                     // several keys' locks, in the order of their hashes
	lockPurgeTry                          // the purge lock, without waiting
	lockMaintenance                       // the maintenance lock
)

// String names the lock.
func (l lock) String() string {
	switch l {
	case lockFallbackShared:
		return "fallback shared"
	case lockFallbackExclusive:
		return "fallback exclusive"
	case lockKey:
		return "key"
	case lockKeysHashOrder:
		return "keys in hash order"
	case lockPurgeTry:
		return "purge (try)"
	case lockMaintenance:
		return "maintenance"
	}
	return "none"
}

// operation is a writer of the partitioned layout.
type operation uint8

const (
	opClaim      operation = iota + 1 // ClaimTx, BeginClaimPgx by statements: creates a record
	opClaimBatch                      // ClaimBatchTx by statements
	opLeaseClaim                      // ClaimLease: creates a processing record
	opPark                            // Park: creates or parks a record
	opUpdate                          // an update by key in a transaction (lockRecord)
	opPurgeMove                       // a purge's move of the records to keep
	opFence                           // a purge's wait for the fallback writes
	opMaintain                        // the creation of partitions
	opDetachDrop                      // a purge's (or maintenance's) detach and drop
)

// lockOrder is the plan: the locks op takes, in order, for a write that is
// a fallback write or not (only writers that create a record tell them
// apart).
func lockOrder(op operation, fallback bool) []lock {
	creates := func(l lock) []lock {
		if fallback {
			return []lock{lockFallbackShared, l}
		}
		return []lock{l}
	}
	switch op {
	case opClaim, opLeaseClaim, opPark:
		return creates(lockKey)
	case opClaimBatch:
		return creates(lockKeysHashOrder)
	case opUpdate:
		return []lock{lockKey}
	case opPurgeMove:
		return []lock{lockPurgeTry, lockKeysHashOrder}
	case opFence:
		return []lock{lockFallbackExclusive}
	case opMaintain:
		return []lock{lockMaintenance}
	}
	return nil
}

// lockStatement names the statement that takes op's locks (for a placed
// operation, the name of the write at now; "Fallback" follows for a
// fallback write). The purge lock is ops.go's PurgeLock, the maintenance
// lock inboxpart's; the detach and drop take none.
func lockStatement(op operation) string {
	switch op {
	case opClaim:
		return "ClaimLock"
	case opClaimBatch:
		return "ClaimBatchLock"
	case opLeaseClaim:
		return "LeaseLock"
	case opPark:
		return "ParkLock"
	case opUpdate:
		return "KeyLock"
	case opPurgeMove:
		return "KeysLock"
	case opFence:
		return "FenceFallbackWrites"
	}
	return ""
}

// placed returns the statement called name for pl: its fallback rendering
// for a fallback write.
func (p lockPlan) placed(name string, pl placement) string {
	if pl.fallback {
		return p.q.get(name + fallbackSuffix)
	}
	return p.q.get(name)
}

// claim takes a claim's locks in tx ($1 consumer, $2 key), for pl.
func (p lockPlan) claim(ctx context.Context, tx wsql.ContextExecutor, pl placement, consumer, key string) error {
	_, err := tx.ExecContext(ctx, p.placed(lockStatement(opClaim), pl), consumer, key)
	return lockErr(err)
}

// beginClaim is the pgx fast path's BEGIN query that takes a claim's
// locks, with the escaped literals qc and qk.
func (p lockPlan) beginClaim(pl placement, qc, qk string) string {
	return p.rt.beginLock[b2i(pl.fallback)].Fill(qc, qk)
}

// claimBatch takes a batch claim's locks in tx: the sorted keys' locks in
// hash order, after the fallback lock for a fallback write.
func (p lockPlan) claimBatch(ctx context.Context, tx wsql.ContextExecutor, pl placement, consumer string, sorted []string) error {
	_, err := tx.ExecContext(ctx, p.placed(lockStatement(opClaimBatch), pl), consumer, sorted)
	return lockErr(err)
}

// leaseClaim takes a lease claim's locks in tx: the key's, waiting at most
// lockTimeout (milliseconds, as text), set after the fallback lock, which a
// purge's fence may hold for longer than a moment.
func (p lockPlan) leaseClaim(ctx context.Context, tx wsql.ContextExecutor, pl placement, consumer, key, lockTimeout string) error {
	_, err := tx.ExecContext(ctx, p.placed(lockStatement(opLeaseClaim), pl), consumer, key, lockTimeout)
	return err
}

// park takes a park's locks in tx.
func (p lockPlan) park(ctx context.Context, tx wsql.ContextExecutor, pl placement, consumer, key string) error {
	_, err := tx.ExecContext(ctx, p.placed(lockStatement(opPark), pl), consumer, key)
	return err
}

// lockKey takes the key's lock in tx before an update by key.
func (p lockPlan) lockKey(ctx context.Context, tx wsql.ContextExecutor, consumer, key string) error {
	_, err := tx.ExecContext(ctx, p.q.get(lockStatement(opUpdate)), consumer, key)
	return err
}

// lockKeys takes the keys' locks in tx, in hash order, before a purge
// moves their records (consumers[i], keys[i]).
func (p lockPlan) lockKeys(ctx context.Context, tx wsql.ContextExecutor, consumers, keys []string) error {
	_, err := tx.ExecContext(ctx, p.q.get(lockStatement(opPurgeMove)), consumers, keys)
	return err
}

// fence takes the fallback lock exclusively in tx, which the caller then
// commits.
func (p lockPlan) fence(ctx context.Context, tx wsql.ContextExecutor) error {
	_, err := tx.ExecContext(ctx, p.q.get(lockStatement(opFence)))
	return err
}
