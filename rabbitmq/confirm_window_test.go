package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

// fakeConfirm is a pending confirm the test settles.
type fakeConfirm struct {
	done  chan struct{}
	acked bool // written before done is closed
}

func (f *fakeConfirm) Done() <-chan struct{} { return f.done }
func (f *fakeConfirm) Acked() bool           { return f.acked }

// fakeChannel is a channel in confirm mode whose broker is the test: each
// publish is recorded with a pending confirm, which the test acks, nacks,
// returns or leaves; closing the channel settles every pending confirm
// unacked, as amqp091-go does.
type fakeChannel struct {
	frameMax   int
	publishErr func(n int) error // the error of the n-th publish (from 0), nil: sent

	closed, connClosed, blocked atomic.Bool

	mu        sync.Mutex
	pubs      []amqp091.Publishing
	keys      []string
	confirms  []*fakeConfirm
	returns   []amqp091.Return
	published chan int // the index of each publish, when not nil
}

func (f *fakeChannel) Publish(_ context.Context, key string, pub amqp091.Publishing) (confirmation, error) {
	f.mu.Lock()
	n := len(f.pubs)
	f.mu.Unlock()
	if f.publishErr != nil {
		if err := f.publishErr(n); err != nil {
			f.mu.Lock()
			f.pubs = append(f.pubs, amqp091.Publishing{}) // the attempt counts
			f.keys = append(f.keys, key)
			f.confirms = append(f.confirms, nil)
			f.mu.Unlock()
			return nil, err
		}
	}
	c := &fakeConfirm{done: make(chan struct{})}
	f.mu.Lock()
	f.pubs = append(f.pubs, pub)
	f.keys = append(f.keys, key)
	f.confirms = append(f.confirms, c)
	ch := f.published
	f.mu.Unlock()
	if ch != nil {
		ch <- n
	}
	return c, nil
}

func (f *fakeChannel) Returned() []amqp091.Return {
	f.mu.Lock()
	defer f.mu.Unlock()
	got := f.returns
	f.returns = nil
	return got
}

func (f *fakeChannel) Closed() bool     { return f.closed.Load() }
func (f *fakeChannel) ConnClosed() bool { return f.connClosed.Load() }
func (f *fakeChannel) Blocked() bool    { return f.blocked.Load() }
func (f *fakeChannel) FrameMax() int    { return f.frameMax }

func (f *fakeChannel) confirm(n int) *fakeConfirm {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.confirms[n]
}

// ack confirms the publishes ns (several at once: a basic.ack multiple).
func (f *fakeChannel) ack(ns ...int) {
	for _, n := range ns {
		c := f.confirm(n)
		c.acked = true
		close(c.done)
	}
}

// nack refuses the publish n (basic.nack).
func (f *fakeChannel) nack(n int) { close(f.confirm(n).done) }

// ret returns the publish n (basic.return, with its properties: its
// PublishingHeader unless stripped), then acks it, in the broker's order.
func (f *fakeChannel) ret(n int, stripped bool) {
	f.mu.Lock()
	pub := f.pubs[n]
	headers := pub.Headers
	if stripped {
		headers = amqp091.Table{}
	}
	f.returns = append(f.returns, amqp091.Return{ReplyCode: amqp091.NoRoute, ReplyText: "NO_ROUTE", RoutingKey: f.keys[n], Headers: headers})
	f.mu.Unlock()
	f.ack(n)
}

// close closes the channel: the pending confirms are settled unacked.
func (f *fakeChannel) close() {
	f.closed.Store(true)
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.confirms {
		if c == nil {
			continue
		}
		select {
		case <-c.done:
		default:
			close(c.done)
		}
	}
}

func (f *fakeChannel) publishes() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.pubs)
}

// testOutcomes are n messages, to topic "t" unless topics says otherwise,
// stamped as Publisher stamps them.
func testOutcomes(n int, topics ...string) (*outcomes, []int) {
	b := &outcomes{errs: make([]error, n), settled: make([]bool, n)}
	idx := make([]int, n)
	for i := range n {
		topic := "t"
		if i < len(topics) {
			topic = topics[i]
		}
		b.topics = append(b.topics, topic)
		b.msgs = append(b.msgs, message.NewMessage(fmt.Sprintf("m%d", i), nil))
		b.pubs = append(b.pubs, amqp091.Publishing{Headers: amqp091.Table{PublishingHeader: fmt.Sprintf("stamp-%d", i)}})
		idx[i] = i
	}
	return b, idx
}

// outcome names what became of message i: ok, lost, unsent (no outcome,
// in the result), or its error's kind, "permanent:" first when marked so.
func outcome(b *outcomes, r runResult, i int) string {
	for _, l := range r.lost {
		if l == i {
			return "lost"
		}
	}
	for _, u := range r.unsent {
		if u == i {
			if b.settled[i] {
				return "unsent+" + kind(b.errs[i])
			}
			return "unsent"
		}
	}
	if !b.settled[i] {
		return "none"
	}
	return kind(b.errs[i])
}

func kind(err error) string {
	if err == nil {
		return "ok"
	}
	var p interface{ Permanent() bool }
	prefix := ""
	if errors.As(err, &p) && p.Permanent() {
		prefix = "permanent:"
	}
	for _, k := range []string{"nacked", "returned", "cannot be sent", "publishing", "context ended"} {
		if strings.Contains(err.Error(), k) {
			return prefix + k
		}
	}
	return prefix + err.Error()
}

// TestConfirmWindow runs the confirm window against a fake channel whose
// broker acks, nacks, returns and closes as each row scripts it, after each
// publish (in the publishing goroutine: a broker that answers at once), and
// checks each message's outcome and what the window left to its caller.
func TestConfirmWindow(t *testing.T) {
	t.Parallel()
	errRefused := errors.New("table field \"x\" value 1i not supported")
	for _, tc := range []struct {
		name      string
		size, n   int
		topics    []string
		frameMax  int
		huge      int // a message (from 1) with headers too large for frameMax, 0: none
		timeout   time.Duration
		before    func(f *fakeChannel)
		pubErr    func(n int) error
		afterEach func(f *fakeChannel, n int) // after the n-th publish
		want      []string
		wantPubs  int
		check     func(t *testing.T, r runResult)
	}{{
		name: "confirms in order", size: 2, n: 5,
		afterEach: func(f *fakeChannel, n int) { f.ack(n) },
		want:      []string{"ok", "ok", "ok", "ok", "ok"}, wantPubs: 5,
	}, {
		name: "confirms out of order and a multiple ack", size: 4, n: 4,
		afterEach: func(f *fakeChannel, n int) {
			if n == 3 {
				f.ack(3)
				f.ack(1)
				f.ack(0, 2) // basic.ack multiple up to 2: 0 and 2 (1 is done)
			}
		},
		want: []string{"ok", "ok", "ok", "ok"}, wantPubs: 4,
	}, {
		name: "one nacked: only it fails, not permanent", size: 3, n: 3,
		afterEach: func(f *fakeChannel, n int) {
			if n == 1 {
				f.nack(1)
			} else {
				f.ack(n)
			}
		},
		want: []string{"ok", "nacked", "ok"}, wantPubs: 3,
		check: func(t *testing.T, r runResult) { require.True(t, r.nacked, "the channel is not to be reused") },
	}, {
		name: "one returned unroutable: only it fails, not permanent", size: 3, n: 3, topics: []string{"a", "b", "a"},
		afterEach: func(f *fakeChannel, n int) {
			if n == 1 {
				f.ret(1, false)
			} else {
				f.ack(n)
			}
		},
		want: []string{"ok", "returned", "ok"}, wantPubs: 3,
		check: func(t *testing.T, r runResult) { require.Equal(t, []string{"b"}, r.noRoute) },
	}, {
		name: "a return without the stamp fails every acked message to its routing key", size: 3, n: 3, topics: []string{"a", "b", "a"},
		afterEach: func(f *fakeChannel, n int) {
			if n == 2 {
				f.ret(2, true)
			} else {
				f.ack(n)
			}
		},
		want: []string{"returned", "ok", "returned"}, wantPubs: 3,
	}, {
		name: "the channel closes mid-window: those in flight lost, the rest unsent", size: 4, n: 5,
		afterEach: func(f *fakeChannel, n int) {
			switch n {
			case 1:
				f.ack(0)
			case 2:
				f.close()
			}
		},
		want: []string{"ok", "lost", "lost", "unsent", "unsent"}, wantPubs: 3,
	}, {
		name: "a publish on a channel that went: it and the rest unsent", size: 4, n: 4,
		pubErr: func(n int) error {
			if n == 2 {
				return amqp091.ErrClosed
			}
			return nil
		},
		afterEach: func(f *fakeChannel, n int) { f.ack(n) },
		want:      []string{"ok", "ok", "unsent", "unsent"}, wantPubs: 3,
	}, {
		name: "a publishing the client refuses fails alone, permanently", size: 4, n: 3,
		pubErr: func(n int) error {
			if n == 1 {
				return errRefused
			}
			return nil
		},
		afterEach: func(f *fakeChannel, n int) { f.ack(n) },
		want:      []string{"ok", "permanent:publishing", "ok"}, wantPubs: 3,
	}, {
		name: "headers over the frame size: that message fails permanently, unsent", size: 2, n: 3, frameMax: 4096, huge: 2,
		afterEach: func(f *fakeChannel, n int) { f.ack(n) },
		want:      []string{"ok", "permanent:cannot be sent", "ok"}, wantPubs: 2,
	}, {
		name: "the connection blocked: nothing published", size: 2, n: 2,
		before: func(f *fakeChannel) { f.blocked.Store(true) },
		want:   []string{"unsent", "unsent"}, wantPubs: 0,
		check: func(t *testing.T, r runResult) { require.True(t, r.blocked) },
	}, {
		name: "no confirm within the timeout: those in flight lost, the rest unsent", size: 2, n: 4, timeout: 50 * time.Millisecond,
		afterEach: func(f *fakeChannel, n int) {
			if n == 0 {
				f.ack(0)
			}
		},
		want: []string{"ok", "lost", "lost", "unsent"}, wantPubs: 3,
		check: func(t *testing.T, r runResult) {
			require.ErrorContains(t, r.timeout, "no confirm for message \"m1\"")
			require.NotErrorIs(t, r.timeout, context.Canceled)
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := &fakeChannel{frameMax: tc.frameMax, publishErr: tc.pubErr}
			if tc.before != nil {
				tc.before(f)
			}
			b, idx := testOutcomes(tc.n, tc.topics...)
			if tc.huge > 0 {
				b.pubs[tc.huge-1].Headers["big"] = strings.Repeat("x", 2*tc.frameMax)
			}
			ch := confirmChannel(f)
			if tc.afterEach != nil {
				ch = scripted{f, tc.afterEach}
			}
			timeout := tc.timeout
			if timeout == 0 {
				timeout = time.Minute
			}
			r := runWindow(context.Background(), ch, b, idx, tc.size, timeout)
			got := make([]string, tc.n)
			for i := range got {
				got[i] = outcome(b, r, i)
			}
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.wantPubs, f.publishes(), "publishes")
			require.NoError(t, r.ctxErr)
			if tc.check != nil {
				tc.check(t, r)
			}
		})
	}
}

// scripted is a fake channel that runs a script after each publish.
type scripted struct {
	*fakeChannel
	after func(f *fakeChannel, n int)
}

func (s scripted) Publish(ctx context.Context, key string, pub amqp091.Publishing) (confirmation, error) {
	n := s.publishes()
	c, err := s.fakeChannel.Publish(ctx, key, pub)
	if err == nil {
		s.after(s.fakeChannel, n)
	}
	return c, err
}

// TestConfirmWindowFullWaitsForAConfirm: with the window full, the next
// message is published only once the oldest is confirmed.
func TestConfirmWindowFullWaitsForAConfirm(t *testing.T) {
	t.Parallel()
	f := &fakeChannel{published: make(chan int, 8)}
	b, idx := testOutcomes(3)
	done := make(chan runResult, 1)
	go func() { done <- runWindow(context.Background(), f, b, idx, 2, time.Minute) }()
	require.Equal(t, 0, <-f.published)
	require.Equal(t, 1, <-f.published)
	select {
	case n := <-f.published:
		t.Fatalf("publish %d with the window full", n)
	case <-time.After(100 * time.Millisecond):
	}
	f.ack(0)
	require.Equal(t, 2, <-f.published)
	f.ack(1, 2)
	r := <-done
	require.Empty(t, r.lost)
	require.Empty(t, r.unsent)
	require.Equal(t, []error{nil, nil, nil}, b.errs)
}

// TestConfirmWindowContextCancelled: when ctx ends, a message confirmed
// before succeeds, and those in flight and unsent fail with ctx's error
// (not permanent: published again later).
func TestConfirmWindowContextCancelled(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f := &fakeChannel{published: make(chan int, 8)}
	b, idx := testOutcomes(4)
	done := make(chan runResult, 1)
	go func() { done <- runWindow(ctx, f, b, idx, 2, time.Minute) }()
	<-f.published
	<-f.published
	f.ack(0)
	require.Equal(t, 2, <-f.published)
	cancel()
	r := <-done
	require.ErrorIs(t, r.ctxErr, context.Canceled)
	require.Empty(t, r.lost)
	require.Equal(t, 3, f.publishes())
	require.NoError(t, b.errs[0])
	for i, want := range []string{"", "not confirmed before the context ended", "not confirmed before the context ended", "not published, the context ended"} {
		if i == 0 {
			continue
		}
		require.True(t, b.settled[i], "message %d", i)
		require.ErrorIs(t, b.errs[i], context.Canceled)
		require.ErrorContains(t, b.errs[i], want)
		require.Equal(t, "context ended", kind(b.errs[i]), "not permanent")
	}
}
