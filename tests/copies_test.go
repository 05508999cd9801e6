package tests

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// gate lets n handler runs in and holds them until all n are in flight at
// the same moment, so that a test knows they overlapped.
type gate struct {
	n       int
	mu      sync.Mutex
	entered int
	all     chan struct{}
	max     atomic.Int64
	now     atomic.Int64
}

func newGate(n int) *gate { return &gate{n: n, all: make(chan struct{})} }

func (g *gate) enter(t testing.TB) {
	cur := g.now.Add(1)
	for {
		m := g.max.Load()
		if cur <= m || g.max.CompareAndSwap(m, cur) {
			break
		}
	}
	g.mu.Lock()
	g.entered++
	if g.entered == g.n {
		close(g.all)
	}
	g.mu.Unlock()
	select {
	case <-g.all:
	case <-time.After(waitTimeout):
		t.Errorf("only %d of %d handler runs were in flight at once", g.entered, g.n)
	}
}

func (g *gate) leave() { g.now.Add(-1) }

// logCapture is a Watermill logger that records error-level messages.
type logCapture struct {
	watermill.NopLogger
	mu     sync.Mutex
	errors []string
}

func (l *logCapture) Error(msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errors = append(l.errors, fmt.Sprintf("%s: %v %v", msg, err, fields))
}

func (l *logCapture) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *logCapture) Errors() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.errors...)
}

// TestHandlerCopiesVersusConcurrentSubscriber shows why one handler must not
// be registered several times for concurrency, and what to do instead. Two
// copies of one message are in flight at the same moment:
//
//   - on two copies of the handler ("send-1", "send-2", each its own
//     default consumer name), both run: two effects, and the middleware logs
//     a warning naming the topic;
//   - on one handler registered with exactlyonce.ConcurrentSubscriber(sub, 2),
//     both are in flight in the one handler, under one consumer name: the
//     second waits for the first's claim and acks as a duplicate. One effect.
func TestHandlerCopiesVersusConcurrentSubscriber(t *testing.T) {
	t.Parallel()
	d := testenv.DriverNamed(t, "pgxpool")

	t.Run("copies", func(t *testing.T) {
		e := setupE2E(t, d)
		var log logCapture
		eo := e.Middleware(t, exactlyonce.Config{Logger: &log})
		g := newGate(2)
		r := newRouter(t)
		r.AddMiddleware(eo.Middleware)
		for _, name := range []string{"send-1", "send-2"} {
			r.AddConsumerHandler(name, e.In, testenv.AMQPSubscriber(t, 1), func(msg *message.Message) error {
				g.enter(t)
				defer g.leave()
				return e.Effects.Insert(msg.Context(), msg.UUID, 1)
			})
		}
		testenv.StartRouter(t, r)
		waitConsumers(t, e.Conn, e.In, 2)
		publishCopies(t, e.Pub, e.In, "m-1", []byte(`{}`), 2)
		waitSettled(t, e.Log, 2)
		closeRouter(t, r)

		require.Equal(t, int64(2), e.Effects.Count(t, "m-1"), "each copy has its own consumer name: the message took effect twice")
		var warned []string
		for _, l := range log.Errors() {
			if strings.Contains(l, "different consumers") {
				warned = append(warned, l)
			}
		}
		require.Len(t, warned, 1, "one warning for the topic: %v", log.Errors())
		require.Contains(t, warned[0], e.In)
		require.Contains(t, warned[0], "ConcurrentSubscriber")
	})

	t.Run("ConcurrentSubscriber", func(t *testing.T) {
		e := setupE2E(t, d)
		var log logCapture
		eo := e.Middleware(t, exactlyonce.Config{Logger: &log})
		var runs atomic.Int64
		r := newRouter(t)
		r.AddMiddleware(eo.Middleware)
		r.AddConsumerHandler("send", e.In, exactlyonce.ConcurrentSubscriber(testenv.AMQPSubscriber(t, 1), 2), func(msg *message.Message) error {
			runs.Add(1)
			return e.Effects.Insert(msg.Context(), msg.UUID, 1)
		})
		testenv.StartRouter(t, r)
		waitConsumers(t, e.Conn, e.In, 2)
		publishCopies(t, e.Pub, e.In, "m-1", []byte(`{}`), 2)
		waitSettled(t, e.Log, 2)
		closeRouter(t, r)
		requireQueueDrained(t, e.In)

		require.Equal(t, int64(1), e.Effects.Count(t, "m-1"), "one handler, one consumer name: one effect")
		require.Equal(t, int64(1), runs.Load())
		require.Equal(t, int64(1), e.Count(t, `SELECT count(*) FROM `+e.DB.Inbox()+` WHERE consumer = 'send'`))
		require.Empty(t, log.Errors())
	})

	t.Run("ConcurrentSubscriber runs n at once", func(t *testing.T) {
		e := setupE2E(t, d)
		eo := e.Middleware(t, exactlyonce.Config{})
		const n = 4
		g := newGate(n)
		r := newRouter(t)
		r.AddMiddleware(eo.Middleware)
		r.AddConsumerHandler("send", e.In, exactlyonce.ConcurrentSubscriber(testenv.AMQPSubscriber(t, 1), n), func(msg *message.Message) error {
			g.enter(t)
			defer g.leave()
			return e.Effects.Insert(msg.Context(), msg.UUID, 1)
		})
		testenv.StartRouter(t, r)
		waitConsumers(t, e.Conn, e.In, n)
		for i := range 3 * n {
			require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(watermill.NewUUID(), []byte{byte('a' + i)})))
		}
		waitSettled(t, e.Log, 3*n)
		closeRouter(t, r)
		require.Equal(t, int64(n), g.max.Load(), "the one handler had n deliveries in flight at once")
		require.Equal(t, int64(3*n), e.Effects.Count(t, ""))
	})
}
