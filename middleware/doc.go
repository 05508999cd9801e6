// Package middleware gives Watermill handlers exactly-once effects by
// configuration. The transactional mode (the default) wraps a plain
// message.HandlerFunc:
//
//  1. It derives the message key (the message UUID by default) and the
//     consumer name (the router handler's name by default).
//  2. It begins a transaction and claims (consumer, key) in the inbox table.
//     A key already recorded is a duplicate: the message is acked and the
//     handler does not run.
//  3. It runs the handler with the transaction in its context: read it with
//     PgxTxFromContext, StdTxFromContext or TxFromContext and do the
//     handler's writes through it.
//  4. The messages the handler returns are written to the outbox table in
//     the same transaction (and not returned to the router, which would
//     publish them after the commit, non-atomically). The outbox.Relay
//     publishes them, keeping their UUIDs.
//  5. It commits and returns nil, so the router acks. A handler error or
//     panic rolls everything back and returns an error, so the router nacks
//     and the broker redelivers.
//
// Attach it to the whole router (router.AddMiddleware(eo.Middleware)) or to
// one handler (handler.AddMiddleware(eo.Middleware)): the Go analogue of
// marking a handler "process exactly once". Put Watermill's Retry middleware
// outside it (added before it) so each retry gets a fresh transaction, and
// PoisonQueue outside that for messages that can never succeed (an empty key
// is one: see ErrEmptyKey).
//
// Lease mode (Config.Mode = Lease) is for handlers whose effect is outside
// the database (an SMS gateway, a payment API). The claim is committed
// first, with a lease, so that no other worker runs the key meanwhile; the
// handler calls the provider with LeaseFromContext(ctx).IdempotencyKey,
// the same on every attempt; completion (the done record, the handler's
// writes through its context's transaction, its output messages) commits
// after. A handler error records the key failed (retried on the next
// delivery); Permanent(err) parks it for an operator; a worker that died
// mid-attempt is retried or parked after its lease expires (OnExpired).
// docs/guarantees.md states the one window a provider without idempotency
// keys leaves open.
//
// If the database is unreachable the middleware fails closed by default: it
// returns an error and the message is redelivered later. Config.FailOpen
// runs the handler without deduplication instead, and counts it.
package middleware
