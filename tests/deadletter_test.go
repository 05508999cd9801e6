package tests

// Dead letters end to end: for every way a message gets parked (a
// Permanent handler error in transactional mode, lease mode after
// interruptions, lease mode's deterministic completion failure, group
// commit, the Redis lease store) and for an outbox row the relay
// quarantines, an operator finds the message by a business id its producer
// set (metadata order_id), the handler is fixed, the message is replayed (or
// the row requeued), and it is processed exactly once: its effect appears
// once, its output reaches the output queue once, a second replay is refused
// and a late redelivery of the original does not run the handler again.
// Also: discard (with and without Forget), bulk replay by filter, and two
// concurrent replays of one message.
//
// Everything runs through a real Watermill router consuming RabbitMQ
// (watermill-amqp), the exactly-once middleware, and an outbox relay
// (rabbitmq.Publisher) running in the background. Identifiers start with
// "dl".

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

const (
	// dlOrderIDKey and dlCustomerIDKey are the business ids the producer
	// puts in every order message's metadata; the operator searches by them.
	dlOrderIDKey    = "order_id"
	dlCustomerIDKey = "customer_id"
	// dlExpirationKey is an output metadata field that the relay's buggy
	// marshaler copies into the AMQP expiration property (see
	// dlExpiringMarshaler).
	dlExpirationKey = "expires"

	// dlLease is the lease of the lease-mode tests: the shortest allowed,
	// so that interruptions are noticed quickly.
	dlLease = time.Second
	// dlNackDelay paces the nacks of busy copies and failed completions.
	dlNackDelay = 50 * time.Millisecond
)

// ---------------------------------------------------------------------------
// Orders

// dlOrder is one "place order" message: its UUID (the inbox key), and the
// business ids its producer sets in the metadata.
type dlOrder struct {
	UUID, ID, Customer string
}

// dlNewOrder returns an order of customer with fresh ids.
func dlNewOrder(customer string) dlOrder {
	return dlOrder{UUID: watermill.NewUUID(), ID: "ord-" + watermill.NewShortUUID(), Customer: customer}
}

// Payload is the order's JSON payload.
func (o dlOrder) Payload() []byte {
	b, _ := json.Marshal(map[string]any{dlOrderIDKey: o.ID, dlCustomerIDKey: o.Customer, "sku": "sku-42", "qty": 2})
	return b
}

// Message is the order as its producer publishes it.
func (o dlOrder) Message() *message.Message {
	m := message.NewMessage(o.UUID, o.Payload())
	m.Metadata.Set(dlOrderIDKey, o.ID)
	m.Metadata.Set(dlCustomerIDKey, o.Customer)
	return m
}

// dlOutputUUID is the UUID of the output message of the handler run for
// the input message uuid: the same on every run, so that a second output
// would show as a second message with this UUID.
func dlOutputUUID(uuid string) string { return uuid + "-confirmed" }

// dlOutputs returns the output UUIDs of orders.
func dlOutputs(orders ...dlOrder) []string {
	out := make([]string, len(orders))
	for i, o := range orders {
		out[i] = dlOutputUUID(o.UUID)
	}
	return out
}

// ---------------------------------------------------------------------------
// The handler and its faults

// dlFault is what is wrong with an order until the test "fixes" it.
type dlFault int

const (
	_ dlFault = iota // healthy
	// dlPermanent: the handler refuses the order (exactlyonce.Permanent).
	dlPermanent
	// dlOutlive: the handler blocks (before its effect) until the test
	// releases it, outliving its lease.
	dlOutlive
	// dlCompletion: the handler's completion transaction can never
	// commit (a deferred unique constraint fails at COMMIT).
	dlCompletion
	// dlExpiration: the handler's output carries an expiration that the
	// relay's buggy marshaler passes to RabbitMQ, which refuses it.
	dlExpiration
)

// dlFaults is the set of broken orders, by order id; safe for concurrent
// use.
type dlFaults struct {
	mu sync.Mutex
	m  map[string]dlFault
}

// Break makes orders fail with fault until fixed.
func (f *dlFaults) Break(fault dlFault, orders ...dlOrder) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.m == nil {
		f.m = map[string]dlFault{}
	}
	for _, o := range orders {
		f.m[o.ID] = fault
	}
}

// FixAll fixes every order.
func (f *dlFaults) FixAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.m = nil
}

// Fault returns the fault of order id.
func (f *dlFaults) Fault(id string) dlFault {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.m[id]
}

// dlRuns records the handler runs per message UUID, with the Info each
// got; safe for concurrent use.
type dlRuns struct {
	mu   sync.Mutex
	runs map[string][]exactlyonce.Info
}

// add records a run of uuid and returns its number (1 for the first).
func (r *dlRuns) add(uuid string, info exactlyonce.Info) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.runs == nil {
		r.runs = map[string][]exactlyonce.Info{}
	}
	r.runs[uuid] = append(r.runs[uuid], info)
	return len(r.runs[uuid])
}

// Of returns the runs of uuid, in order.
func (r *dlRuns) Of(uuid string) []exactlyonce.Info {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]exactlyonce.Info(nil), r.runs[uuid]...)
}

// dlShop is the order handler of the PostgreSQL modes: for a healthy order
// it writes one effect row (note: the order id) through the middleware's
// transaction and returns one output message (dlOutputUUID) carrying the
// order id. Its faults (dlFaults) make it fail in each way a message gets
// parked or its output quarantined.
type dlShop struct {
	e        *e2e
	deferred string // the table whose deferred constraint fails at COMMIT
	dlFaults
	dlRuns

	held     chan struct{} // closed by ReleaseHeld
	heldOnce sync.Once
}

// ReleaseHeld lets every run blocked by dlOutlive go on (and every later
// one run through).
func (s *dlShop) ReleaseHeld() { s.heldOnce.Do(func() { close(s.held) }) }

// Handle is the message.HandlerFunc.
func (s *dlShop) Handle(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	info, err := exactlyonce.InfoFromContext(ctx)
	if err != nil {
		return nil, err
	}
	id := msg.Metadata.Get(dlOrderIDKey)
	fault := s.Fault(id)
	n := s.add(msg.UUID, info)
	switch fault {
	case dlPermanent:
		return nil, exactlyonce.Permanent(fmt.Errorf("order %s: unknown sku", id))
	case dlOutlive:
		select {
		case <-s.held:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if err := s.e.Effects.InsertNote(ctx, msg.UUID, n, id); err != nil {
		return nil, err
	}
	if fault == dlCompletion {
		if err := testenv.Exec(ctx, "INSERT INTO "+s.deferred+" (id) VALUES (1), (1)"); err != nil {
			return nil, err
		}
	}
	out := message.NewMessage(dlOutputUUID(msg.UUID), []byte(`{"order_id":"`+id+`","status":"confirmed"}`))
	out.Metadata.Set(dlOrderIDKey, id)
	if fault == dlExpiration {
		out.Metadata.Set(dlExpirationKey, "one week")
	}
	return []*message.Message{out}, nil
}

// dlExpiringMarshaler is the relay's marshaler: rabbitmq.Marshaler, plus,
// while buggy is set, the output's "expires" metadata copied into the AMQP
// expiration property. RabbitMQ refuses an expiration that is not a number
// (PRECONDITION_FAILED, the channel closed), which rabbitmq.Publisher marks
// permanent: the relay quarantines the row.
type dlExpiringMarshaler struct{ buggy *atomic.Bool }

func (m dlExpiringMarshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	p, err := rabbitmq.Marshaler{}.Marshal(msg)
	if v := msg.Metadata.Get(dlExpirationKey); err == nil && v != "" && m.buggy.Load() {
		p.Expiration = v
	}
	return p, err
}

// ---------------------------------------------------------------------------
// Test bundle of the PostgreSQL modes

// dlEnv is one dead-letter scenario on PostgreSQL: the e2e bundle, the
// order handler, the operator's inbox store, a relay running in the
// background (relaying the handler's outputs to Out and the replays to In),
// a collector of the output queue, and the router once started.
type dlEnv struct {
	*e2e
	consumer   string
	shop       *dlShop
	store      *inbox.Store
	relay      *outbox.Relay
	outputs    *collector
	deliveries *deliveryLog
	router     *message.Router
	// relayBug is the relay marshaler's bug (dlExpiringMarshaler), on at
	// the start.
	relayBug atomic.Bool
}

// dlSetup creates the scenario: the collector of e.Out and the relay start
// now; the router with startRouter.
func dlSetup(t *testing.T, e *e2e, consumer string) *dlEnv {
	t.Helper()
	d := &dlEnv{e2e: e, consumer: consumer, store: inboxStore(t, e.DB), deliveries: &deliveryLog{}}
	d.relayBug.Store(true)
	d.shop = &dlShop{e: e, deferred: e.Table("dl_deferred"), held: make(chan struct{})}
	t.Cleanup(d.shop.ReleaseHeld)
	e.Exec(t, "CREATE TABLE "+d.shop.deferred+" (id int, CONSTRAINT dl_one_each UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)")
	d.outputs = collect(t, e.Out)
	d.relay = dlStartRelay(t, e.DB, dlExpiringMarshaler{buggy: &d.relayBug})
	return d
}

// dlStartRelay runs a relay of db's outbox to RabbitMQ (rabbitmq.Publisher
// with marshaler; quarantining a row after 2 permanent failures) in the
// background until cleanup.
func dlStartRelay(t testing.TB, db sqlschema.DB, marshaler dlExpiringMarshaler) *outbox.Relay {
	t.Helper()
	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: testenv.AMQPURL(), Marshaler: marshaler})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	relay := newRelay(t, outbox.RelayConfig{
		DB: db, Publisher: pub, ListenConnString: testenv.ListenConnString(), MaxAttempts: 2,
		PollInterval: 50 * time.Millisecond, ErrorBackoff: 20 * time.Millisecond, MaxErrorBackoff: 200 * time.Millisecond,
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("relay stopped with an error: %v", err)
			}
		case <-time.After(waitTimeout):
			t.Errorf("relay did not stop within %s", waitTimeout)
		}
	})
	return relay
}

// startRouter starts the router: one handler named d.consumer (the
// consumer name) consuming In with subs deliveries in flight
// (ConcurrentSubscriber when > 1), publishing to Out through the outbox,
// under the middleware configured by cfg (on the bundle's database,
// reporting to e.Log).
func (d *dlEnv) startRouter(t *testing.T, cfg exactlyonce.Config, subs int) {
	t.Helper()
	sub := testenv.AMQPSubscriber(t, 0)
	if subs > 1 {
		sub = exactlyonce.ConcurrentSubscriber(sub, subs)
	}
	d.router = newRouter(t)
	d.router.AddMiddleware(d.deliveries.Middleware, d.Middleware(t, cfg).Middleware)
	d.router.AddHandler(d.consumer, d.In, sub, d.Out, outboxOnly(t), d.shop.Handle)
	testenv.StartRouter(t, d.router)
}

// publish publishes orders (in this order) to In, confirmed.
func (d *dlEnv) publish(t testing.TB, orders ...dlOrder) {
	t.Helper()
	msgs := make([]*message.Message, len(orders))
	for i, o := range orders {
		msgs[i] = o.Message()
	}
	require.NoError(t, d.Pub.Publish(d.In, msgs...))
}

// dlEventsOf returns the events of key with outcome o, in order.
func dlEventsOf(log *eventLog, key string, o exactlyonce.Outcome) []timedEvent {
	var out []timedEvent
	for _, ev := range log.OfKey(key) {
		if ev.Outcome == o {
			out = append(out, ev)
		}
	}
	return out
}

// dlAwait waits until log saw at least n events of key with outcome o, and
// returns them.
func dlAwait(t testing.TB, log *eventLog, key string, o exactlyonce.Outcome, n int) []timedEvent {
	t.Helper()
	testenv.Eventually(t, waitTimeout, func() bool { return len(dlEventsOf(log, key, o)) >= n },
		"expected %d %q event(s) of key %s", n, o, key)
	return dlEventsOf(log, key, o)
}

// awaitOutput waits until the output of o arrived on Out.
func (d *dlEnv) awaitOutput(t testing.TB, o dlOrder) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, func() bool { return len(d.outputs.Get(dlOutputUUID(o.UUID))) > 0 },
		"expected the output of order %s on the output queue", o.ID)
}

// findParked is the operator's search by business id: the parked messages
// whose metadata has order_id = o.ID (any consumer), with their payloads.
func (d *dlEnv) findParked(t testing.TB, o dlOrder) []inbox.ParkedMessage {
	t.Helper()
	page, err := d.store.FindParked(testCtx(t), inbox.ParkedFilter{Metadata: map[string]string{dlOrderIDKey: o.ID}}, inbox.Page{Payloads: true})
	require.NoError(t, err)
	require.Empty(t, page.Next, "one page")
	return page.Messages
}

// requireParked finds the parked message of o by its order id and checks
// what was kept: the message as it was consumed (UUID, payload, metadata,
// the topic In), the consumer and key, the reason (containing reason), and
// that the key is parked with no effect and no output. GetParked shows the
// same message.
func (d *dlEnv) requireParked(t testing.TB, o dlOrder, reason string) inbox.ParkedMessage {
	t.Helper()
	found := d.findParked(t, o)
	require.Len(t, found, 1, "parked messages of order %s", o.ID)
	m := found[0]
	dlRequireKept(t, m, d.consumer, o, d.In, reason)
	got, err := d.store.GetParked(testCtx(t), d.consumer, o.UUID)
	require.NoError(t, err)
	require.Equal(t, m, got, "GetParked shows what FindParked found")
	require.Zero(t, d.Effects.Count(t, o.UUID), "no effect of a parked order")
	require.Empty(t, d.outputs.Get(dlOutputUUID(o.UUID)), "no output of a parked order")
	return m
}

// dlRequireKept checks a parked message of order o, consumed by consumer
// from topic, parked for reason.
func dlRequireKept(t testing.TB, m inbox.ParkedMessage, consumer string, o dlOrder, topic, reason string) {
	t.Helper()
	require.Equal(t, consumer, m.Consumer, "consumer")
	require.Equal(t, o.UUID, m.Key, "key (the message UUID)")
	require.Equal(t, o.UUID, m.UUID, "message UUID")
	require.Equal(t, topic, m.Topic, "the topic it was consumed from")
	require.True(t, m.PayloadKept, "payload kept")
	require.Equal(t, string(o.Payload()), string(m.Payload), "payload")
	require.Equal(t, len(o.Payload()), m.PayloadSize, "payload size")
	require.Equal(t, o.ID, m.Metadata[dlOrderIDKey], "metadata %s", dlOrderIDKey)
	require.Equal(t, o.Customer, m.Metadata[dlCustomerIDKey], "metadata %s", dlCustomerIDKey)
	require.Contains(t, m.Reason, reason, "reason")
	require.Equal(t, inboxdb.StatusParked, m.Status, "the key's status")
	require.False(t, m.ParkedAt.IsZero(), "parked at")
	require.False(t, m.FirstSeenAt.After(m.ParkedAt), "first seen %s after parked %s", m.FirstSeenAt, m.ParkedAt)
}

// replayOnce replays the parked message of o (the handler was fixed) and
// checks that it is processed exactly once: the replay returns the message
// with its original UUID and topic; the router processes it once (one more
// handler run, one effect row, the output on Out); the parked message is
// gone and the key done. Then a second replay is refused (ErrNotParked),
// and a late redelivery of the original message (the same UUID published
// again) is a duplicate: no handler run, still one effect. It returns the
// replayed run's Info.
func (d *dlEnv) replayOnce(t testing.TB, o dlOrder) exactlyonce.Info {
	t.Helper()
	ctx := testCtx(t)
	runsBefore := len(d.shop.Of(o.UUID))
	require.Empty(t, dlEventsOf(d.Log, o.UUID, exactlyonce.Processed), "processed before the replay")

	m, err := d.store.ReplayParked(ctx, d.consumer, o.UUID, inbox.ReplayOptions{})
	require.NoError(t, err, "replay")
	require.Equal(t, o.UUID, m.UUID, "replayed with its original UUID")
	require.Equal(t, d.In, m.Topic, "replayed to the topic it was consumed from")
	require.Equal(t, inboxdb.StatusParked, m.Status, "the key's status before the replay")
	require.Equal(t, string(o.Payload()), string(m.Payload), "replayed payload")

	dlAwait(t, d.Log, o.UUID, exactlyonce.Processed, 1)
	d.awaitOutput(t, o)
	runs := d.shop.Of(o.UUID)
	require.Len(t, runs, runsBefore+1, "the replay runs the handler once")
	require.Equal(t, int64(1), d.Effects.Count(t, o.UUID), "one effect after the replay")
	require.Equal(t, []string{o.ID}, d.Effects.Notes(t, o.UUID), "the effect is the order's")
	require.Equal(t, inboxdb.StatusDone, inboxRecord(t, d.DB, d.consumer, o.UUID).Status, "the key is done")
	require.Empty(t, d.findParked(t, o), "the replayed message is no longer parked")

	_, err = d.store.ReplayParked(ctx, d.consumer, o.UUID, inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrNotParked, "a second replay")

	d.publish(t, o)
	dlAwait(t, d.Log, o.UUID, exactlyonce.Duplicate, 1)
	require.Len(t, d.shop.Of(o.UUID), runsBefore+1, "a late redelivery does not run the handler")
	require.Equal(t, int64(1), d.Effects.Count(t, o.UUID), "one effect after a late redelivery")
	require.Len(t, dlEventsOf(d.Log, o.UUID, exactlyonce.Processed), 1, "processed events")
	require.Len(t, dlEventsOf(d.Log, o.UUID, exactlyonce.Duplicate), 1, "duplicate events: the late redelivery only (the replay was delivered once)")
	return runs[len(runs)-1]
}

// finish waits until the outbox is empty and the outputs of want arrived,
// stops the router and the collector, and requires that Out received
// exactly want, each once, and that both queues were drained.
func (d *dlEnv) finish(t testing.TB, want ...string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, func() bool { return outboxPending(t, d.DB) == 0 }, "outbox not relayed")
	testenv.Eventually(t, waitTimeout, func() bool {
		for _, u := range want {
			if len(d.outputs.Get(u)) == 0 {
				return false
			}
		}
		return true
	}, "expected outputs %v", want)
	closeRouter(t, d.router)
	d.outputs.Stop(t)
	require.ElementsMatch(t, want, d.outputs.UUIDs(), "output queue: each expected output exactly once, nothing else")
	requireQueueDrained(t, d.Out)
	requireQueueDrained(t, d.In)
	require.Zero(t, d.Log.Rejected.Load()+d.Log.ClaimFailed.Load()+d.Log.DBUnavailable.Load()+d.Log.FailOpen.Load(),
		"rejected, claim failures, database unavailable or fail-open deliveries")
}

// ---------------------------------------------------------------------------
// 1. Transactional mode: a Permanent handler error

// TestDeadLetterTransactionalPermanent: the handler refuses one order with
// exactlyonce.Permanent; the key is parked with the message and the
// delivery acked, while another order flows. The operator finds the
// message by its order id, the handler is fixed, the message is replayed
// (through the outbox and the relay, to the queue it came from), and it is
// processed exactly once (replayOnce).
func TestDeadLetterTransactionalPermanent(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		d := dlSetup(t, e, "dl-orders")
		d.startRouter(t, exactlyonce.Config{NackDelay: dlNackDelay}, 1)
		poison, healthy := dlNewOrder("cust-1"), dlNewOrder("cust-1")
		d.shop.Break(dlPermanent, poison)

		d.publish(t, poison, healthy)
		parked := dlAwait(t, d.Log, poison.UUID, exactlyonce.Parked, 1)
		require.True(t, exactlyonce.IsPermanent(parked[0].Err), "the parked event carries the permanent error: %v", parked[0].Err)
		dlAwait(t, d.Log, healthy.UUID, exactlyonce.Processed, 1)
		d.awaitOutput(t, healthy)

		m := d.requireParked(t, poison, "permanent: order "+poison.ID+": unknown sku")
		require.Equal(t, "permanent: order "+poison.ID+": unknown sku", m.Reason)
		require.Len(t, d.shop.Of(poison.UUID), 1, "runs before the fix")

		d.shop.FixAll()
		d.replayOnce(t, poison)
		require.Equal(t, 3, d.deliveries.Seen()[poison.UUID], "deliveries of the parked message: original, replay, late redelivery")
		require.Equal(t, int64(1), d.Effects.Count(t, healthy.UUID))
		d.finish(t, dlOutputs(healthy, poison)...)
	})
}

// ---------------------------------------------------------------------------
// 2. Lease mode (PostgreSQL store): interruptions

// TestDeadLetterLeaseInterrupted: lease mode, MaxInterruptedAttempts 2,
// a 1s lease. The handler of one order outlives its lease (it blocks until
// released); three copies of the message are in flight on three consumers.
// Attempt 1 blocks; once its lease expired a second copy takes the key over
// (attempt 2, interrupted) and blocks too; once that lease expired the
// third copy parks the key (two interrupted attempts) with the message.
// Released, the two stale runs try to complete: refused (lease lost), no
// effect, their deliveries redelivered and acked as parked. The operator
// finds the message, the handler is fixed, the replay runs attempt 3,
// interrupted, with the same idempotency key, once.
func TestDeadLetterLeaseInterrupted(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		d := dlSetup(t, e, "dl-lease-orders")
		d.startRouter(t, exactlyonce.Config{
			Lease: &exactlyonce.LeaseConfig{Duration: dlLease, MaxInterruptedAttempts: 2}, NackDelay: dlNackDelay,
		}, 3)
		slow, healthy := dlNewOrder("cust-2"), dlNewOrder("cust-2")
		d.shop.Break(dlOutlive, slow)

		d.publish(t, healthy, slow, slow, slow)
		dlAwait(t, d.Log, healthy.UUID, exactlyonce.Processed, 1)
		parked := dlAwait(t, d.Log, slow.UUID, exactlyonce.Parked, 1)
		require.ErrorContains(t, parked[0].Err, "lease expired during attempt 2", "the parked event's reason")
		runs := d.shop.Of(slow.UUID)
		require.Len(t, runs, 2, "attempts run before the park (both still blocked)")
		require.Equal(t, 1, runs[0].Attempt)
		require.False(t, runs[0].Interrupted)
		require.Equal(t, 2, runs[1].Attempt)
		require.True(t, runs[1].Interrupted, "attempt 2 took over an expired lease")
		require.Equal(t, runs[0].IdempotencyKey, runs[1].IdempotencyKey)

		// The stale runs go on: their completions must be refused.
		d.shop.ReleaseHeld()
		lost := func() int { return len(d.Log.Of(exactlyonce.Nacked, exactlyonce.ErrLeaseLost)) }
		testenv.Eventually(t, waitTimeout, func() bool {
			return lost() >= 2 && len(dlEventsOf(d.Log, slow.UUID, exactlyonce.Parked)) >= 3
		}, "expected both stale completions refused and their redeliveries acked as parked")
		require.Equal(t, 2, lost(), "stale completions refused")
		require.Len(t, d.shop.Of(slow.UUID), 2, "a parked key does not run")

		m := d.requireParked(t, slow, "lease expired during attempt 2")
		require.Equal(t, 2, m.Attempts, "attempts when parked")
		rec := inboxRecord(t, d.DB, d.consumer, slow.UUID)
		require.Equal(t, 2, rec.Interruptions, "interrupted attempts")
		require.True(t, rec.Interrupted)

		d.shop.FixAll()
		info := d.replayOnce(t, slow)
		require.Equal(t, 3, info.Attempt, "the replay runs attempt 3")
		require.True(t, info.Interrupted, "the replayed attempt is told that earlier ones were interrupted")
		require.Equal(t, runs[0].IdempotencyKey, info.IdempotencyKey, "the same idempotency key")
		d.finish(t, dlOutputs(healthy, slow)...)
	})
}

// ---------------------------------------------------------------------------
// 3. Lease mode (PostgreSQL store): a deterministic completion failure

// TestDeadLetterLeaseCompletionFailure: lease mode; the handler's
// completion transaction can never commit (a deferred unique constraint
// fails at COMMIT, after the effect row and the output were written in it).
// The key is parked at once (interrupted: the external effect probably
// happened), with the message, and nothing of the completion is kept. After
// the fix, the replay runs attempt 2, interrupted, once.
func TestDeadLetterLeaseCompletionFailure(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		d := dlSetup(t, e, "dl-lease-complete")
		d.startRouter(t, exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Duration: dlLease}, NackDelay: dlNackDelay}, 1)
		broken, healthy := dlNewOrder("cust-3"), dlNewOrder("cust-3")
		d.shop.Break(dlCompletion, broken)

		d.publish(t, broken, healthy)
		parked := dlAwait(t, d.Log, broken.UUID, exactlyonce.Parked, 1)
		require.ErrorContains(t, parked[0].Err, "23505", "the parked event names the unique violation")
		dlAwait(t, d.Log, healthy.UUID, exactlyonce.Processed, 1)
		d.awaitOutput(t, healthy)

		m := d.requireParked(t, broken, "completion failed after the handler ran")
		require.Contains(t, m.Reason, "23505")
		require.Equal(t, 1, m.Attempts)
		require.True(t, inboxRecord(t, d.DB, d.consumer, broken.UUID).Interrupted, "the effect probably happened")
		require.Len(t, d.shop.Of(broken.UUID), 1, "runs before the fix: parked at once, never retried blindly")

		d.shop.FixAll()
		info := d.replayOnce(t, broken)
		require.Equal(t, 2, info.Attempt, "the replay runs attempt 2")
		require.True(t, info.Interrupted, "the replayed attempt is told the parked one was interrupted")
		d.finish(t, dlOutputs(healthy, broken)...)
	})
}

// ---------------------------------------------------------------------------
// 4. Group commit

// TestDeadLetterGroupCommit: group commit (Config.Batch, four deliveries in
// flight); the handler refuses one order of four published together with
// Permanent. The others commit once each (a batch reruns without the
// refused one); the refused key is parked with the message. After the fix,
// its replay is processed once.
func TestDeadLetterGroupCommit(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		d := dlSetup(t, e, "dl-batch-orders")
		d.startRouter(t, exactlyonce.Config{
			Batch: &exactlyonce.BatchConfig{MaxSize: 8, MaxWait: 50 * time.Millisecond}, NackDelay: dlNackDelay,
		}, 4)
		poison := dlNewOrder("cust-4")
		healthy := []dlOrder{dlNewOrder("cust-4"), dlNewOrder("cust-4"), dlNewOrder("cust-4")}
		d.shop.Break(dlPermanent, poison)

		d.publish(t, healthy[0], poison, healthy[1], healthy[2])
		dlAwait(t, d.Log, poison.UUID, exactlyonce.Parked, 1)
		reruns := 0
		for _, h := range healthy {
			dlAwait(t, d.Log, h.UUID, exactlyonce.Processed, 1)
			d.awaitOutput(t, h)
			require.Equal(t, int64(1), d.Effects.Count(t, h.UUID), "one effect of a healthy order")
			reruns += len(d.shop.Of(h.UUID)) - 1
		}
		t.Logf("healthy handler runs rolled back with the refused one's batch: %d", reruns)

		d.requireParked(t, poison, "permanent: order "+poison.ID+": unknown sku")
		require.Len(t, d.shop.Of(poison.UUID), 1, "runs before the fix")

		d.shop.FixAll()
		d.replayOnce(t, poison)
		d.finish(t, dlOutputs(append(healthy, poison)...)...)
	})
}

// ---------------------------------------------------------------------------
// 5. The Redis lease store

// TestDeadLetterRedis: lease mode with the Redis store; the handler (an SMS
// sender whose only effect is the provider call) refuses two orders with
// Permanent before calling the provider. The operator finds the first by
// its order id (FindParked, the consumer required), the handler is fixed,
// and the message is replayed through a publisher to the queue it came
// from: the provider is called once with the lease's idempotency key; a
// second replay is refused (ErrNotParked) and a late redelivery is a
// duplicate (no call). The second is replayed by two operators at once:
// exactly one replay succeeds, the other is refused (ErrNotParked, or
// ErrReplayInProgress while the first is publishing), and the provider is
// called once.
func TestDeadLetterRedis(t *testing.T) {
	t.Parallel()
	const consumer = "dl-redis-sms"
	ctx := testCtx(t)
	store := redisStoreFor(t, testenv.RedisPrefix(t, testenv.Redis(t)))
	in := testenv.Queue(t, "in_")
	pub := testenv.AMQPPublisher(t)
	provider := testenv.NewProvider(t)
	client := leaseCrashHTTPClient()
	log := &eventLog{}
	var faults dlFaults
	var runs dlRuns

	eo := newMiddleware(t, exactlyonce.Config{
		Lease:    &exactlyonce.LeaseConfig{Duration: 5 * time.Second, Store: store},
		Consumer: consumer, NackDelay: dlNackDelay, OnEvent: log.Observe,
	})
	r := newRouter(t)
	h := r.AddConsumerHandler(consumer, in, testenv.AMQPSubscriber(t, 0), func(msg *message.Message) error {
		ctx := msg.Context()
		info, err := exactlyonce.InfoFromContext(ctx)
		if err != nil {
			return err
		}
		id := msg.Metadata.Get(dlOrderIDKey)
		runs.add(msg.UUID, info)
		if faults.Fault(id) == dlPermanent {
			return exactlyonce.Permanent(fmt.Errorf("order %s: phone number refused", id))
		}
		return testenv.SendSMS(ctx, client, provider.URL(), info.IdempotencyKey, "+15550100", "order "+id+" confirmed")
	})
	h.AddMiddleware(eo.Middleware)
	testenv.StartRouter(t, r)

	poison, racing, healthy := dlNewOrder("cust-5"), dlNewOrder("cust-5"), dlNewOrder("cust-5")
	kept, forgotten := dlNewOrder("cust-5b"), dlNewOrder("cust-5b")
	bulk := []dlOrder{dlNewOrder("cust-5c"), dlNewOrder("cust-5c")}
	idem := func(o dlOrder) string { return consumer + ":" + o.UUID }
	faults.Break(dlPermanent, poison, racing, kept, forgotten, bulk[0], bulk[1])
	publish := func(orders ...dlOrder) {
		for _, o := range orders {
			require.NoError(t, pub.Publish(in, o.Message()))
		}
	}
	publish(poison, healthy, racing, kept, forgotten, bulk[0], bulk[1])
	for _, o := range []dlOrder{poison, racing, kept, forgotten, bulk[0], bulk[1]} {
		dlAwait(t, log, o.UUID, exactlyonce.Parked, 1)
	}
	dlAwait(t, log, healthy.UUID, exactlyonce.Processed, 1)
	require.Equal(t, 1, provider.Successes(idem(healthy)))

	// Find by business id.
	page, err := store.FindParked(ctx, inbox.ParkedFilter{Consumer: consumer, Metadata: map[string]string{dlOrderIDKey: poison.ID}}, inbox.Page{Payloads: true})
	require.NoError(t, err)
	require.Len(t, page.Messages, 1, "parked messages of order %s", poison.ID)
	dlRequireKept(t, page.Messages[0], consumer, poison, in, "permanent: order "+poison.ID+": phone number refused")
	require.Equal(t, 1, page.Messages[0].Attempts)
	n, err := store.CountParked(ctx, inbox.ParkedFilter{Consumer: consumer, Metadata: map[string]string{dlCustomerIDKey: "cust-5"}})
	require.NoError(t, err)
	require.Equal(t, int64(2), n, "parked messages of the customer")
	require.Zero(t, provider.Calls(idem(poison)), "no provider call for a refused order")

	// Fix, replay through the publisher: processed once.
	faults.FixAll()
	m, err := store.ReplayParked(ctx, consumer, poison.UUID, pub, inbox.ReplayOptions{})
	require.NoError(t, err, "replay")
	require.Equal(t, poison.UUID, m.UUID)
	require.Equal(t, in, m.Topic)
	require.Equal(t, string(poison.Payload()), string(m.Payload))
	dlAwait(t, log, poison.UUID, exactlyonce.Processed, 1)
	require.Equal(t, 1, provider.Calls(idem(poison)), "provider calls after the replay")
	require.Equal(t, 1, provider.Successes(idem(poison)))
	pr := runs.Of(poison.UUID)
	require.Len(t, pr, 2, "handler runs: the refused one and the replay")
	require.Equal(t, 2, pr[1].Attempt, "the replay runs attempt 2")
	require.Equal(t, pr[0].IdempotencyKey, pr[1].IdempotencyKey)
	rec, err := store.Get(ctx, consumer, poison.UUID)
	require.NoError(t, err)
	require.Equal(t, inboxdb.StatusDone, rec.Status)
	_, err = store.GetParked(ctx, consumer, poison.UUID)
	require.ErrorIs(t, err, inbox.ErrNotParked, "the replayed message is no longer parked")

	_, err = store.ReplayParked(ctx, consumer, poison.UUID, pub, inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrNotParked, "a second replay")
	publish(poison)
	dlAwait(t, log, poison.UUID, exactlyonce.Duplicate, 1)
	require.Len(t, runs.Of(poison.UUID), 2, "a late redelivery does not run the handler")
	require.Equal(t, 1, provider.Calls(idem(poison)), "provider calls after a late redelivery")

	// Two operators replay the same message at once.
	errs := dlRace(2, func() error {
		_, err := store.ReplayParked(ctx, consumer, racing.UUID, pub, inbox.ReplayOptions{})
		return err
	})
	won := 0
	for _, err := range errs {
		if err == nil {
			won++
			continue
		}
		if !errorIs(err, inbox.ErrNotParked) && !errorIs(err, inbox.ErrReplayInProgress) {
			t.Fatalf("the losing replay: want ErrNotParked or ErrReplayInProgress, got %v", err)
		}
	}
	require.Equal(t, 1, won, "exactly one replay succeeds: %v", errs)
	dlAwait(t, log, racing.UUID, exactlyonce.Processed, 1)
	_, err = store.ReplayParked(ctx, consumer, racing.UUID, pub, inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrNotParked, "a replay after both ended")

	dlRedisDiscard(t, store, consumer, log, &runs, publish, kept, forgotten)

	// Bulk replay by filter: count first.
	byCustomer := inbox.ParkedFilter{Consumer: consumer, Metadata: map[string]string{dlCustomerIDKey: "cust-5c"}}
	n, err = store.CountParked(ctx, byCustomer)
	require.NoError(t, err)
	require.Equal(t, int64(2), n, "count first")
	_, err = store.ReplayParkedMatching(ctx, inbox.ParkedFilter{Consumer: consumer}, pub, inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter, "a filter of the consumer only, without All")
	rep, err := store.ReplayParkedMatching(ctx, byCustomer, pub, inbox.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, inbox.ReplayReport{Replayed: 2}, rep)
	for _, o := range bulk {
		dlAwait(t, log, o.UUID, exactlyonce.Processed, 1)
		require.Equal(t, 1, provider.Calls(idem(o)), "provider calls of order %s", o.ID)
	}
	rep, err = store.ReplayParkedMatching(ctx, byCustomer, pub, inbox.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, inbox.ReplayReport{}, rep, "a second bulk replay")
	require.Zero(t, provider.Calls(idem(kept)), "provider calls of the discarded order")
	require.Equal(t, 1, provider.Successes(idem(forgotten)), "provider calls of the forgotten order")

	closeRouter(t, r)
	requireQueueDrained(t, in)
	require.Len(t, dlEventsOf(log, racing.UUID, exactlyonce.Processed), 1, "processed once")
	require.Zero(t, len(dlEventsOf(log, racing.UUID, exactlyonce.Duplicate)), "no second copy published")
	require.Equal(t, 1, provider.Calls(idem(racing)), "provider calls of the message replayed twice at once")
	require.Equal(t, 1, provider.Successes(idem(racing)))
	n, err = store.CountParked(ctx, inbox.ParkedFilter{Consumer: consumer})
	require.NoError(t, err)
	require.Zero(t, n, "parked messages left")
}

// dlRedisDiscard: with the Redis store, a discarded message is gone and its
// key discarded, no longer parked (a redelivery, even after the fix, is
// acked as a duplicate without running); with Forget the key is forgotten
// and the redelivery runs once.
func dlRedisDiscard(t *testing.T, store *redisstore.Store, consumer string, log *eventLog, runs *dlRuns,
	publish func(...dlOrder), kept, forgotten dlOrder) {
	t.Helper()
	ctx := testCtx(t)
	require.NoError(t, store.DiscardParked(ctx, consumer, kept.UUID, inbox.DiscardOptions{}))
	_, err := store.GetParked(ctx, consumer, kept.UUID)
	require.ErrorIs(t, err, inbox.ErrNotParked, "a discarded message is gone")
	require.ErrorIs(t, store.DiscardParked(ctx, consumer, kept.UUID, inbox.DiscardOptions{}), inbox.ErrNotParked, "a second discard")
	require.ErrorIs(t, store.DiscardParked(ctx, consumer, kept.UUID, inbox.DiscardOptions{Forget: true}), inbox.ErrNotParked,
		"a discard with Forget of a key whose message is gone")
	rec, err := store.Get(ctx, consumer, kept.UUID)
	require.NoError(t, err)
	require.Equal(t, inboxdb.StatusDiscarded, rec.Status, "the discarded message's key is discarded, no longer parked")

	require.NoError(t, store.DiscardParked(ctx, consumer, forgotten.UUID, inbox.DiscardOptions{Forget: true}))
	_, err = store.Get(ctx, consumer, forgotten.UUID)
	require.ErrorIs(t, err, inbox.ErrNotFound, "the forgotten key has no record")

	publish(kept, forgotten)
	dlAwait(t, log, kept.UUID, exactlyonce.Duplicate, 1)
	dlAwait(t, log, forgotten.UUID, exactlyonce.Processed, 1)
	require.Len(t, runs.Of(kept.UUID), 1, "a discarded key's redelivery does not run")
	require.Len(t, runs.Of(forgotten.UUID), 2, "the forgotten key's redelivery runs")
}

// ---------------------------------------------------------------------------
// 6. A quarantined outbox row

// TestDeadLetterQuarantinedOutboxRow: the handler processes two orders
// whose outputs carry an expiration the relay's (buggy) marshaler passes to
// RabbitMQ, which refuses it: rabbitmq.Publisher marks the failure
// permanent and the relay quarantines each row after two attempts, while a
// healthy order's output flows. The operator finds one row by the order id
// in its metadata (outbox.Store: Find, Count, Get), fixes the marshaler and
// requeues it: delivered once, with its UUID; a second requeue finds no
// row. The other row is found the same way and discarded: never delivered.
// A late redelivery of the input does not run the handler again.
func TestDeadLetterQuarantinedOutboxRow(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		ctx := testCtx(t)
		d := dlSetup(t, e, "dl-outbox-orders")
		rows := testenv.OutboxStore(t, d.DB)
		d.startRouter(t, exactlyonce.Config{NackDelay: dlNackDelay}, 1)
		healthy, refused, dropped := dlNewOrder("cust-6"), dlNewOrder("cust-6"), dlNewOrder("cust-6")
		d.shop.Break(dlExpiration, refused, dropped)

		// The healthy output first, alone: a batch with a refused message
		// in it may publish the others twice (rabbitmq.Publisher's doc).
		d.publish(t, healthy)
		d.awaitOutput(t, healthy)
		d.publish(t, refused, dropped)
		dlAwait(t, d.Log, refused.UUID, exactlyonce.Processed, 1)
		dlAwait(t, d.Log, dropped.UUID, exactlyonce.Processed, 1)
		testenv.Eventually(t, waitTimeout, func() bool {
			p, err := rows.Pending(ctx)
			require.NoError(t, err)
			return p.Quarantined == 2
		}, "expected both refused rows quarantined")

		byOrder := func(o dlOrder) outbox.RowFilter {
			return outbox.RowFilter{Metadata: map[string]string{dlOrderIDKey: o.ID}}
		}
		page, err := rows.Find(ctx, byOrder(refused), outbox.Page{})
		require.NoError(t, err)
		require.Len(t, page.Rows, 1, "quarantined rows of order %s", refused.ID)
		row := page.Rows[0]
		require.Equal(t, dlOutputUUID(refused.UUID), row.UUID)
		require.Equal(t, d.Out, row.Topic)
		require.Equal(t, len(`{"order_id":"`+refused.ID+`","status":"confirmed"}`), row.PayloadSize)
		require.Equal(t, refused.ID, row.Metadata[dlOrderIDKey])
		require.True(t, row.Quarantined())
		require.NotNil(t, row.QuarantinedAt)
		require.Equal(t, 2, row.PermanentFailures, "quarantined after MaxAttempts permanent failures")
		require.Contains(t, row.LastError, "PRECONDITION_FAILED")
		n, err := rows.Count(ctx, byOrder(refused))
		require.NoError(t, err)
		require.Equal(t, int64(1), n)
		got, err := rows.Get(ctx, row.ID)
		require.NoError(t, err)
		require.Equal(t, row.UUID, got.UUID)
		require.Equal(t, `{"order_id":"`+refused.ID+`","status":"confirmed"}`, string(got.Payload))
		require.True(t, got.Quarantined())
		require.Empty(t, d.outputs.Get(row.UUID), "a quarantined row was not delivered")

		// Fix the marshaler, requeue the one row: delivered once.
		d.relayBug.Store(false)
		require.NoError(t, rows.Requeue(ctx, row.ID, outbox.Expect{}))
		d.awaitOutput(t, refused)
		testenv.Eventually(t, waitTimeout, func() bool {
			_, err := rows.Get(ctx, row.ID)
			return errorIs(err, outbox.ErrRowNotFound)
		}, "expected the requeued row relayed and deleted")
		require.ErrorIs(t, rows.Requeue(ctx, row.ID, outbox.Expect{}), outbox.ErrRowNotFound, "a second requeue")

		// The other one: found by its order id, discarded, never delivered.
		page, err = rows.Find(ctx, byOrder(dropped), outbox.Page{})
		require.NoError(t, err)
		require.Len(t, page.Rows, 1, "quarantined rows of order %s", dropped.ID)
		require.Equal(t, dlOutputUUID(dropped.UUID), page.Rows[0].UUID)
		require.NoError(t, rows.Discard(ctx, page.Rows[0].ID, outbox.Expect{}))
		require.ErrorIs(t, rows.Discard(ctx, page.Rows[0].ID, outbox.Expect{}), outbox.ErrRowNotFound, "a second discard")
		n, err = rows.Count(ctx, outbox.RowFilter{State: outbox.StateAll})
		require.NoError(t, err)
		require.Zero(t, n, "rows with a failure record left")

		// A late redelivery of the input does not run the handler again.
		d.publish(t, refused)
		dlAwait(t, d.Log, refused.UUID, exactlyonce.Duplicate, 1)
		require.Len(t, d.shop.Of(refused.UUID), 1, "handler runs")
		for _, o := range []dlOrder{healthy, refused, dropped} {
			require.Equal(t, int64(1), d.Effects.Count(t, o.UUID), "effects of order %s", o.ID)
		}
		require.Equal(t, int64(2), d.relay.Stats().Quarantined, "rows the relay quarantined")
		d.finish(t, dlOutputs(healthy, refused)...)
	})
}

// ---------------------------------------------------------------------------
// Discard, bulk replay, concurrent replays (transactional mode)

// TestDeadLetterDiscard: three parked orders. One discarded (DiscardParked):
// its message is gone (GetParked, a replay and a second discard say
// ErrNotParked) but the key stays parked, so that a redelivery, even after
// the fix, is acked as parked without running. One discarded with Forget:
// the key is forgotten, and its redelivery runs once. Two of another
// customer discarded by filter (count first). Nothing else is touched.
func TestDeadLetterDiscard(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		ctx := testCtx(t)
		d := dlSetup(t, e, "dl-discard-orders")
		d.startRouter(t, exactlyonce.Config{NackDelay: dlNackDelay}, 1)
		kept, forgotten, other := dlNewOrder("cust-7"), dlNewOrder("cust-7"), dlNewOrder("cust-7")
		bulk := []dlOrder{dlNewOrder("cust-8"), dlNewOrder("cust-8")}
		all := append([]dlOrder{kept, forgotten, other}, bulk...)
		d.shop.Break(dlPermanent, all...)
		d.publish(t, all...)
		for _, o := range all {
			dlAwait(t, d.Log, o.UUID, exactlyonce.Parked, 1)
		}

		// Discard, the key kept.
		d.requireParked(t, kept, "unknown sku")
		require.NoError(t, d.store.DiscardParked(ctx, d.consumer, kept.UUID, inbox.DiscardOptions{}))
		require.Empty(t, d.findParked(t, kept), "a discarded message is not listed")
		_, err := d.store.GetParked(ctx, d.consumer, kept.UUID)
		require.ErrorIs(t, err, inbox.ErrNotParked)
		_, err = d.store.ReplayParked(ctx, d.consumer, kept.UUID, inbox.ReplayOptions{})
		require.ErrorIs(t, err, inbox.ErrNotParked, "a discarded message cannot be replayed")
		require.ErrorIs(t, d.store.DiscardParked(ctx, d.consumer, kept.UUID, inbox.DiscardOptions{}), inbox.ErrNotParked, "a second discard")
		require.Equal(t, inboxdb.StatusDiscarded, inboxRecord(t, d.DB, d.consumer, kept.UUID).Status, "the key is no longer parked: discarded")
		parkedKeys, err := d.store.Parked(ctx, d.consumer, 100)
		require.NoError(t, err)
		for _, r := range parkedKeys {
			require.NotEqual(t, kept.UUID, r.Key, "a discarded key is not listed as parked")
		}
		require.ErrorIs(t, d.store.DiscardParked(ctx, d.consumer, kept.UUID, inbox.DiscardOptions{Forget: true}), inbox.ErrNotParked,
			"a discard with Forget of a key whose message is gone")
		require.Equal(t, inboxdb.StatusDiscarded, inboxRecord(t, d.DB, d.consumer, kept.UUID).Status, "nothing changed: the key stays discarded")

		// Discard with Forget: the record is gone too.
		require.NoError(t, d.store.DiscardParked(ctx, d.consumer, forgotten.UUID, inbox.DiscardOptions{Forget: true}))
		_, err = d.store.Get(ctx, d.consumer, forgotten.UUID)
		require.ErrorIs(t, err, inbox.ErrNotFound, "the forgotten key has no record")
		require.Empty(t, d.findParked(t, forgotten))

		// Bulk discard of one customer's parked messages.
		byCustomer := inbox.ParkedFilter{Metadata: map[string]string{dlCustomerIDKey: "cust-8"}}
		n, err := d.store.CountParked(ctx, byCustomer)
		require.NoError(t, err)
		require.Equal(t, int64(2), n, "count before the bulk discard")
		_, err = d.store.DiscardParkedMatching(ctx, inbox.ParkedFilter{}, inbox.DiscardOptions{})
		require.ErrorIs(t, err, inbox.ErrInvalidFilter, "an empty filter without All")
		n, err = d.store.DiscardParkedMatching(ctx, byCustomer, inbox.DiscardOptions{})
		require.NoError(t, err)
		require.Equal(t, int64(2), n, "discarded by filter")
		n, err = d.store.CountParked(ctx, byCustomer)
		require.NoError(t, err)
		require.Zero(t, n)
		for _, o := range bulk {
			require.Equal(t, inboxdb.StatusDiscarded, inboxRecord(t, d.DB, d.consumer, o.UUID).Status, "the keys are discarded, no longer parked")
		}

		// The fix, then redeliveries: a discarded key's late copy is
		// dropped as a duplicate, the forgotten one runs once.
		d.shop.FixAll()
		d.publish(t, kept, forgotten)
		dlAwait(t, d.Log, kept.UUID, exactlyonce.Duplicate, 1)
		dlAwait(t, d.Log, forgotten.UUID, exactlyonce.Processed, 1)
		require.Len(t, d.shop.Of(kept.UUID), 1, "a discarded key's redelivery does not run")
		require.Zero(t, d.Effects.Count(t, kept.UUID))
		require.Len(t, d.shop.Of(forgotten.UUID), 2, "the forgotten key's redelivery runs")
		require.Equal(t, int64(1), d.Effects.Count(t, forgotten.UUID))

		// The untouched one is still there, and replays.
		d.requireParked(t, other, "unknown sku")
		d.replayOnce(t, other)
		d.finish(t, dlOutputs(forgotten, other)...)
	})
}

// TestDeadLetterBulkReplay: five parked orders, four of one customer, one
// of which was released and processed since (its message still listed,
// status done). The operator counts that customer's parked messages (4),
// pages through them, and replays them by filter (ReplayParkedMatching, two
// per transaction): three replayed, the processed one skipped; each
// replayed one is processed once (one effect, one output), the other
// customer's stays parked, a second bulk replay replays nothing, and late
// redeliveries are duplicates.
func TestDeadLetterBulkReplay(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		ctx := testCtx(t)
		d := dlSetup(t, e, "dl-bulk-orders")
		d.startRouter(t, exactlyonce.Config{NackDelay: dlNackDelay}, 1)
		mine := []dlOrder{dlNewOrder("cust-9"), dlNewOrder("cust-9"), dlNewOrder("cust-9")}
		done, theirs := dlNewOrder("cust-9"), dlNewOrder("cust-10")
		d.shop.Break(dlPermanent, append(mine, done, theirs)...)
		d.publish(t, mine[0], theirs, done, mine[1], mine[2])
		for _, o := range append(mine, done, theirs) {
			dlAwait(t, d.Log, o.UUID, exactlyonce.Parked, 1)
		}
		d.shop.FixAll()
		// One of them was released and re-sent by its producer meanwhile.
		ok, err := d.store.Release(ctx, d.consumer, done.UUID, inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		d.publish(t, done)
		dlAwait(t, d.Log, done.UUID, exactlyonce.Processed, 1)

		byCustomer := inbox.ParkedFilter{Metadata: map[string]string{dlCustomerIDKey: "cust-9"}}
		n, err := d.store.CountParked(ctx, byCustomer)
		require.NoError(t, err)
		require.Equal(t, int64(4), n, "count first")
		first, err := d.store.FindParked(ctx, byCustomer, inbox.Page{Limit: 2})
		require.NoError(t, err)
		require.Len(t, first.Messages, 2)
		require.NotEmpty(t, first.Next)
		second, err := d.store.FindParked(ctx, byCustomer, inbox.Page{Limit: 2, After: first.Next})
		require.NoError(t, err)
		require.Len(t, second.Messages, 2)
		require.Empty(t, second.Next, "the last page (exactly full) has no next page")
		var paged []string
		status := map[string]string{}
		for _, m := range append(first.Messages, second.Messages...) {
			require.Nil(t, m.Payload, "pages without Payloads carry no payload")
			paged = append(paged, m.UUID)
			status[m.UUID] = m.Status
		}
		require.ElementsMatch(t, []string{mine[0].UUID, mine[1].UUID, mine[2].UUID, done.UUID}, paged, "the customer's parked messages")
		require.Equal(t, inboxdb.StatusDone, status[done.UUID], "the processed key's message is listed as done")

		_, err = d.store.ReplayParkedMatching(ctx, inbox.ParkedFilter{}, inbox.ReplayOptions{})
		require.ErrorIs(t, err, inbox.ErrInvalidFilter, "an empty filter without All")
		rep, err := d.store.ReplayParkedMatching(ctx, byCustomer, inbox.ReplayOptions{BatchSize: 2})
		require.NoError(t, err)
		require.Equal(t, inbox.ReplayReport{Replayed: 3, Skipped: 1}, rep, "the processed one is skipped")
		for _, o := range mine {
			dlAwait(t, d.Log, o.UUID, exactlyonce.Processed, 1)
			d.awaitOutput(t, o)
		}
		rep, err = d.store.ReplayParkedMatching(ctx, byCustomer, inbox.ReplayOptions{})
		require.NoError(t, err)
		require.Equal(t, inbox.ReplayReport{Skipped: 1}, rep, "a second bulk replay")
		require.Len(t, d.shop.Of(done.UUID), 2, "runs of the processed one")
		require.Equal(t, int64(1), d.Effects.Count(t, done.UUID), "effects of the processed one")

		d.publish(t, mine...)
		for _, o := range mine {
			dlAwait(t, d.Log, o.UUID, exactlyonce.Duplicate, 1)
			require.Len(t, d.shop.Of(o.UUID), 2, "runs of order %s: the refused one and the replay", o.ID)
			require.Equal(t, int64(1), d.Effects.Count(t, o.UUID), "effects of order %s", o.ID)
			require.Len(t, dlEventsOf(d.Log, o.UUID, exactlyonce.Processed), 1, "processed events of order %s", o.ID)
			require.Len(t, dlEventsOf(d.Log, o.UUID, exactlyonce.Duplicate), 1, "duplicate events of order %s: the late redelivery only", o.ID)
		}
		n, err = d.store.CountParked(ctx, inbox.ParkedFilter{Metadata: map[string]string{dlCustomerIDKey: "cust-10"}})
		require.NoError(t, err)
		require.Equal(t, int64(1), n, "the other customer's message stays parked")
		d.requireParked(t, theirs, "unknown sku")
		d.finish(t, dlOutputs(append(mine, done)...)...)
	})
}

// TestDeadLetterConcurrentReplay: two operators replay one parked message
// at once (two goroutines released together): exactly one replay succeeds,
// the other gets ErrNotParked, and the message is processed once. Then the
// same with a fixed interleaving: one replay inside a transaction not yet
// committed (ReplayParkedTx) while the other runs; the other must not
// succeed, before or after the first commits.
func TestDeadLetterConcurrentReplay(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		ctx := testCtx(t)
		d := dlSetup(t, e, "dl-race-orders")
		d.startRouter(t, exactlyonce.Config{NackDelay: dlNackDelay}, 1)
		raced, held := dlNewOrder("cust-11"), dlNewOrder("cust-11")
		d.shop.Break(dlPermanent, raced, held)
		d.publish(t, raced, held)
		dlAwait(t, d.Log, raced.UUID, exactlyonce.Parked, 1)
		dlAwait(t, d.Log, held.UUID, exactlyonce.Parked, 1)
		d.shop.FixAll()

		// Released together.
		errs := dlRace(2, func() error {
			_, err := d.store.ReplayParked(ctx, d.consumer, raced.UUID, inbox.ReplayOptions{})
			return err
		})
		won := 0
		for _, err := range errs {
			if err == nil {
				won++
			} else {
				require.ErrorIs(t, err, inbox.ErrNotParked, "the losing replay")
			}
		}
		require.Equal(t, 1, won, "exactly one replay succeeds: %v", errs)
		dlAwait(t, d.Log, raced.UUID, exactlyonce.Processed, 1)
		d.awaitOutput(t, raced)

		// One replay holds its transaction open while the other runs.
		tx := d.Begin(t)
		m, err := d.store.ReplayParkedTx(ctx, tx, d.consumer, held.UUID, inbox.ReplayOptions{})
		require.NoError(t, err)
		require.Equal(t, held.UUID, m.UUID)
		other := make(chan error, 1)
		go func() {
			_, err := d.store.ReplayParked(ctx, d.consumer, held.UUID, inbox.ReplayOptions{})
			other <- err
		}()
		var early error
		returned := false
		testenv.Eventually(t, waitTimeout, func() bool {
			select {
			case early = <-other:
				returned = true
				return true
			default:
			}
			return dlLockWaiters(t, d.e2e) > 0
		}, "the second replay neither returned nor waits for the first's locks")
		if returned {
			t.Logf("the second replay returned while the first was uncommitted: %v", early)
			require.Error(t, early, "a replay while another holds the message must not succeed")
		}
		if !returned {
			t.Logf("the second replay waits for the first's locks")
		}
		require.NoError(t, tx.Commit())
		if !returned {
			select {
			case early = <-other:
			case <-time.After(waitTimeout):
				t.Fatal("the second replay did not return after the first committed")
			}
		}
		require.ErrorIs(t, early, inbox.ErrNotParked, "the second replay")
		dlAwait(t, d.Log, held.UUID, exactlyonce.Processed, 1)
		d.awaitOutput(t, held)

		for _, o := range []dlOrder{raced, held} {
			d.publish(t, o)
			dlAwait(t, d.Log, o.UUID, exactlyonce.Duplicate, 1)
			require.Len(t, dlEventsOf(d.Log, o.UUID, exactlyonce.Processed), 1, "processed events of order %s", o.ID)
			require.Len(t, dlEventsOf(d.Log, o.UUID, exactlyonce.Duplicate), 1, "duplicate events of order %s: the late redelivery only", o.ID)
			require.Len(t, d.shop.Of(o.UUID), 2, "runs of order %s: the refused one and the replay", o.ID)
			require.Equal(t, int64(1), d.Effects.Count(t, o.UUID), "effects of order %s", o.ID)
		}
		d.finish(t, dlOutputs(raced, held)...)
	})
}

// TestDeadLetterReleasedKeys: the parked message outlives a Release of its
// key (the earlier way to retry). Released and then replayed: the replay
// writes the message (the key's status before it: failed) and it is
// processed once. Released and then redelivered by its producer (processed
// once): the parked message is listed with status done, and a replay is
// refused (ErrNotReplayable: it would be a duplicate); it can be discarded.
func TestDeadLetterReleasedKeys(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		ctx := testCtx(t)
		d := dlSetup(t, e, "dl-release-orders")
		d.startRouter(t, exactlyonce.Config{NackDelay: dlNackDelay}, 1)
		replayed, redelivered := dlNewOrder("cust-12"), dlNewOrder("cust-12")
		d.shop.Break(dlPermanent, replayed, redelivered)
		d.publish(t, replayed, redelivered)
		dlAwait(t, d.Log, replayed.UUID, exactlyonce.Parked, 1)
		dlAwait(t, d.Log, redelivered.UUID, exactlyonce.Parked, 1)
		d.shop.FixAll()

		for _, o := range []dlOrder{replayed, redelivered} {
			ok, err := d.store.Release(ctx, d.consumer, o.UUID, inbox.Expect{})
			require.NoError(t, err)
			require.True(t, ok, "released")
			found := d.findParked(t, o)
			require.Len(t, found, 1, "a released key's message stays listed")
			require.Equal(t, inboxdb.StatusFailed, found[0].Status)
		}

		m, err := d.store.ReplayParked(ctx, d.consumer, replayed.UUID, inbox.ReplayOptions{})
		require.NoError(t, err, "replay of a released key")
		require.Equal(t, inboxdb.StatusFailed, m.Status, "the key's status before the replay")
		dlAwait(t, d.Log, replayed.UUID, exactlyonce.Processed, 1)
		d.awaitOutput(t, replayed)
		require.Empty(t, d.findParked(t, replayed))
		_, err = d.store.ReplayParked(ctx, d.consumer, replayed.UUID, inbox.ReplayOptions{})
		require.ErrorIs(t, err, inbox.ErrNotParked, "a second replay")

		d.publish(t, redelivered)
		dlAwait(t, d.Log, redelivered.UUID, exactlyonce.Processed, 1)
		d.awaitOutput(t, redelivered)
		found := d.findParked(t, redelivered)
		require.Len(t, found, 1, "the message stays listed after its key was processed")
		require.Equal(t, inboxdb.StatusDone, found[0].Status)
		_, err = d.store.ReplayParked(ctx, d.consumer, redelivered.UUID, inbox.ReplayOptions{})
		require.ErrorIs(t, err, inbox.ErrNotReplayable, "a replay of a key processed since would be a duplicate")
		require.NoError(t, d.store.DiscardParked(ctx, d.consumer, redelivered.UUID, inbox.DiscardOptions{}))
		require.Empty(t, d.findParked(t, redelivered))
		require.Equal(t, inboxdb.StatusDone, inboxRecord(t, d.DB, d.consumer, redelivered.UUID).Status, "the discard keeps the done record")

		for _, o := range []dlOrder{replayed, redelivered} {
			require.Len(t, d.shop.Of(o.UUID), 2, "runs of order %s", o.ID)
			require.Equal(t, int64(1), d.Effects.Count(t, o.UUID), "effects of order %s", o.ID)
		}
		d.finish(t, dlOutputs(replayed, redelivered)...)
	})
}

// ---------------------------------------------------------------------------
// Small helpers

// dlRace runs f in n goroutines released at the same moment and returns
// their errors.
func dlRace(n int, f func() error) []error {
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			errs[i] = f()
		})
	}
	close(start)
	wg.Wait()
	return errs
}

// dlLockWaiters counts the backends waiting for a lock in a statement that
// names the bundle's schema (another test's statements name their own).
func dlLockWaiters(t testing.TB, e *e2e) int64 {
	t.Helper()
	return testenv.Count(t, e.Driver.DB, `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND strpos(query, $1) > 0`, e.DB.Schema)
}

// errorIs is errors.Is for a non-nil err.
func errorIs(err, target error) bool { return err != nil && errors.Is(err, target) }
