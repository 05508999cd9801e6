package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// The ordered section (per-key order, docs/ordering.md). One schema, one
// plain queue (the unordered setup) and one partitioned topic of
// orderedPartitions queues (the ordered one). A round fills the outbox with
// the round's rows (1,000 ordering keys, the messages of a key spread over
// the backlog as concurrent writers would leave them; or one hot key; or no
// key at all), purges the queues, and times:
//
//   - relay: outbox.Relay (BatchSize, Workers and window of the relay
//     section) through rabbitmq.Publisher, partitioned for the keyed rows,
//     until every row is confirmed (or -relay-time);
//   - end to end: the relay and a consuming router started together, the
//     router with the middleware (per-message, or group commit + Exec) and
//     the router section's business INSERT, until the router handled every
//     message. Unordered: one queue, ConcurrentSubscriber with
//     orderedPartitions subscriptions (prefetch orderedPartitions each).
//     Ordered: rabbitmq.PartitionedSubscriber over orderedPartitions
//     partition queues (single active consumer, prefetch 1). Both have
//     orderedPartitions deliveries in flight;
//   - the bare broker consumer (amqp091, an ack per message) on each
//     layout: one queue with prefetch orderedPartitions (what lanes by key
//     inside one subscription would get from the broker) against the
//     partition queues with prefetch 1 each.

const (
	orderedPartitions = 16
	orderedKeys       = 1000
)

type orderedVariant string

const (
	relayUnordered orderedVariant = "relay, no key"
	relayOrdered   orderedVariant = "relay, 1,000 keys"
	relayHotKey    orderedVariant = "relay, one key"
	e2eUnordered   orderedVariant = "end to end, no key"
	e2eOrdered     orderedVariant = "end to end, 1,000 keys"
	e2eUnorderedGC orderedVariant = "end to end group commit, no key"
	e2eOrderedGC   orderedVariant = "end to end group commit, 1,000 keys"
	bareUnordered  orderedVariant = "bare consumer, one queue"
	bareOrdered    orderedVariant = "bare consumer, partitions"
)

var orderedVariants = []orderedVariant{relayUnordered, relayOrdered, relayHotKey, e2eUnordered, e2eOrdered, e2eUnorderedGC, e2eOrderedGC}

func (v orderedVariant) keys() int {
	switch v {
	case relayUnordered, e2eUnordered, e2eUnorderedGC:
		return 0
	case relayHotKey:
		return 1
	}
	return orderedKeys
}

func (v orderedVariant) endToEnd() bool { return strings.HasPrefix(string(v), "end to end") }

func (h *harness) orderedSection(ctx context.Context) ([]*line, error) {
	cfg := h.cfg
	db, err := h.newSchema(ctx, "ordered")
	if err != nil {
		return nil, err
	}
	env, err := newRouterEnv(ctx, cfg, db)
	if err != nil {
		return nil, err
	}
	defer env.pool.Close()
	plain, err := h.newQueue("ordered_plain")
	if err != nil {
		return nil, err
	}
	topic := "benchtable_ordered_" + h.id
	if err := rabbitmq.DeclarePartitions(ctx, cfg.amqpURL, topic, orderedPartitions); err != nil {
		return nil, err
	}
	parts := make([]string, orderedPartitions)
	for i := range parts {
		parts[i] = rabbitmq.PartitionQueue(topic, i)
	}
	h.queues = append(h.queues, parts...)
	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: cfg.amqpURL, Window: cfg.window,
		Partitions: map[string]int{topic: orderedPartitions}})
	if err != nil {
		return nil, err
	}
	defer func() { _ = pub.Close() }()

	rates := map[orderedVariant][]float64{}
	for r := range cfg.rounds {
		var out []string
		for j := range orderedVariants {
			v := orderedVariants[(j+r)%len(orderedVariants)]
			dest := plain
			if v.keys() > 0 {
				dest = topic
			}
			rate, n, err := h.orderedRound(ctx, env, pub, v, dest, append([]string{plain}, parts...), r)
			if err != nil {
				return nil, fmt.Errorf("round %d, %s: %w", r+1, v, err)
			}
			rates[v] = append(rates[v], rate)
			out = append(out, fmt.Sprintf("%s %s/s (%s)", v, thousands(int64(rate)), thousands(int64(n))))
		}
		// The bare broker consumer, both layouts, in alternating order.
		for j := range 2 {
			one := (j+r)%2 == 0
			qs, prefetch, v := parts, 1, bareOrdered
			if one {
				qs, prefetch, v = []string{plain}, orderedPartitions, bareUnordered
			}
			rate, err := h.bareRound(ctx, "ordered/"+string(v), qs, prefetch, cfg.orderedE2E, r)
			if err != nil {
				return nil, fmt.Errorf("round %d, %s: %w", r+1, v, err)
			}
			rates[v] = append(rates[v], rate)
			out = append(out, fmt.Sprintf("%s %s/s", v, thousands(int64(rate))))
		}
		logf("ordered round %d/%d: %s", r+1, cfg.rounds, strings.Join(out, "; "))
	}
	return []*line{
		{name: "relay alone, confirms", aName: "1,000 ordering keys", bName: "no ordering key", a: rates[relayOrdered], b: rates[relayUnordered], unit: "events/s",
			target: "A ≥ 10,000 events/s", check: func(a, _, _ float64) bool { return a >= 10_000 }},
		{name: "relay alone, confirms", aName: "one hot ordering key", bName: "no ordering key", a: rates[relayHotKey], b: rates[relayUnordered], unit: "events/s", target: "—"},
		{name: "end to end (relay + router), per-message", aName: "1,000 keys, partitions", bName: "no key, one queue", a: rates[e2eOrdered], b: rates[e2eUnordered], unit: "msg/s",
			target: "A/B ≥ 0.7", check: func(_, _, r float64) bool { return r >= 0.7 }},
		{name: "end to end (relay + router), group commit + Queue", aName: "1,000 keys, partitions", bName: "no key, one queue", a: rates[e2eOrderedGC], b: rates[e2eUnorderedGC], unit: "msg/s",
			target: "A/B ≥ 0.7", check: func(_, _, r float64) bool { return r >= 0.7 }},
		{name: "bare amqp091 consumer, ack each (the broker's share)", aName: "16 partition queues, prefetch 1 each", bName: "one queue, prefetch 16", a: rates[bareOrdered], b: rates[bareUnordered], unit: "msg/s", target: "—"},
	}, nil
}

// orderedRound fills the outbox with the variant's rows for dest and times
// their relaying (and consuming, end to end).
func (h *harness) orderedRound(ctx context.Context, env *routerEnv, pub *rabbitmq.Publisher, v orderedVariant, dest string, queues []string, round int) (float64, int, error) {
	cfg := h.cfg
	n := cfg.orderedRows
	if v.endToEnd() {
		n = cfg.orderedE2E
	}
	if err := h.exec(ctx, "TRUNCATE "+env.db.Outbox()+", "+env.business+", "+env.db.Inbox()); err != nil {
		return 0, 0, err
	}
	for _, q := range queues {
		if err := h.purge(q); err != nil {
			return 0, 0, err
		}
	}
	// The key of row g is k(g mod keys): a key's messages are spread over
	// the backlog, every key has a row in each stretch of 1,000.
	prefix := fmt.Sprintf("o%d-%s-", round, sanitize(string(v)))
	err := h.exec(ctx, "INSERT INTO "+env.db.Outbox()+` (topic, uuid, payload, metadata, ordering_key)
SELECT $1, $2 || g, $3::bytea,
  CASE WHEN $4 > 0 THEN jsonb_build_object('`+msgid.OrderingKeyMetadata+`', 'k' || (g % $4)) ELSE '{}'::jsonb END,
  CASE WHEN $4 > 0 THEN 'k' || (g % $4) END
FROM generate_series(1, $5::bigint) g`, dest, prefix, benchPayload, v.keys(), n)
	if err != nil {
		return 0, 0, fmt.Errorf("fill: %w", err)
	}
	if err := h.exec(ctx, "ANALYZE "+env.db.Outbox()); err != nil {
		return 0, 0, err
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: env.db, Publisher: pub, Logger: watermill.NopLogger{},
		BatchSize: cfg.relayBatch, Workers: cfg.relayWorkers})
	if err != nil {
		return 0, 0, err
	}
	var handled int
	var wall time.Duration
	err = h.timed("ordered/"+string(v), func() (int, time.Duration, error) {
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		relayDone := make(chan error, 1)
		start := time.Now()
		if !v.endToEnd() {
			go func() { relayDone <- relay.Run(rctx) }()
			handled, wall = until(ctx, start, n, cfg.relayTime, func() int { return int(relay.Stats().Relayed) })
			cancel()
			return handled, wall, <-relayDone
		}
		hv := perMessage
		if strings.Contains(string(v), "group commit") {
			hv = groupCommitExec
		}
		handler, err := env.handler(hv)
		if err != nil {
			return 0, 0, err
		}
		d := newDrain(n)
		go func() { relayDone <- relay.Run(rctx) }()
		err = runOrderedRouter(ctx, cfg.amqpURL, dest, v.keys() > 0, d, handler, 10*time.Minute)
		cancel()
		if rerr := <-relayDone; err == nil {
			err = rerr
		}
		handled, wall = int(d.ok.Load()), d.end.Sub(start)
		return handled, wall, err
	})
	if err != nil {
		return 0, 0, err
	}
	if st := relay.Stats(); st.Failures > 0 {
		return 0, 0, fmt.Errorf("relay: %d failed batches, last: %w", st.Failures, st.LastError)
	}
	return float64(handled) / wall.Seconds(), handled, nil
}

// runOrderedRouter is runRouter for the two setups of the section: the
// partitioned topic through PartitionedSubscriber, or one queue through
// ConcurrentSubscriber, orderedPartitions deliveries in flight either way.
func runOrderedRouter(ctx context.Context, amqpURL, dest string, ordered bool, d *drain, h message.HandlerFunc, timeout time.Duration) error {
	sc := wamqp.NewDurableQueueConfig(amqpURL)
	sc.Consume.Qos.PrefetchCount = orderedPartitions
	if ordered {
		sc.Queue.Arguments = rabbitmq.PartitionQueueArguments()
		sc.Consume.Qos.PrefetchCount = 1
	}
	sc.Marshaler = rabbitmq.Marshaler{}
	sub, err := wamqp.NewSubscriber(sc, watermill.NopLogger{})
	if err != nil {
		return err
	}
	s := exactlyonce.ConcurrentSubscriber(sub, orderedPartitions)
	if ordered {
		s = rabbitmq.PartitionedSubscriber(sub, orderedPartitions)
	}
	return runRouterOn(ctx, s, dest, d, h, timeout)
}

// bareDrain times a bare amqp091 consumer (no Watermill, no database, an ack
// per message) draining n pre-filled messages: from one queue with one
// consumer of prefetch orderedPartitions (what lanes by key inside one
// subscription would get from the broker), or from the orderedPartitions
// partition queues with a consumer of prefetch 1 each (what partitions with
// one message in flight each get). It is the broker's share of the choice
// between the two designs.
func (h *harness) bareDrain(ctx context.Context, queues []string, prefetch, n int) (int, time.Duration, error) {
	var chans []*amqp.Channel
	defer func() {
		for _, ch := range chans {
			_ = ch.Close()
		}
	}()
	done := make(chan struct{})
	var acked atomic.Int64
	errs := make(chan error, len(queues))
	var start time.Time // the first delivery's arrival, as the router lines time
	var first sync.Once
	var end atomic.Int64
	for _, q := range queues {
		ch, err := h.amqp.Channel()
		if err != nil {
			return 0, 0, err
		}
		chans = append(chans, ch)
		if err := ch.Qos(prefetch, 0, false); err != nil {
			return 0, 0, err
		}
		deliveries, err := ch.ConsumeWithContext(ctx, q, "", false, false, false, false, nil)
		if err != nil {
			return 0, 0, err
		}
		go func() {
			for d := range deliveries {
				first.Do(func() { start = time.Now() })
				if err := d.Ack(false); err != nil {
					errs <- err
					return
				}
				if acked.Add(1) == int64(n) {
					end.Store(int64(time.Since(start)))
					close(done)
				}
			}
		}()
	}
	select {
	case <-done:
	case err := <-errs:
		return 0, 0, err
	case <-time.After(5 * time.Minute):
		return 0, 0, fmt.Errorf("bare consumer: %d of %d messages within 5 minutes", acked.Load(), n)
	case <-ctx.Done():
		return 0, 0, ctx.Err()
	}
	return n, time.Duration(end.Load()), nil
}

// bareRound pre-fills the queues with n messages in all and times bareDrain.
func (h *harness) bareRound(ctx context.Context, id string, queues []string, prefetch, n, round int) (float64, error) {
	for _, q := range queues {
		if err := h.purge(q); err != nil {
			return 0, err
		}
	}
	for i, q := range queues {
		part := n/len(queues) + btoi(i < n%len(queues))
		if err := publishN(ctx, h.amqp, q, fmt.Sprintf("bare%d-%d-", round, i), 0, part); err != nil {
			return 0, err
		}
	}
	var got int
	var wall time.Duration
	err := h.timed(id, func() (int, time.Duration, error) {
		var err error
		got, wall, err = h.bareDrain(ctx, queues, prefetch, n)
		return got, wall, err
	})
	if err != nil {
		return 0, err
	}
	return float64(got) / wall.Seconds(), nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
