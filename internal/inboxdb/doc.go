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
package inboxdb
