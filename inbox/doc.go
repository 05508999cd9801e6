// Package inbox is the operator's view of the inbox table that the
// exactly-once middleware writes: one record per (consumer, message key)
// that was processed, is being processed (lease mode), failed, or is parked
// for an operator.
//
// A [Store] looks records up, forgets them (so that the next delivery runs
// again), lists and releases parked keys, counts records, and purges old
// ones in short batches for retention. The middleware itself needs none of
// this; claiming and completing keys happen inside it.
//
//	store, err := inbox.NewStore(db) // the same sqlschema.DB as the middleware's
//	n, err := store.Purge(ctx, inbox.PurgeOptions{OlderThan: 14 * 24 * time.Hour})
package inbox
