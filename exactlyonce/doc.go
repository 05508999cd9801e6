// Package exactlyonce gives Watermill handlers exactly-once effects by
// configuration. It is named as its folder, and sits next to Watermill's
// own middleware package without an alias:
//
//	import (
//		"github.com/ThreeDotsLabs/watermill/message/router/middleware"
//		"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
//	)
//
// # Transactional mode (the default)
//
// For handlers whose effects live in the same PostgreSQL database. For each
// delivery the middleware:
//
//  1. derives the message key (the message UUID by default: Config.Key) and
//     the consumer name (the router handler's name: Config.Consumer);
//  2. begins a transaction and claims (consumer, key) in the inbox table.
//     A key already recorded is a duplicate: the message is acked and the
//     handler does not run;
//  3. runs the handler with the transaction in its context: do the
//     handler's writes through PgxTxFromContext (or StdTxFromContext);
//  4. writes the messages the handler returns to the outbox table in the
//     same transaction (to the handler's publish topic, or SetDestination's)
//     and returns none to the router, which would publish them after the
//     commit, non-atomically. The outbox.Relay publishes them, keeping their
//     UUIDs, so the next consumer's inbox drops a re-sent one;
//  5. commits and returns nil: the router acks. A handler error or panic
//     rolls everything back and is returned: the router nacks and the broker
//     redelivers. Permanent(err) parks the key for an operator, keeping
//     the message with it, and acks.
//
// # Lease mode (Config.Lease set)
//
// For handlers whose effect is outside the database (an SMS gateway, an
// e-mail, a payment API). The claim commits first, with a lease, so that no
// other worker runs the key meanwhile; the handler calls the provider with
// InfoFromContext's IdempotencyKey, the same on every attempt; completion
// (the done record, the handler's writes through its context's
// transaction, its output messages) commits after. A handler error records
// the key failed, to be run again on the next delivery; a worker that died
// mid-attempt is retried after its lease expires, with Info.Interrupted
// set, and parked after LeaseConfig.MaxInterruptedAttempts.
// docs/guarantees.md states the one window a provider without idempotency
// keys leaves open. The records live in the PostgreSQL inbox by default, or
// in Redis with LeaseConfig.Store (package redisstore) for handlers whose
// only effect is external: the same rules, but a completion that holds
// only the done record (see LeaseStore, docs/redis.md).
//
// # Group commit (Config.Batch set)
//
// Transactional mode, many messages per transaction: the deliveries of a
// handler in flight at the same moment (ConcurrentSubscriber) share one
// transaction: one statement claims their keys, their handlers run in turn,
// one COMMIT, then every message is acked. A failing handler costs only its
// own message (the batch runs again without it). Exec lets handlers
// pipeline their writes. Same guarantees, several times the throughput.
//
// # Wiring
//
// Attach the middleware to the router (router.AddMiddleware(guard.Middleware))
// or to handlers (handler.AddMiddleware), never both to one handler: a
// handler whose modes differ gets its own Middleware, added to it, and
// none router-wide. A handler wrapped twice fails every delivery with
// ErrNestedMiddleware. Register handlers with OutboxOnly as their publisher,
// and with ConcurrentSubscriber for several deliveries in flight under one
// consumer name. Put Watermill's Retry middleware outside this one (added
// before it), so that each retry gets a fresh transaction, and
// PoisonQueueWithFilter(IsPermanent) outside that.
//
// # Failures
//
// The errors returned to the router wrap the Err* sentinels (branch with
// errors.Is) or Watermill's middleware.RecoveredPanicError. An unreachable
// database fails closed by default (nack, redelivered later);
// Config.FailOpen runs the handler without deduplication instead, and
// reports it. Tables that were never migrated are reported as
// sqlschema.ErrNotMigrated with the fix, never as an outage. Config.OnEvent
// sees the Outcome of every delivery.
package exactlyonce
