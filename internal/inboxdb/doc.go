// Package inboxdb is the store behind exactly-once message handling: a
// PostgreSQL table with one row per (consumer, message key) that a handler
// has processed.
//
// In transactional mode the row is inserted by [Store.ClaimTx] inside the
// same transaction as the handler's own writes: if the transaction commits,
// the key is recorded as done together with the effects; if it rolls back,
// nothing is recorded and a redelivery runs the handler again. A second
// transaction claiming the same key waits on the primary key until the first
// one ends, then sees its row and reports a duplicate. That is what makes the
// effects exactly-once per consumer, also across instances.
//
// The store works over pgx/v5 and database/sql through watermill-sql's small
// seam: pass sql.TxFromPgx(tx), sql.TxFromStdSQL(tx),
// sql.BeginnerFromPgx(pool) or sql.BeginnerFromStdSQL(db) from
// github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql wherever a
// sql.ContextExecutor is asked for.
//
// Lease mode's steps ([Store.ClaimLease] with a fencing token, ExtendLease,
// CompleteTx, Fail, ParkInterrupted, Owns) are here too. The package is
// internal: using the steps safely needs the unknown-outcome rules of the
// middleware (exactlyonce/lease.go), and operators use the public inbox
// package, which wraps the operations below.
//
// Errors carry no package prefix; the public package that returns them adds
// one.
//
// Every statement that parks a key (Park, Fail with permanent,
// ParkInterrupted, the lease claim that parks) also writes the message it
// was parked with ([ParkedMessage]) into the table of parked messages,
// <inbox>_parked, in the same statement (parked_write.go).
//
// Operations: [Store.Lookup] shows a key's record, [Store.Forget] deletes it
// and the message its park kept (the next delivery runs again), [Store.Stats] counts rows by status, and
// [Store.Purge] deletes old rows in small batches. Retention must outlast the
// longest time a broker may still redeliver a message: a key purged before
// its last redelivery is processed again.
//
// # Statements
//
// Every statement the store runs is in queries/postgres/*.sql (one
// directory per dialect), embedded, and rendered once per table set by
// NewStore (queries.go: plain/ and partitioned/ hold what only one layout
// runs; placed/ is rendered twice, for a write at clock_timestamp() and
// for a fallback write; fragments/ are pieces the others include). Values
// are parameters with their $N fixed in the file; nothing is concatenated
// at call time but the run-time templates (sqlexec.Template), filled with
// what cannot be a parameter:
//
//   - the pgx fast path's BEGIN queries (BeginClaimLiteral,
//     BeginClaimExecute, BeginClaimLock, BeginClaimFunc, DuplicateFuncCall,
//     RollbackDuplicateFuncCall): a multi-statement simple-protocol query
//     takes no parameters, so the consumer and key travel as literals,
//     escaped by pgconn (that query is what saves the round trip);
//     ClaimPrepare and BeginClaimExecute name the prepared statement, a
//     hash of the PREPARE, filled once in NewStore;
//   - the partitioned layout's statements that name a partition
//     (DetachConcurrently, DetachFinalize, AttachAgain, DropDetached,
//     CountDetachedAfter, CountDetachedOpen): PostgreSQL takes no
//     parameter for an identifier, and which partition is known at run
//     time only (inboxpart names them; its own CreatePartition and
//     AttachPartition are templates too);
//   - a parked-message filter's statements (FindParked and its variants,
//     CountParked, CountParkedMax, BoundedScanCount, LockParkedMessage,
//     DiscardParkedBatch): their Where hole is the conditions of the
//     filter's fields that are set, each with its parameter (parkedWhere),
//     so that the planner sees only those and picks the index that serves
//     them, also in a generic plan; a fixed statement with every condition
//     optional would be planned once for all filters (see parked.sql).
//
// TestQueriesPrepare has PostgreSQL parse and plan every statement of the
// plain, daily and hourly layouts, and runs the DDL templates on a sample
// partition.
//
// # MySQL/MariaDB
//
// On sqlschema.MySQL the statements are queries/mysql's (plain layout
// only; placeholders are ?, in the order of the text, so a filter's
// arguments follow the statement's own and the LIMIT comes last:
// filterArgs). There is no RETURNING and no data-modifying CTE: a claim
// is an INSERT ... ON DUPLICATE KEY UPDATE read by its affected rows and a
// locking read (claim.go); the batch claim marks its new records with a
// negated count (claimBatchMySQL); a park, forget, discard, batch discard
// and purge run their steps in one transaction (mysql.go). Two more
// run-time templates: ClaimBatchInsert (Rows: ClaimBatchRow per key) and
// ClaimBatchLock/ClaimBatchFix (Keys: a placeholder per key). The purge
// lock is a named lock of the session (GET_LOCK), released before its
// transaction ends. TestQueriesPrepareMySQL has MariaDB prepare every
// statement.
//
// # The partitioned layout's locks
//
// lockPlan (lockplan.go) states the plan once: which advisory locks a
// claim, a lease claim, a park, an update by key, a purge's move and
// fence, and partition maintenance take, and in which order; every writer
// of the partitioned layout takes its locks through it.
package inboxdb
