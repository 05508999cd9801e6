package main

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

type parkedListJSON struct {
	Messages []parkedJSON `json:"messages"`
	Next     string       `json:"next_after,omitempty"`
}

// poisonHandler fails an order with a Permanent error until fixed, and
// counts each order it processed.
type poisonHandler struct {
	mu     sync.Mutex
	fixed  bool
	effect map[string]int // order_id -> runs that succeeded
	runs   atomic.Int64
}

func (h *poisonHandler) handle(msg *message.Message) error {
	h.runs.Add(1)
	h.mu.Lock()
	defer h.mu.Unlock()
	order := msg.Metadata.Get("order_id")
	if !h.fixed && msg.Metadata.Get("bad") != "" {
		return exactlyonce.Permanent(errors.New("invalid shipping address for order " + order))
	}
	h.effect[order]++
	return nil
}

func (h *poisonHandler) fix() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.fixed = true
}

func (h *poisonHandler) effects(order string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.effect[order]
}

// runRouter consumes queue with the middleware in front of h until the test
// ends, and returns its event log.
func runRouter(t *testing.T, queue string, cfg exactlyonce.Config, h *poisonHandler) *events {
	t.Helper()
	ev := &events{}
	cfg.OnEvent = ev.observe
	cfg.Logger = watermill.NopLogger{}
	eo, err := exactlyonce.New(cfg)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(eo.Middleware)
	r.AddConsumerHandler("ship-order", queue, testenv.AMQPSubscriber(t, 0), h.handle)
	testenv.StartRouter(t, r)
	return ev
}

type events struct {
	mu  sync.Mutex
	log []exactlyonce.Event
}

func (e *events) observe(ev exactlyonce.Event) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.log = append(e.log, ev)
}

func (e *events) count(o exactlyonce.Outcome) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, ev := range e.log {
		if ev.Outcome == o {
			n++
		}
	}
	return n
}

func publishOrder(t *testing.T, queue, uuid, order string, bad bool) {
	t.Helper()
	m := message.NewMessage(uuid, []byte(`{"order":"`+order+`","to":"Main St"}`))
	m.Metadata.Set("order_id", order)
	if bad {
		m.Metadata.Set("bad", "1")
	}
	require.NoError(t, testenv.AMQPPublisher(t).Publish(queue, m))
}

// An operator's loop with the built command: a message the handler refused
// for good is parked with its content, found by its business id, shown,
// and replayed through the outbox and the relay (outbox relay --once) to
// RabbitMQ; the fixed handler runs it once, and a second replay is refused.
func TestParkedReplayThroughRabbitMQ(t *testing.T) {
	t.Parallel()
	requireRabbitMQ(t)
	testenv.EachEngine(t, testParkedReplayThroughRabbitMQ)
}

func testParkedReplayThroughRabbitMQ(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := append(engineEnv(b), envAMQPURL+"="+testenv.AMQPURL())
	queue := testenv.Queue(t, "cli_parked_")
	h := &poisonHandler{effect: map[string]int{}}
	ev := runRouter(t, queue, exactlyonce.Config{DB: db}, h)

	uuid := watermill.NewUUID()
	publishOrder(t, queue, uuid, "A-1042", true)
	publishOrder(t, queue, watermill.NewUUID(), "A-1043", false)
	testenv.Eventually(t, 20*time.Second, func() bool { return ev.count(exactlyonce.Parked) == 1 && h.effects("A-1043") == 1 },
		"the bad order parked, the good one processed")

	var list parkedListJSON
	decode(t, cli(t, env, "parked", "list", "--json", "--meta", "order_id=A-1042"), &list)
	require.Len(t, list.Messages, 1)
	m := list.Messages[0]
	require.Equal(t, parkedJSON{Consumer: "ship-order", Key: uuid, UUID: uuid, Topic: queue, Status: "parked",
		Reason: m.Reason, Attempts: m.Attempts, FirstSeenAt: m.FirstSeenAt, ParkedAt: m.ParkedAt,
		Metadata: map[string]string{"order_id": "A-1042", "bad": "1"}, PayloadBytes: 33, PayloadKept: true, Version: m.Version}, m)
	require.NotEmpty(t, m.Version)
	require.Contains(t, m.Reason, "invalid shipping address for order A-1042")

	r := cli(t, env, "parked", "show", "ship-order", uuid)
	requireOK(t, r)
	require.Contains(t, r.stdout, "\"order\": \"A-1042\"", "the payload, pretty-printed JSON")
	require.Contains(t, r.stdout, "order_id: A-1042")

	h.fix()
	r = cli(t, env, "parked", "replay", "ship-order", uuid)
	requireOK(t, r)
	require.Equal(t, "Replayed 1 message.\n", r.stdout)
	requireExit(t, cli(t, env, "parked", "replay", "ship-order", uuid), exitNotFound, "parked replay")
	requireOK(t, cli(t, env, "outbox", "relay", "--once"))
	testenv.Eventually(t, 20*time.Second, func() bool { return h.effects("A-1042") == 1 }, "the replayed order is processed")

	// A late redelivery of the original is a duplicate.
	publishOrder(t, queue, uuid, "A-1042", true)
	testenv.Eventually(t, 20*time.Second, func() bool { return ev.count(exactlyonce.Duplicate) == 1 }, "the late copy is acked as a duplicate")
	require.Equal(t, 1, h.effects("A-1042"))
	decode(t, cli(t, env, "parked", "list", "--json"), &list)
	require.Empty(t, list.Messages)
}

// Bulk replay and discard by criteria: a count first, --yes acts.
func TestParkedBulkCommands(t *testing.T) {
	t.Parallel()
	requireRabbitMQ(t)
	testenv.EachEngine(t, testParkedBulkCommands)
}

func testParkedBulkCommands(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := append(engineEnv(b), envAMQPURL+"="+testenv.AMQPURL())
	queue := testenv.Queue(t, "cli_parked_bulk_")
	h := &poisonHandler{effect: map[string]int{}}
	ev := runRouter(t, queue, exactlyonce.Config{DB: db}, h)
	uuids := map[string]string{}
	for _, order := range []string{"B-1", "B-2", "B-3"} {
		uuids[order] = watermill.NewUUID()
		publishOrder(t, queue, uuids[order], order, true)
	}
	testenv.Eventually(t, 20*time.Second, func() bool { return ev.count(exactlyonce.Parked) == 3 }, "three parked")

	r := cli(t, env, "parked", "replay", "--reason", "B-1")
	requireOK(t, r)
	require.Regexp(t, `^1 message matches. Nothing done: the same command with --yes will replay them.\n`+
		`To replay exactly these \(refused, exit 4, if they changed\): --confirm 1@\S+Z\n$`, r.stdout)
	var count actionJSON
	decode(t, cli(t, env, "parked", "discard", "--json", "--reason", "order B-3"), &count)
	require.Equal(t, actionJSON{Matching: 1}, counted(t, count))
	requireExit(t, cli(t, env, "parked", "discard", "--reason", "order B-3", "--confirm", "0"+count.Confirm[1:]), exitChanged,
		"refused, nothing done: 1 message of those the count confirmed saw match, not the 0 confirmed (expect)")
	requireExit(t, cli(t, env, "parked", "discard", "--reason", "order B-3", "--confirm", count.Confirm+"/7"), exitUsage,
		"max_id is a bound of outbox rows")
	var act actionJSON
	decode(t, cli(t, env, "parked", "discard", "--json", "--reason", "order B-3", "--yes"), &act)
	require.Equal(t, actionJSON{Count: 1, Done: true}, act)
	// The discarded key is no longer called parked, and a late copy of its
	// message is still not run: a duplicate.
	r = cli(t, env, "inbox", "parked", "-c", "ship-order")
	requireOK(t, r)
	require.NotContains(t, r.stdout, uuids["B-3"], "inbox parked does not list a discarded key")
	require.Contains(t, r.stdout, uuids["B-1"])
	r = cli(t, env, "inbox", "show", "-c", "ship-order", uuids["B-3"])
	requireOK(t, r)
	require.Regexp(t, `status +discarded\n`, r.stdout)
	publishOrder(t, queue, uuids["B-3"], "B-3", true)
	testenv.Eventually(t, 20*time.Second, func() bool { return ev.count(exactlyonce.Duplicate) == 1 }, "the late copy is acked as a duplicate")
	require.Equal(t, 3, ev.count(exactlyonce.Parked), "not parked again")

	h.fix()
	// The count's confirmation acts on what it counted.
	decode(t, cli(t, env, "parked", "replay", "--json", "-c", "ship-order"), &count)
	require.Equal(t, actionJSON{Matching: 2}, counted(t, count))
	var done actionJSON
	decode(t, cli(t, env, "parked", "replay", "--json", "-c", "ship-order", "--confirm", count.Confirm), &done)
	require.Equal(t, actionJSON{Count: 2, Done: true}, done)
	requireOK(t, cli(t, env, "outbox", "relay", "--once"))
	testenv.Eventually(t, 20*time.Second, func() bool { return h.effects("B-1") == 1 && h.effects("B-2") == 1 }, "both replayed")
	require.Zero(t, h.effects("B-3"), "the discarded one is not run")

	// One rule for an action that finds nothing to act on, single or
	// bulk: exit status 3, nothing done. The count without --yes is a
	// question answered: 0.
	requireExit(t, cli(t, env, "parked", "replay", "-c", "ship-order", "--yes"), exitNotFound, "no parked message matches the criteria")
	requireExit(t, cli(t, env, "parked", "discard", "--reason", "B-", "--yes"), exitNotFound, "no parked message matches the criteria")
	requireExit(t, cli(t, env, "parked", "replay", "ship-order", uuids["B-1"]), exitNotFound, "parked replay")
	r = cli(t, env, "parked", "replay", "-c", "ship-order")
	requireOK(t, r)
	require.Equal(t, "0 messages match. Nothing done: the same command with --yes will replay them.\n", r.stdout)

	requireExit(t, cli(t, env, "parked", "replay"), exitUsage, "give CONSUMER KEY, or criteria")
	requireExit(t, cli(t, env, "parked", "replay", "only-consumer"), exitUsage, "give CONSUMER KEY")
	requireExit(t, cli(t, env, "parked", "show", "ship-order", "nope"), exitNotFound, "parked show")
}

// The Redis lease store: list, show and replay with --redis-url, the replay
// published through RabbitMQ (--amqp-url).
func TestParkedRedisStore(t *testing.T) {
	t.Parallel()
	rdb := testenv.Redis(t)
	prefix := testenv.RedisPrefix(t, rdb)
	store, err := redisstore.New(redisstore.Config{Client: rdb, Prefix: prefix})
	require.NoError(t, err)
	queue := testenv.Queue(t, "cli_parked_redis_")
	h := &poisonHandler{effect: map[string]int{}}
	ev := runRouter(t, queue, exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Duration: 10 * time.Second, Store: store}}, h)
	uuid := watermill.NewUUID()
	publishOrder(t, queue, uuid, "R-7", true)
	publishOrder(t, queue, watermill.NewUUID(), "R-8", true)
	testenv.Eventually(t, 20*time.Second, func() bool { return ev.count(exactlyonce.Parked) == 2 }, "parked in Redis")

	env := []string{"REDIS_URL=" + testenv.RedisURL(), envRedisPrefix + "=" + prefix}
	var list parkedListJSON
	decode(t, cli(t, env, "parked", "list", "--redis-url", "", "--json", "-c", "ship-order", "--meta", "order_id=R-7"), &list)
	require.Len(t, list.Messages, 1)
	require.Equal(t, uuid, list.Messages[0].UUID)
	require.Equal(t, queue, list.Messages[0].Topic)
	requireExit(t, cli(t, env, "parked", "list", "--redis-url", ""), exitUsage, "consumer")
	requireExit(t, cli(t, env, "parked", "replay", "--redis-url", "", "ship-order", uuid), exitUsage, "--amqp-url")

	h.fix()
	r := cli(t, append(env, envAMQPURL+"="+testenv.AMQPURL()), "parked", "replay", "--redis-url", "", "ship-order", uuid)
	requireOK(t, r)
	testenv.Eventually(t, 20*time.Second, func() bool { return h.effects("R-7") == 1 }, "the replayed order is processed")
	decode(t, cli(t, env, "parked", "list", "--redis-url", "", "--json", "-c", "ship-order"), &list)
	require.Len(t, list.Messages, 1)
	require.Equal(t, "R-8", list.Messages[0].Metadata["order_id"])

	// Every parked message of the consumer: the consumer is the criterion
	// (the Redis store needs one anyway); counted first, then --yes.
	env = append(env, envAMQPURL+"="+testenv.AMQPURL())
	r = cli(t, env, "parked", "replay", "--redis-url", "", "-c", "ship-order")
	requireOK(t, r)
	require.Regexp(t, `^1 message matches. Nothing done: the same command with --yes will replay them.\n`+
		`To replay exactly these \(refused, exit 4, if they changed\): --confirm 1@\S+Z\n$`, r.stdout)
	requireOK(t, cli(t, env, "parked", "replay", "--redis-url", "", "-c", "ship-order", "--yes"))
	testenv.Eventually(t, 20*time.Second, func() bool { return h.effects("R-8") == 1 }, "the bulk-replayed order is processed")
	decode(t, cli(t, env, "parked", "list", "--redis-url", "", "--json", "-c", "ship-order"), &list)
	require.Empty(t, list.Messages)
}

// The single-key actions take what the operator saw (--if-version,
// --if-uuid, --if-status, as show prints them): a key that changed since
// is refused with exit status 4, nothing done.
func TestActionsWithPreconditions(t *testing.T) {
	t.Parallel()
	requireRabbitMQ(t)
	testenv.EachEngine(t, testActionsWithPreconditions)
}

func testActionsWithPreconditions(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := append(engineEnv(b), envAMQPURL+"="+testenv.AMQPURL())
	queue := testenv.Queue(t, "cli_parked_if_")
	h := &poisonHandler{effect: map[string]int{}}
	ev := runRouter(t, queue, exactlyonce.Config{DB: db}, h)
	u1, u2 := watermill.NewUUID(), watermill.NewUUID()
	publishOrder(t, queue, u1, "C-1", true)
	publishOrder(t, queue, u2, "C-2", true)
	testenv.Eventually(t, 20*time.Second, func() bool { return ev.count(exactlyonce.Parked) == 2 }, "two parked")

	var shown parkedJSON
	decode(t, cli(t, env, "parked", "show", "--json", "ship-order", u1), &shown)
	require.NotEmpty(t, shown.Version)
	r := cli(t, env, "parked", "show", "ship-order", u1)
	requireOK(t, r)
	require.Regexp(t, `version +`+shown.Version+`\n`, r.stdout)

	// A precondition that does not hold: exit 4, nothing done.
	requireExit(t, cli(t, env, "parked", "discard", "ship-order", u1, "--if-uuid", u2), exitChanged, "changed since it was shown")
	requireExit(t, cli(t, env, "parked", "replay", "ship-order", u1, "--if-version", "msg-0123456789abcdef"), exitChanged, "changed since it was shown")
	requireExit(t, cli(t, env, "parked", "release", "ship-order", u1, "--if-status", "failed"), exitChanged, "changed since it was shown")
	decode(t, cli(t, env, "parked", "show", "--json", "ship-order", u1), &shown)
	require.Equal(t, "parked", shown.Status, "untouched")
	requireExit(t, cli(t, env, "parked", "discard", "--reason", "C-", "--yes", "--if-version", shown.Version), exitUsage, "for one message")

	// The key is replayed and processed after it was shown: a forget that
	// names what was shown is refused, the done record stays.
	var rec recordJSON
	decode(t, cli(t, env, "inbox", "show", "--json", "-c", "ship-order", u1), &rec)
	require.Equal(t, "parked", rec.Status)
	h.fix()
	requireOK(t, cli(t, env, "parked", "replay", "ship-order", u1, "--if-version", shown.Version))
	requireOK(t, cli(t, env, "outbox", "relay", "--once"))
	testenv.Eventually(t, 20*time.Second, func() bool { return h.effects("C-1") == 1 }, "replayed")
	requireExit(t, cli(t, env, "inbox", "forget", "-c", "ship-order", u1, "--if-version", rec.Version), exitChanged, "changed since it was shown")
	requireExit(t, cli(t, env, "inbox", "forget", "-c", "ship-order", u1, "--if-status", "parked"), exitChanged, "its status is not \"parked\"")
	decode(t, cli(t, env, "inbox", "show", "--json", "-c", "ship-order", u1), &rec)
	require.Equal(t, "done", rec.Status, "the done record stays")
	requireOK(t, cli(t, env, "inbox", "forget", "-c", "ship-order", u1, "--if-version", rec.Version))
	requireExit(t, cli(t, env, "inbox", "forget", "-c", "ship-order", u1, "--if-version", rec.Version), exitNotFound, "nothing to forget")
}
