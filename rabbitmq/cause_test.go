package rabbitmq_test

// Outcomes attributed to exactly the publishing they belong to, and the
// broker's own state (a queue gone, a full queue) never blamed on a message.

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// drainUUIDs consumes every message in queue and returns the UUIDs read
// from watermill-amqp's UUID header.
func drainUUIDs(t *testing.T, amqpURL, queue string) map[string]int {
	t.Helper()
	ch := rawChannel(t, amqpURL)
	got := map[string]int{}
	for {
		d, ok, err := ch.Get(queue, true)
		require.NoError(t, err)
		if !ok {
			return got
		}
		uuid, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		require.NotEmpty(t, uuid, "a message without the UUID header")
		got[uuid]++
	}
}

// One PublishBatch call of identical bodies with a marshaler that sets no
// message_id (watermill-amqp's DefaultMarshaler), while the queue is deleted
// and declared again: the messages published while it is gone come back
// (basic.return). Each return must fail the message it belongs to: a
// message reported returned is not in the queue, and a message reported
// confirmed was enqueued (in the queue that was deleted, or in the new one).
func TestPublisherAttributesReturnsWithoutMessageID(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "returns")
	admin := rawChannel(t, amqpURL)
	_, err := admin.QueueDeclare(q, true, false, false, false, nil)
	require.NoError(t, err)
	const (
		n      = 4000
		window = 16
	)
	pub := newPublisher(t, rabbitmq.PublisherConfig{
		URL: amqpURL, Window: window, NoQueueDeclare: true, Marshaler: wamqp.DefaultMarshaler{},
	})
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(fmt.Sprintf("same-body-%05d", i), []byte(`{"same":true}`))
	}

	// A consumer records what reaches the queue until the queue is deleted;
	// once it has a quarter, the queue is deleted (with what the consumer
	// has not taken yet) and declared again a moment later.
	consumer := rawChannel(t, amqpURL)
	require.NoError(t, consumer.Qos(500, 0, false))
	deliveries, err := consumer.Consume(q, "", true, false, false, false, nil)
	require.NoError(t, err)
	var mu sync.Mutex
	delivered := map[string]int{}
	consumedQuarter := make(chan struct{})
	consumerDone := make(chan struct{})
	go func() {
		defer close(consumerDone)
		for d := range deliveries {
			uuid, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
			mu.Lock()
			delivered[uuid]++
			if len(delivered) == n/4 {
				close(consumedQuarter)
			}
			mu.Unlock()
		}
	}()
	deleted := make(chan int, 1)
	go func() {
		defer close(deleted)
		select {
		case <-consumedQuarter:
		case <-time.After(20 * time.Second):
			return
		}
		purged, err := admin.QueueDelete(q, false, false, false)
		if err != nil {
			return
		}
		time.Sleep(30 * time.Millisecond) // the gap: publishings meanwhile are unroutable
		if _, err := admin.QueueDeclare(q, true, false, false, false, nil); err != nil {
			return
		}
		deleted <- purged
	}()
	errs := pub.PublishBatch(ctx, to(q, msgs))
	purged, ok := <-deleted
	require.True(t, ok, "the queue was not deleted and declared again during the call")
	<-consumerDone // the deletion cancelled the consumer

	for uuid, k := range drainUUIDs(t, amqpURL, q) {
		delivered[uuid] += k
	}
	var confirmed, returned, other, confirmedNotDelivered int
	var returnedButDelivered []string
	for i, err := range errs {
		switch {
		case err == nil:
			confirmed++
			if delivered[msgs[i].UUID] == 0 {
				confirmedNotDelivered++
			}
		case strings.Contains(err.Error(), "returned"):
			returned++
			if delivered[msgs[i].UUID] > 0 {
				returnedButDelivered = append(returnedButDelivered, msgs[i].UUID)
			}
		default:
			other++
			t.Logf("message %d: %v", i, err)
		}
	}
	t.Logf("%d confirmed, %d returned, %d other; %d delivered, %d purged with the queue; %d confirmed and not delivered, %d returned and delivered",
		confirmed, returned, other, len(delivered), purged, confirmedNotDelivered, len(returnedButDelivered))
	require.Positive(t, returned, "no message came back: the scenario did not happen")
	require.Zero(t, len(returnedButDelivered), "messages reported returned although they were delivered, e.g. %v",
		returnedButDelivered[:min(5, len(returnedButDelivered))])
	// A confirmed message was delivered, or purged with the old queue before
	// the consumer took it (or routed to the old queue as it was being
	// deleted: at most the window in flight then).
	require.LessOrEqual(t, confirmedNotDelivered, purged+window,
		"messages reported confirmed that reached no queue (lost: their rows would be deleted)")
	require.Zero(t, other)
}

// A queue with a length limit and overflow reject-publish nacks while its
// consumer is behind: the broker's back-pressure, not the messages' fault.
// The relay retries the nacked rows with their backoff; with the default
// MaxAttempts none is quarantined, and every row reaches the slow consumer.
func TestRelayBackPressureQuarantinesNothing(t *testing.T) {
	amqpURL := amqpURL(t)
	db := schema(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "backpressure")
	admin := rawChannel(t, amqpURL)
	_, err := admin.QueueDeclare(q, true, false, false, false, amqp091.Table{
		"x-max-length": int32(10), "x-overflow": "reject-publish",
	})
	require.NoError(t, err)

	const rows = 200
	want := writeRows(t, ctx, db, "bp", rows, q)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL, NoQueueDeclare: true})
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: db, Publisher: pub, Logger: testenv.Logger(t), BatchSize: 50,
		PollInterval: 10 * time.Millisecond, ErrorBackoff: 50 * time.Millisecond, MaxErrorBackoff: 400 * time.Millisecond,
	})
	require.NoError(t, err)

	// The slow consumer: one message at a time, 20 ms each.
	var mu sync.Mutex
	got := map[string]int{}
	consumer := rawChannel(t, amqpURL)
	require.NoError(t, consumer.Qos(1, 0, false))
	deliveries, err := consumer.Consume(q, "", false, false, false, false, nil)
	require.NoError(t, err)
	cctx, cancel := context.WithCancel(context.Background())
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		for {
			select {
			case <-cctx.Done():
				return
			case d, ok := <-deliveries:
				if !ok {
					return
				}
				time.Sleep(20 * time.Millisecond)
				m, err := rabbitmq.Marshaler{}.Unmarshal(d)
				if err == nil {
					mu.Lock()
					got[q+"/"+m.UUID]++
					mu.Unlock()
				}
				_ = d.Ack(false)
			}
		}
	}()
	defer func() { cancel(); <-consumed }()

	stop := runRelay(t, relay)
	arrived := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(got)
	}
	testenv.Eventually(t, 45*time.Second, func() bool { return arrived() == rows || pending(t, db).Quarantined > 0 },
		"every row reaches the slow consumer")
	stop()
	st := relay.Stats()
	t.Logf("relay: %d relayed, %d failed publishes, %d quarantined", st.Relayed, st.FailedPublishes, st.Quarantined)
	require.Positive(t, st.FailedPublishes, "the queue never pushed back: the scenario did not happen")
	require.Zero(t, pending(t, db).Quarantined, "rows quarantined for the broker's back-pressure")
	require.Zero(t, st.Quarantined)
	mu.Lock()
	defer mu.Unlock()
	for _, k := range want {
		require.Positive(t, got[k], "row %s never arrived", k)
	}
}

// The connection is cut right after a call left its channel idle, and the
// next call starts at once: it may take that channel and write on the dead
// socket before the client noticed the connection closing. Whenever the cut
// comes, a message reported confirmed is in the queue. (A write that failed
// that way, with nothing else in flight, once left the messages not sent
// without an outcome, reported as confirmed: their rows were deleted, and
// they were lost.)
func TestPublisherConfirmsOnlyWhatReachedTheQueueAcrossCuts(t *testing.T) {
	amqpURL := amqpURL(t)
	ctx := testContext(t)
	q := uniqueQueue(t, amqpURL, "cuts")
	require.NoError(t, rabbitmq.DeclareQueues(ctx, amqpURL, q))
	proxy, viaProxy := proxied(t, amqpURL)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: viaProxy, NoQueueDeclare: true})

	const rounds, callers, perCall = 150, 4, 5
	confirmed := map[string]bool{}
	var mu sync.Mutex
	call := func(prefix string) {
		msgs := messages(prefix, perCall)
		for i, err := range pub.PublishBatch(ctx, to(q, msgs)) {
			if err == nil {
				mu.Lock()
				confirmed[msgs[i].UUID] = true
				mu.Unlock()
			}
		}
	}
	for r := range rounds {
		var wg sync.WaitGroup
		for c := range callers { // channels left idle
			wg.Go(func() { call(fmt.Sprintf("warm-%03d-%d", r, c)) })
		}
		wg.Wait()
		proxy.Refuse()
		for c := range callers { // at once, on the idle channels of a dead connection
			wg.Go(func() { call(fmt.Sprintf("cut-%03d-%d", r, c)) })
		}
		wg.Wait()
		proxy.Allow()
	}
	got := queueUUIDs(t, amqpURL, q)
	var lost []string
	for uuid := range confirmed {
		if got[uuid] == 0 {
			lost = append(lost, uuid)
		}
	}
	t.Logf("%d cuts, %d messages confirmed, %d in the queue, %d lost", rounds, len(confirmed), len(got), len(lost))
	require.Positive(t, len(confirmed))
	require.Empty(t, lost, "messages reported confirmed that are in no queue (lost)")
}

// frameProxy forwards AMQP between a client and RabbitMQ, frame by frame on
// the way back, so that a test can drop the broker's confirms (basic.ack:
// a broker that keeps the connection alive and confirms nothing, as a
// quorum queue without a majority) or tell the client the connection is
// blocked (connection.blocked: a memory or disk alarm).
type frameProxy struct {
	ln       net.Listener
	dropAcks atomic.Bool
	mu       sync.Mutex
	clients  []net.Conn
	wg       sync.WaitGroup
}

func newFrameProxy(t *testing.T, amqpURL string) (*frameProxy, string) {
	t.Helper()
	u, err := url.Parse(amqpURL)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &frameProxy{ln: ln}
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", u.Host)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.clients = append(p.clients, c)
			p.mu.Unlock()
			p.wg.Go(func() { _, _ = io.Copy(s, c); _ = s.Close() })
			p.wg.Go(func() {
				defer func() { _ = c.Close() }()
				for {
					hdr := make([]byte, 7)
					if _, err := io.ReadFull(s, hdr); err != nil {
						return
					}
					rest := make([]byte, binary.BigEndian.Uint32(hdr[3:7])+1)
					if _, err := io.ReadFull(s, rest); err != nil {
						return
					}
					if hdr[0] == 1 && len(rest) >= 5 && binary.BigEndian.Uint16(rest[0:2]) == 60 &&
						binary.BigEndian.Uint16(rest[2:4]) == 80 && p.dropAcks.Load() {
						continue // basic.ack
					}
					p.mu.Lock()
					_, err := c.Write(append(hdr, rest...))
					p.mu.Unlock()
					if err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.clients {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p, "amqp://" + u.User.String() + "@" + ln.Addr().String() + u.Path
}

// block tells every client connection it is blocked (connection.blocked).
func (p *frameProxy) block() {
	reason := "low on memory (test)"
	payload := append([]byte{0, 10, 0, 60, byte(len(reason))}, reason...)
	frame := append([]byte{1, 0, 0, 0, 0, 0, byte(len(payload))}, payload...)
	frame = append(frame, 0xCE)
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.clients {
		_, _ = c.Write(frame)
	}
}

// A broker that keeps the connection alive but confirms nothing: the call
// returns after ConfirmTimeout, its messages failed with an unknown outcome
// (not permanent), instead of holding the relay's batch for ever.
func TestPublisherConfirmTimeout(t *testing.T) {
	amqpURL := amqpURL(t)
	q := uniqueQueue(t, amqpURL, "noack")
	require.NoError(t, rabbitmq.DeclareQueues(testContext(t), amqpURL, q))
	proxy, viaProxy := newFrameProxy(t, amqpURL)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: viaProxy, NoQueueDeclare: true, ConfirmTimeout: 300 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("before", 2))))

	proxy.dropAcks.Store(true)
	start := time.Now()
	errs := pub.PublishBatch(ctx, to(q, messages("noack", 5)))
	took := time.Since(start)
	require.NoError(t, ctx.Err(), "the call returned only when its context ended")
	for i, err := range errs {
		require.ErrorContains(t, err, "no confirm", "message %d", i)
		require.False(t, exactlyonce.IsPermanent(err), "an outcome unknown is not the message's own failure")
	}
	t.Logf("returned after %v", took)

	proxy.dropAcks.Store(false)
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("after", 2))))
}

// A broker that blocks the connection (a resource alarm) stops taking
// messages: the call fails the messages it has not published at once, not
// permanently, instead of blocking on a write.
func TestPublisherBlockedConnection(t *testing.T) {
	amqpURL := amqpURL(t)
	q := uniqueQueue(t, amqpURL, "blocked")
	require.NoError(t, rabbitmq.DeclareQueues(testContext(t), amqpURL, q))
	proxy, viaProxy := newFrameProxy(t, amqpURL)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: viaProxy, NoQueueDeclare: true})
	ctx := testContext(t)
	requireAllNil(t, pub.PublishBatch(ctx, to(q, messages("before", 2))))

	proxy.block()
	deadline := time.Now().Add(5 * time.Second)
	for {
		errs := pub.PublishBatch(ctx, to(q, messages(fmt.Sprintf("blocked-%d", time.Now().UnixNano()), 3)))
		if errs[0] != nil {
			for i, err := range errs {
				require.ErrorContains(t, err, "blocked the connection", "message %d", i)
				require.False(t, exactlyonce.IsPermanent(err))
			}
			return
		}
		require.True(t, time.Now().Before(deadline), "the blocked notice never took effect")
		time.Sleep(10 * time.Millisecond)
	}
}

// A message whose headers would not fit in one frame fails alone, as the
// message's own (RabbitMQ would close the whole connection on it, failing
// every call on it again at each retry); the others are confirmed.
func TestPublisherHeadersOverFrameSizeFailAlone(t *testing.T) {
	amqpURL := amqpURL(t)
	q := uniqueQueue(t, amqpURL, "frame")
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: amqpURL})
	msgs := messages("f", 3)
	msgs[1].Metadata.Set("big", strings.Repeat("h", 200_000))
	errs := pub.PublishBatch(testContext(t), to(q, msgs))
	require.NoError(t, errs[0])
	require.ErrorContains(t, errs[1], "frame size")
	require.True(t, exactlyonce.IsPermanent(errs[1]))
	require.NoError(t, errs[2])
	got := queueUUIDs(t, amqpURL, q)
	require.Equal(t, map[string]int{msgs[0].UUID: 1, msgs[2].UUID: 1}, got)
}
