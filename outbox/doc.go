// Package outbox is the transactional outbox: a Watermill message.Publisher
// bound to a database transaction, and the Relay that moves what it wrote to
// a real publisher (RabbitMQ, Kafka, anything Watermill speaks).
//
// Under the exactly-once middleware a handler's output messages are written
// to the outbox table in the same transaction as its other writes (returned
// messages, or exactlyonce.OutboxFromContext); outside it, NewPublisher binds
// a Publisher to your own transaction. Each row keeps the message's UUID,
// metadata and destination topic. Either everything commits or nothing does.
//
// State the database once (a sqlschema.DB) and hand the same value to the
// middleware, NewRelay and the operator functions (PendingStats,
// RequeueFailed, FindRows and the others below).
//
// The Relay is at-least-once towards the broker: it locks a batch of rows
// (FOR UPDATE SKIP LOCKED, so several relays share the work without sending a
// row twice in the normal case), publishes them, and deletes them in the same
// transaction only after the publisher returned without error. With RabbitMQ,
// configure publisher confirms (watermill-amqp's ConfirmDelivery) so that
// "returned without error" means "the broker has it". If a later publish of
// a batch fails, the rows already accepted are still deleted. A publisher
// that also implements BatchPublisher (rabbitmq.Publisher, with a window of
// outstanding confirms) gets each batch in one call and says message by
// message which ones the broker confirmed. A crash
// between publish and commit sends the batch again; every relayed message keeps its original
// UUID, so the next consumer's inbox drops the repeat.
//
// Rows are picked in id order through the primary key, so the cost of a poll
// does not grow with the backlog, and no transaction-id ordering is used: a
// long transaction elsewhere in the database does not stall the relay.
// Ordering is by insertion, not by commit; per-topic order is kept among the
// rows of a batch that never failed, but not guaranteed across concurrent
// writers or relay workers, nor across a failure: a row whose publish failed
// waits out a backoff while the rows behind it are relayed (and is published
// ahead of the fresh rows of its next batch), a topic whose destination is
// not taking messages is paused while the other topics flow, and a row the
// broker can never take is quarantined (see RelayConfig.MaxAttempts) instead
// of blocking them.
//
// PendingStats reports the backlog (alert on Pending.OldestAge and
// Pending.Quarantined); RequeueFailed puts every quarantined row back after
// the cause is fixed. For one row or a few, FindRows, CountRows and GetRow
// find quarantined (or failing) rows by id, topic, message UUID, error text,
// quarantine time or a metadata field such as a business id, with their
// payloads; Requeue and RequeueMatching send them again, at once and with
// their UUIDs; Discard and DiscardMatching delete them, and their messages
// are never published. The relay logs its failures through slog.Default()
// unless RelayConfig.Logger says otherwise, and reports tables that were
// never migrated as sqlschema.ErrNotMigrated.
package outbox
