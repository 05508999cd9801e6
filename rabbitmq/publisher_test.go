package rabbitmq_test

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// The relay hands a Publisher each batch in one call.
var _ outbox.BatchPublisher = (*rabbitmq.Publisher)(nil)

func newPublisher(t testing.TB, cfg rabbitmq.PublisherConfig) *rabbitmq.Publisher {
	t.Helper()
	p, err := rabbitmq.NewPublisher(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p
}

// messages returns n messages with UUIDs prefix-<i>, a payload and metadata.
func messages(prefix string, n int) []*message.Message {
	out := make([]*message.Message, n)
	for i := range out {
		out[i] = message.NewMessage(fmt.Sprintf("%s-%05d", prefix, i), []byte(fmt.Sprintf(`{"i":%d}`, i)))
		out[i].Metadata.Set("i", fmt.Sprint(i))
		out[i].Metadata.Set("source", "publisher-test")
	}
	return out
}

// to is the batch of msgs, each to topic.
func to(topic string, msgs []*message.Message) []msgid.TopicMessage {
	out := make([]msgid.TopicMessage, len(msgs))
	for i, m := range msgs {
		out[i] = msgid.TopicMessage{Topic: topic, Message: m}
	}
	return out
}

// queueUUIDs consumes every message in queue (they are all there: a
// confirmed message is enqueued) and counts them by UUID, read with
// rabbitmq.Marshaler.
func queueUUIDs(t *testing.T, amqpURL, queue string) map[string]int {
	t.Helper()
	ch := rawChannel(t, amqpURL)
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	got := map[string]int{}
	if q.Messages == 0 {
		return got
	}
	require.NoError(t, ch.Qos(1000, 0, false))
	deliveries, err := ch.Consume(queue, "", true, false, false, false, nil)
	require.NoError(t, err)
	timeout := time.After(20 * time.Second)
	for range q.Messages {
		select {
		case d := <-deliveries:
			m, err := rabbitmq.Marshaler{}.Unmarshal(d)
			require.NoError(t, err)
			got[m.UUID]++
		case <-timeout:
			require.FailNow(t, "queue not drained", "%s: %d messages expected, got %d distinct", queue, q.Messages, len(got))
		}
	}
	return got
}

func requireAllNil(t *testing.T, errs []error) {
	t.Helper()
	for i, err := range errs {
		require.NoError(t, err, "message %d", i)
	}
}

// Every message arrives once, with its UUID, payload and metadata, through
// watermill-amqp's subscriber; the queues were declared by the publisher,
// durable as NewDurableQueueConfig wants them.
func TestPublisherDeliversEachMessageOnce(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	qa, qb := uniqueQueue(t, amqpURL, "pub-a"), uniqueQueue(t, amqpURL, "pub-b")
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL, Window: 16})

	msgs := messages("m", 300)
	batch := to(qa, msgs)
	for i := range batch {
		batch[i].Topic = []string{qa, qa, qb}[i%3]
	}
	requireAllNil(t, pub.PublishBatch(ctx, batch))
	require.NoError(t, pub.Publish(qb, messages("p", 5)...), "Publish: a batch to one topic")

	sub := newSubscriber(t, amqpURL, rabbitmq.Marshaler{})
	want := map[string]*message.Message{}
	for _, tm := range batch {
		want[tm.Topic+"/"+tm.Message.UUID] = tm.Message
	}
	for _, m := range messages("p", 5) {
		want[qb+"/"+m.UUID] = m
	}
	for _, q := range []string{qa, qb} {
		in, err := sub.Subscribe(ctx, q)
		require.NoError(t, err)
		n := 0
		for _, k := range mapsKeys(want) {
			if strings.HasPrefix(k, q+"/") {
				n++
			}
		}
		for range n {
			select {
			case m := <-in:
				w, ok := want[q+"/"+m.UUID]
				require.True(t, ok, "unexpected or repeated message %s in %s", m.UUID, q)
				require.Equal(t, string(w.Payload), string(m.Payload))
				for k, v := range w.Metadata {
					require.Equal(t, v, m.Metadata.Get(k), "metadata %s of %s", k, m.UUID)
				}
				delete(want, q+"/"+m.UUID)
				m.Ack()
			case <-time.After(10 * time.Second):
				require.FailNow(t, "messages missing", "%d not received", len(want))
			}
		}
	}
	require.Empty(t, want)
}

func mapsKeys(m map[string]*message.Message) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// The window keeps many messages awaiting their confirm at once: 5,000
// messages go through far sooner than one confirm at a time (the assertion
// is only that ordering; the figures are in the benchmarks). Transient
// messages keep the one-at-a-time run short: their confirm does not wait for
// the disk.
func TestPublisherWindowKeepsManyInFlight(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	const n = 5000
	elapsed := map[int]time.Duration{}
	for _, window := range []int{1, 256} {
		q := uniqueQueue(t, amqpURL, fmt.Sprint("window", window))
		pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL, Window: window, Marshaler: rabbitmq.Marshaler{NotPersistent: true}})
		msgs := messages("w", n)
		requireAllNil(t, pub.PublishBatch(ctx, to(q, msgs[:1]))) // connect and declare
		start := time.Now()
		requireAllNil(t, pub.PublishBatch(ctx, to(q, msgs[1:])))
		elapsed[window] = time.Since(start)
		got := queueUUIDs(t, amqpURL, q)
		require.Len(t, got, n)
	}
	t.Logf("%d messages: window 1 %v, window 256 %v", n, elapsed[1], elapsed[256])
	require.Less(t, elapsed[256], elapsed[1], "a window of 256 is slower than one confirm at a time")
}

// With declarations off, a message to a queue nobody declared is returned
// (mandatory) and fails alone; the others are confirmed and in their queue.
// With declarations on, a queue deleted after it was declared makes its
// messages fail once, and the next call declares it again.
func TestPublisherUnroutableFailsAlone(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "routable")
	missing := uniqueQueue(t, amqpURL, "missing")
	require.NoError(t, rabbitmq.DeclareQueues(ctx, amqpURL, q))

	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL, NoQueueDeclare: true})
	msgs := messages("u", 9)
	batch := to(q, msgs)
	batch[4].Topic = missing
	errs := pub.PublishBatch(ctx, batch)
	for i, err := range errs {
		if i == 4 {
			require.ErrorContains(t, err, "returned by the broker: 312 NO_ROUTE")
			require.False(t, exactlyonce.IsPermanent(err), "a missing queue is the destination's state, not the message's")
			continue
		}
		require.NoError(t, err, "message %d", i)
	}
	got := queueUUIDs(t, amqpURL, q)
	require.Len(t, got, 8)
	require.NotContains(t, got, msgs[4].UUID)
	requireAllNil(t, pub.PublishBatch(ctx, batch[:4]))

	// Declarations on: a queue deleted behind the publisher's back.
	declaring := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL})
	gone := uniqueQueue(t, amqpURL, "gone")
	requireAllNil(t, declaring.PublishBatch(ctx, to(gone, messages("g", 3))))
	_, err := rawChannel(t, amqpURL).QueueDelete(gone, false, false, false)
	require.NoError(t, err)
	for _, err := range declaring.PublishBatch(ctx, to(gone, messages("h", 3))) {
		require.ErrorContains(t, err, "NO_ROUTE")
	}
	requireAllNil(t, declaring.PublishBatch(ctx, to(gone, messages("i", 3))))
	require.Len(t, queueUUIDs(t, amqpURL, gone), 3)
}

// A queue that refuses messages (x-overflow reject-publish, full) makes the
// broker nack them: those fail, the ones it took are confirmed, and the
// channel goes on: once there is room, the next call succeeds.
func TestPublisherNackFailsThoseMessages(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "full")
	ch := rawChannel(t, amqpURL)
	_, err := ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-max-length": int32(3), "x-overflow": "reject-publish"})
	require.NoError(t, err)

	// The publisher's own declaration (no arguments) would not match.
	mismatched := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL})
	for _, err := range mismatched.PublishBatch(ctx, to(q, messages("d", 2))) {
		require.ErrorContains(t, err, "PRECONDITION_FAILED")
		require.ErrorContains(t, err, "NoQueueDeclare")
		require.False(t, exactlyonce.IsPermanent(err), "a queue declared otherwise is the destination's state")
	}

	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL, NoQueueDeclare: true})
	errs := pub.PublishBatch(ctx, to(q, messages("n", 10)))
	for i, err := range errs {
		if i < 3 {
			require.NoError(t, err, "message %d", i)
		} else {
			require.ErrorContains(t, err, "nacked", "message %d", i)
			require.False(t, exactlyonce.IsPermanent(err), "back-pressure is the broker's state, not the message's")
		}
	}
	_, err = ch.QueuePurge(q, false)
	require.NoError(t, err)
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("o", 3))))
}

// expiringMarshaler is rabbitmq.Marshaler with the AMQP expiration property
// taken from the metadata key "expiration": RabbitMQ closes the channel on a
// message whose expiration is not a number (PRECONDITION_FAILED).
type expiringMarshaler struct{ rabbitmq.Marshaler }

func (m expiringMarshaler) Marshal(msg *message.Message) (amqp091.Publishing, error) {
	p, err := m.Marshaler.Marshal(msg)
	p.Expiration = msg.Metadata.Get("expiration")
	return p, err
}

// A message the broker closes the channel for, in the middle of a window
// of messages in flight: it fails alone, every other message is confirmed
// and in the queue (those that were in flight with it were published again:
// some may be there twice), and the next call succeeds.
func TestPublisherChannelClosedByBrokerFailsOnlyThatMessage(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "closing")
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL, Window: 64, Marshaler: expiringMarshaler{}})
	msgs := messages("c", 300)
	msgs[150].Metadata.Set("expiration", "not-a-number")
	errs := pub.PublishBatch(ctx, to(q, msgs))
	for i, err := range errs {
		if i == 150 {
			require.ErrorContains(t, err, "PRECONDITION_FAILED")
			require.True(t, exactlyonce.IsPermanent(err), "the broker refused the message itself")
			continue
		}
		require.NoError(t, err, "message %d", i)
	}
	got := queueUUIDs(t, amqpURL, q)
	dups := 0
	for i, m := range msgs {
		if i == 150 {
			require.Zero(t, got[m.UUID])
			continue
		}
		require.Positive(t, got[m.UUID], "message %d missing", i)
		dups += got[m.UUID] - 1
	}
	t.Logf("%d duplicates (messages in flight when the channel closed, published again)", dups)
	require.LessOrEqual(t, dups, 64)
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("after", 3))))
}

// A header name or property AMQP cannot carry fails that message before it
// is sent (amqp091-go would close the connection on it).
func TestPublisherRefusesWhatAMQPCannotCarry(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "carry")
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL})
	msgs := messages("h", 4)
	msgs[1].Metadata.Set(strings.Repeat("k", 256), "v")
	batch := to(q, msgs)
	batch[3].Topic = strings.Repeat("q", 256)
	errs := pub.PublishBatch(ctx, batch)
	require.NoError(t, errs[0])
	require.ErrorContains(t, errs[1], "header name")
	require.NoError(t, errs[2])
	require.ErrorContains(t, errs[3], "routing key")
	require.True(t, exactlyonce.IsPermanent(errs[1]))
	require.True(t, exactlyonce.IsPermanent(errs[3]))
	require.Len(t, queueUUIDs(t, amqpURL, q), 2)
}

// proxied returns the broker URL through a TCP proxy the test can cut.
func proxied(t *testing.T, amqpURL string) (*testenv.Proxy, string) {
	t.Helper()
	u, err := url.Parse(amqpURL)
	require.NoError(t, err)
	p := testenv.NewProxy(t, u.Host)
	return p, p.RewriteURL(amqpURL)
}

// waitForMessages waits until queue holds at least n messages.
func waitForMessages(t *testing.T, ch *amqp091.Channel, queue string, n int) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, func() bool {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		require.NoError(t, err)
		return q.Messages >= n
	}, "%d messages in %s", n, queue)
}

// The connection is cut in the middle of a call: the confirmed messages are
// in the queue, the others fail (their outcome unknown), and once the broker
// is reachable again the next call dials again and succeeds.
func TestPublisherConnectionLostMidBatch(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "cut")
	require.NoError(t, rabbitmq.DeclareQueues(ctx, amqpURL, q))
	proxy, viaProxy := proxied(t, amqpURL)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: viaProxy})

	const n = 50_000
	msgs := messages("x", n)
	done := make(chan []error, 1)
	go func() { done <- pub.PublishBatch(ctx, to(q, msgs)) }()
	waitForMessages(t, rawChannel(t, amqpURL), q, 2000)
	proxy.Refuse()
	var errs []error
	select {
	case errs = <-done:
	case <-time.After(20 * time.Second):
		require.FailNow(t, "PublishBatch did not return after the connection was cut")
	}
	confirmed, failed := 0, 0
	for _, err := range errs {
		if err == nil {
			confirmed++
		} else {
			failed++
			require.Contains(t, err.Error(), "connection", "why a message failed")
			require.False(t, exactlyonce.IsPermanent(err),
				"a message lost with the connection is not its own failure: the relay must not count it (exactlyonce.IsPermanent): %v", err)
		}
	}
	t.Logf("%d confirmed, %d failed when the connection was cut", confirmed, failed)
	require.Positive(t, confirmed)
	require.Positive(t, failed, "the cut came after the call ended: nothing was tested")

	// While the broker is unreachable, a call fails at once.
	for _, err := range pub.PublishBatch(ctx, to(q, messages("down", 2))) {
		require.ErrorContains(t, err, "cannot connect")
		require.False(t, exactlyonce.IsPermanent(err), "not sent for want of a connection: not the message's failure")
	}
	proxy.Allow()
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("after", 3))))

	got := queueUUIDs(t, amqpURL, q)
	for i, err := range errs {
		if err == nil {
			require.Equal(t, 1, got[msgs[i].UUID], "confirmed message %d", i)
		}
	}
	for _, m := range messages("after", 3) {
		require.Equal(t, 1, got[m.UUID])
	}
}

// The context ends while confirms are outstanding: the call returns, the
// confirmed messages are nil, the others carry the context's error, and the
// publisher goes on with a fresh channel.
func TestPublisherContextEndsMidBatch(t *testing.T) {
	amqpURL := amqpURL(t)
	q := uniqueQueue(t, amqpURL, "ctx")
	require.NoError(t, rabbitmq.DeclareQueues(testContext(t), amqpURL, q))
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL})
	ctx, cancel := context.WithCancel(testContext(t))
	const n = 50_000
	done := make(chan []error, 1)
	go func() { done <- pub.PublishBatch(ctx, to(q, messages("y", n))) }()
	waitForMessages(t, rawChannel(t, amqpURL), q, 2000)
	cancel()
	var errs []error
	select {
	case errs = <-done:
	case <-time.After(10 * time.Second):
		require.FailNow(t, "PublishBatch did not return after its context ended")
	}
	cancelled := 0
	for _, err := range errs {
		if err != nil {
			require.ErrorIs(t, err, context.Canceled)
			cancelled++
		}
	}
	t.Logf("%d of %d not confirmed when the context ended", cancelled, n)
	require.Positive(t, cancelled, "the call ended before the cancel: nothing was tested")
	require.GreaterOrEqual(t, n-cancelled, 2000-256, "the messages confirmed before the cancel (2000 were in the queue, at most a window of 256 unconfirmed) are nil")
	requireAllNil(t, pub.PublishBatch(testContext(t), to(q, messages("z", 3))))
}

// Concurrent callers (the relay's workers) each get their messages
// confirmed, and every message arrives once.
func TestPublisherConcurrentCallers(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "concurrent")
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL, Window: 32})
	const callers, calls, size = 8, 5, 100
	var wg sync.WaitGroup
	errs := make([][]error, callers*calls)
	for c := range callers {
		wg.Go(func() {
			for k := range calls {
				errs[c*calls+k] = pub.PublishBatch(ctx, to(q, messages(fmt.Sprintf("c%d-%d", c, k), size)))
			}
		})
	}
	wg.Wait()
	for _, e := range errs {
		requireAllNil(t, e)
	}
	got := queueUUIDs(t, amqpURL, q)
	require.Len(t, got, callers*calls*size)
	for uuid, n := range got {
		require.Equal(t, 1, n, uuid)
	}
}

// Close closes the connection: a call in progress returns, later calls fail,
// and Close again does nothing.
func TestPublisherClose(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "close")
	require.NoError(t, rabbitmq.DeclareQueues(ctx, amqpURL, q))
	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: amqpURL})
	require.NoError(t, err)
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("a", 3))))

	const n = 50_000
	done := make(chan []error, 1)
	go func() { done <- pub.PublishBatch(ctx, to(q, messages("b", n))) }()
	waitForMessages(t, rawChannel(t, amqpURL), q, 2000)
	require.NoError(t, pub.Close())
	select {
	case errs := <-done:
		require.Error(t, errs[n-1], "the last message was not confirmed before Close")
	case <-time.After(10 * time.Second):
		require.FailNow(t, "a call in progress did not return after Close")
	}
	for _, err := range pub.PublishBatch(ctx, to(q, messages("c", 2))) {
		require.ErrorContains(t, err, "closed")
	}
	require.ErrorContains(t, pub.Publish(q, messages("d", 1)...), "closed")
	require.NoError(t, pub.Close())
}

func TestNewPublisherConfig(t *testing.T) {
	_, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{})
	require.ErrorContains(t, err, "URL is required")
	_, err = rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: "http://x"})
	require.ErrorContains(t, err, "invalid AMQP URL")
	_, err = rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: defaultAMQPURL, Window: -1})
	require.ErrorContains(t, err, "Window")
	p, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: "amqp://guest:guest@127.0.0.1:1/"})
	require.NoError(t, err, "NewPublisher does not connect")
	errs := p.PublishBatch(context.Background(), to("t", messages("m", 1)))
	require.ErrorContains(t, errs[0], "cannot connect")
	require.NoError(t, p.Close())
}

// A nil message or an empty topic is the caller's mistake, not the
// message's: its error is not marked permanent (a handler that publishes
// with a topic missing from its configuration is redelivered until that is
// fixed, not parked), while a message the broker can never take is.
func TestPublisherMarksOnlyTheMessagesOwnFailures(t *testing.T) {
	t.Parallel()
	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: testenv.AMQPURL()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	errs := pub.PublishBatch(context.Background(), []msgid.TopicMessage{
		{Topic: "q", Message: nil},
		{Topic: "", Message: message.NewMessage(watermill.NewUUID(), []byte("x"))},
		{Topic: strings.Repeat("q", 256), Message: message.NewMessage(watermill.NewUUID(), []byte("x"))},
	})
	require.Len(t, errs, 3)
	require.ErrorContains(t, errs[0], "nil message")
	require.False(t, exactlyonce.IsPermanent(errs[0]), "nil message: %v", errs[0])
	require.ErrorContains(t, errs[1], "empty topic")
	require.False(t, exactlyonce.IsPermanent(errs[1]), "empty topic: %v", errs[1])
	require.Error(t, errs[2])
	require.True(t, exactlyonce.IsPermanent(errs[2]), "a routing key over 255 bytes: %v", errs[2])
}
