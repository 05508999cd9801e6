// Package outbox is the transactional outbox: a Watermill message.Publisher
// bound to a database transaction, and the Relay that moves what it wrote to
// a real publisher (RabbitMQ, Kafka, anything Watermill speaks).
//
// Under the exactly-once middleware a handler's output messages are written
// to the outbox table in the same transaction as its other writes (returned
// messages, or exactlyonce.OutboxFromContext); outside it, a Writer (one per
// table, kept for the process's life) binds a Publisher to your own
// transaction (Writer.Publisher). Each row keeps the message's UUID,
// metadata and destination topic. Either everything commits or nothing does.
//
// State the database once (a sqlschema.DB) and hand the same value to the
// middleware, NewRelay and NewStore, the operator's view of the table
// (Store.Pending, Store.RequeueFailed, Store.Find and the others below).
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
//
// # Order
//
// A message without an ordering key is relayed in no guaranteed order.
// Ordering is by insertion, not by commit; per-topic order is kept among the
// rows of a batch that never failed, but not guaranteed across concurrent
// writers or relay workers, nor across a failure: a row whose publish failed
// waits out a backoff while the rows behind it are relayed (and is published
// ahead of the fresh rows of its next batch), a topic whose destination is
// not taking messages is paused while the other topics flow, and a row the
// broker can never take is quarantined (see RelayConfig.MaxAttempts) instead
// of blocking them.
//
// A message with an ordering key (msgid.SetOrderingKey: the metadata field
// msgid.OrderingKeyMetadata, at most MaxOrderingKeyBytes) is relayed in per-key
// order: the order in which the transactions that wrote its key's messages
// committed, and within one transaction the order it wrote them. Publish
// takes a transaction-level advisory lock per key before its INSERT, so a
// second transaction writing the key waits there until the first ends, and
// the ids of a key follow the commits; the relay publishes a row only when no
// earlier row of its key is left in the table (a row is deleted only once
// confirmed), so message n+1 of a key is never published before message n
// was confirmed, across failed publishes, retries, crashes, several relays
// and Workers. Within a batch the rows of one key go out one publish round
// each. A failing or quarantined row holds back the later rows of its key,
// and only those (Pending.BlockedKeys and Pending.Blocked count them), until
// it is published, requeued (it goes first again) or discarded (the key's
// next row goes: a gap). The relay stays at-least-once: a batch sent again
// repeats a key's messages from its head, which the consumer's inbox drops.
// Two transactions writing two keys in opposite orders can deadlock (one is
// aborted): write keys in a consistent order. On RabbitMQ,
// rabbitmq.PublisherConfig.Partitions carries the order to the consumer.
// docs/ordering.md states the guarantee, its assumptions, its costs and what
// breaks it.
//
// # Operations
//
// A Store (NewStore) is the operator's view of the table, as inbox.Store is
// of the inbox. Store.Pending reports the backlog (alert on
// Pending.OldestAge and Pending.Quarantined); Store.RequeueFailed puts every
// quarantined row back after the cause is fixed. For one row or a few,
// Store.Find (a Page at a time, as inbox.Store.FindParked), Count and Get
// find quarantined (or failing) rows by id, topic, message UUID, error text,
// quarantine time, ordering key or a metadata field such as a business id,
// with their payloads; Requeue and RequeueMatching send them again, at once
// and with their UUIDs; Discard and DiscardMatching delete them, and their
// messages are never published. The relay logs its failures through slog.Default()
// unless RelayConfig.Logger says otherwise, and reports tables that were
// never migrated as sqlschema.ErrNotMigrated.
package outbox
