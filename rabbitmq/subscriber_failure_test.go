package rabbitmq_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// errorLog records the Subscriber's error logs: a lost channel (an ack the
// broker refused closes it) shows there.
type errorLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	errs []string
}

func (l *errorLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, fmt.Sprintf("%s: %v", msg, err))
}

func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *errorLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.errs...)
}

// returnsWithin runs f and fails the test when it does not return within d
// (f goes on running; the test's cleanup waits for nothing of it).
func returnsWithin(t *testing.T, d time.Duration, what string, f func()) time.Duration {
	t.Helper()
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
		return time.Since(start)
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
		return 0
	}
}

// Acks and nacks from concurrent handlers, in any order and at any time,
// under every ack configuration: the broker never sees an unknown delivery
// tag (which would close the channel), a nacked message comes back, an
// acked one never does, and nothing is lost.
func TestSubscriberAcksNacksAnyOrderAnyConfig(t *testing.T) {
	url := amqpURL(t)
	for _, tc := range []struct {
		name     string
		prefetch int
		hold     time.Duration
	}{
		{"prefetch1", 1, 0},
		{"prefetch2-hold-negative", 2, -1},
		{"prefetch7-hold1ms", 7, time.Millisecond},
		{"prefetch64-default", 64, 0},
		{"prefetch64-hold-negative", 64, -1},
		{"prefetch64-hold200ms", 64, 200 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 300
			queue := uniqueQueue(t, url, "sub-anyorder")
			fill(t, url, queue, "m", n)
			log := &errorLog{}
			sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Prefetch: tc.prefetch, AckHold: tc.hold, Logger: log})
			ctx := testContext(t)
			msgs, err := sub.Subscribe(ctx, queue)
			require.NoError(t, err)
			r := rand.New(rand.NewPCG(uint64(tc.prefetch), 1))
			var mu sync.Mutex
			acked, nacked := map[string]int{}, map[string]int{}
			deliveries := 0
			tick := time.NewTicker(10 * time.Millisecond)
			defer tick.Stop()
			for {
				mu.Lock()
				done := len(acked) == n
				mu.Unlock()
				if done {
					break
				}
				select {
				case <-tick.C:
				case m := <-msgs:
					deliveries++
					nack := r.Float64() < 0.15
					delay := time.Duration(r.IntN(3000)) * time.Microsecond
					go func() {
						time.Sleep(delay)
						mu.Lock()
						defer mu.Unlock()
						if nack {
							nacked[m.UUID]++
							m.Nack()
							return
						}
						acked[m.UUID]++
						m.Ack()
					}()
				case <-ctx.Done():
					mu.Lock()
					defer mu.Unlock()
					require.FailNow(t, "messages missing", "%d of %d acked; errors: %v", len(acked), n, log.all())
				}
			}
			select {
			case m := <-msgs:
				require.FailNow(t, "a message came back after every message was acked", "uuid %s", m.UUID)
			case <-time.After(300 * time.Millisecond):
			}
			require.NoError(t, sub.Close())
			mu.Lock()
			defer mu.Unlock()
			for id, k := range acked {
				require.Equal(t, 1, k, "message %s acked %d times: an acked message came back", id, k)
			}
			require.Empty(t, log.all(), "the channel was never lost (an unknown delivery tag closes it)")
			require.Zero(t, queueDepth(t, url, queue))
			t.Logf("%d deliveries, %d nacks", deliveries, deliveries-n)
		})
	}
}

// A handler that never acks: Close gives up on it after CloseTimeout, the
// acks of the others (held behind it) reach the broker, and it goes back to
// the queue.
func TestSubscriberHandlerNeverAcks(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-never")
	fill(t, url, queue, "m", 10)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Prefetch: 10, AckHold: time.Hour, CloseTimeout: 300 * time.Millisecond})
	msgs, err := sub.Subscribe(testContext(t), queue)
	require.NoError(t, err)
	for i := range 10 {
		m := <-msgs
		if i > 0 { // the oldest is never acked: every other ack is held behind it
			m.Ack()
		}
	}
	took := returnsWithin(t, 10*time.Second, "Close", func() { require.NoError(t, sub.Close()) })
	require.GreaterOrEqual(t, took, 250*time.Millisecond, "Close waits CloseTimeout for the unsettled delivery")
	require.Eventually(t, func() bool { return queueDepth(t, url, queue) == 1 }, 5*time.Second, 50*time.Millisecond,
		"the 9 held acks reached the broker, the unsettled one went back")
}

// The broker cancels the consumer when its queue is deleted: the
// subscription declares the queue again and consumes it, and acks of
// deliveries of the cancelled consumer do nothing harmful.
func TestSubscriberQueueDeletedConsumesAgain(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-deleted")
	fill(t, url, queue, "old", 5)
	log := &errorLog{}
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Prefetch: 5, ReconnectDelay: 100 * time.Millisecond, Logger: log})
	ctx := testContext(t)
	msgs, err := sub.Subscribe(ctx, queue)
	require.NoError(t, err)
	var old []*message.Message
	for range 5 {
		old = append(old, <-msgs)
	}
	old[0].Ack()
	_, err = rawChannel(t, url).QueueDelete(queue, false, false, false)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		for _, e := range log.all() {
			if strings.Contains(e, "cancelled the consumer") {
				return true
			}
		}
		return false
	}, 10*time.Second, 20*time.Millisecond, "the cancel is seen")
	for _, m := range old[1:] {
		m.Ack() // their channel is gone
	}
	// The queue is there again (declared by the subscription) and consumed.
	require.Eventually(t, func() bool {
		_, err := rawChannel(t, url).QueueDeclarePassive(queue, true, false, false, false, nil)
		return err == nil
	}, 10*time.Second, 50*time.Millisecond)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URL: url})
	requireAllNil(t, pub.PublishBatch(ctx, to(queue, messages("new", 3))))
	got := map[string]bool{}
	for len(got) < 3 {
		select {
		case m := <-msgs:
			require.True(t, strings.HasPrefix(m.UUID, "new-"), "got %s", m.UUID)
			got[m.UUID] = true
			m.Ack()
		case <-ctx.Done():
			require.FailNow(t, "not consumed again", "errors: %v", log.all())
		}
	}
	returnsWithin(t, 10*time.Second, "Close", func() { require.NoError(t, sub.Close()) })
	require.Zero(t, queueDepth(t, url, queue))
}

// The queue deleted under NoQueueDeclare: the subscription keeps trying;
// Close stops it at once.
func TestSubscriberQueueDeletedNoDeclareCloses(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-deleted-nodecl")
	fill(t, url, queue, "m", 1)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, NoQueueDeclare: true, ReconnectDelay: 100 * time.Millisecond})
	msgs, err := sub.Subscribe(testContext(t), queue)
	require.NoError(t, err)
	(<-msgs).Ack()
	_, err = rawChannel(t, url).QueueDelete(queue, false, false, false)
	require.NoError(t, err)
	time.Sleep(500 * time.Millisecond) // a few failed attempts
	returnsWithin(t, 5*time.Second, "Close", func() { require.NoError(t, sub.Close()) })
	_, open := <-msgs
	require.False(t, open)
}

// Many subscriptions share one connection: a cut ends all their channels,
// every one consumes again, nothing is lost.
func TestSubscriberManySubscriptionsShareConnectionCut(t *testing.T) {
	url := amqpURL(t)
	proxy, purl := proxied(t, url)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: purl, Prefetch: 8, ReconnectDelay: 200 * time.Millisecond})
	ctx := testContext(t)
	const subs, n = 6, 40
	queues := make([]string, subs)
	var wg sync.WaitGroup
	var mu sync.Mutex
	seen := map[string]bool{}
	for i := range queues {
		queues[i] = uniqueQueue(t, url, fmt.Sprintf("sub-share%d", i))
		fill(t, url, queues[i], fmt.Sprintf("q%d", i), n)
		msgs, err := sub.Subscribe(ctx, queues[i])
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range msgs {
				mu.Lock()
				seen[m.UUID] = true
				mu.Unlock()
				go func() {
					time.Sleep(5 * time.Millisecond)
					m.Ack()
				}()
			}
		}()
	}
	require.Equal(t, int64(1), proxy.Stats().Accepted, "one connection for every subscription")
	time.Sleep(30 * time.Millisecond)
	proxy.Refuse()
	time.Sleep(200 * time.Millisecond)
	proxy.Allow()
	testenv.Eventually(t, 20*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == subs*n
	}, "every message seen")
	testenv.Eventually(t, 20*time.Second, func() bool {
		for _, q := range queues {
			if queueDepth(t, url, q) != 0 {
				return false
			}
		}
		return true
	}, "the redeliveries taken (the acks of the rest are in flight: Close waits for them)")
	returnsWithin(t, 15*time.Second, "Close", func() { require.NoError(t, sub.Close()) })
	wg.Wait()
	for _, q := range queues {
		require.Zero(t, queueDepth(t, url, q), "queue %s", q)
	}
}

// The subscription's context ends while handlers run: their acks, given
// within CloseTimeout, reach the broker before the channel closes; the other
// subscriptions go on.
func TestSubscriberContextEndSettlesInFlight(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-ctx-inflight")
	fill(t, url, queue, "m", 20)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: url, Prefetch: 20, CloseTimeout: 5 * time.Second})
	ctx, cancel := context.WithCancel(testContext(t))
	msgs, err := sub.Subscribe(ctx, queue)
	require.NoError(t, err)
	var got []*message.Message
	for range 20 {
		got = append(got, <-msgs)
	}
	cancel()
	time.Sleep(100 * time.Millisecond)
	for i := len(got) - 1; i >= 0; i-- { // newest first: all held behind the oldest until the end
		got[i].Ack()
	}
	returnsWithin(t, 10*time.Second, "the subscription's end", func() {
		for range msgs {
		}
	})
	require.Zero(t, queueDepth(t, url, queue))
}

// The router closes the Subscriber while handlers still run: the messages
// whose handlers finish within CloseTimeout are acknowledged, the others
// go back; none is lost, none acknowledged before its handler returned.
func TestSubscriberRouterCloseWhileHandlersRun(t *testing.T) {
	url := amqpURL(t)
	queue := uniqueQueue(t, url, "sub-router-close")
	const n = 40
	fill(t, url, queue, "m", n)
	sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: url, Prefetch: 16, CloseTimeout: 5 * time.Second, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	var mu sync.Mutex
	done := map[string]bool{}
	started := make(chan struct{}, n)
	router.AddConsumerHandler("h", queue, sub, func(m *message.Message) error {
		started <- struct{}{}
		time.Sleep(300 * time.Millisecond)
		mu.Lock()
		done[m.UUID] = true
		mu.Unlock()
		return nil
	})
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	for range 16 {
		<-started
	}
	returnsWithin(t, 15*time.Second, "router.Close", func() { require.NoError(t, router.Close()) })
	require.NoError(t, sub.Close())
	mu.Lock()
	handled := len(done)
	mu.Unlock()
	require.GreaterOrEqual(t, handled, 16)
	require.Eventually(t, func() bool { return queueDepth(t, url, queue) == n-handled }, 5*time.Second, 50*time.Millisecond,
		"every handled message acknowledged, every other one in the queue")
}
