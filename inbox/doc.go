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
//
// # Parked messages
//
// A parked key keeps the message it was parked with (its UUID, topic,
// payload up to the middleware's limit, and metadata), in the table of
// parked messages next to the inbox. An operator finds it ([Store.FindParked],
// [Store.CountParked]: by consumer, key, message UUID, tenant, reason, time,
// or a metadata field such as a business id a producer sets; pages, oldest
// parked first), shows it ([Store.GetParked]), and then either replays it
// ([Store.ReplayParked]: the key is released and the message written to
// the outbox for its topic with its UUID, in one transaction; the relay
// publishes it and the consumer runs it once) or discards it
// ([Store.DiscardParked]: the key stays recorded, as discarded, so a late
// redelivery is still not run, unless it is forgotten too). Both work by filter as well
// ([Store.ReplayParkedMatching], [Store.DiscardParkedMatching]), in short
// transactions; count first.
//
//	page, err := store.FindParked(ctx, inbox.ParkedFilter{Consumer: "ship-order",
//		Metadata: map[string]string{"order_id": "A-1042"}}, inbox.Page{})
//	m, err := store.ReplayParked(ctx, page.Messages[0].Consumer, page.Messages[0].Key, inbox.ReplayOptions{})
//
// A parked message is kept until it is replayed or discarded, or its key
// forgotten: Purge never removes it, and Release keeps it (listed with the
// key's status). The Redis lease store (package redisstore) offers the
// same operations with the same types.
package inbox
