package exactlyonce_test

// Two exactly-once middlewares on one delivery: the quick start adds the
// middleware router-wide, and a handler that then gets a middleware of
// its own (another mode) is wrapped twice. The inner one must refuse the
// delivery, loudly, before it claims anything.

import (
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// eoModes are the middleware's three modes, as Config changes.
var eoModes = []struct {
	name string
	set  func(*exactlyonce.Config)
}{
	{"transactional", func(*exactlyonce.Config) {}},
	{"group-commit", func(c *exactlyonce.Config) { c.Batch = &exactlyonce.BatchConfig{MaxSize: 8} }},
	{"lease", func(c *exactlyonce.Config) { c.Lease = &exactlyonce.LeaseConfig{} }},
}

// errorRecorder is a router middleware that records the error every
// delivery ends with (what the router gets) and nacks the first nacks
// deliveries that fail, acking the ones after (so that a test ends).
type errorRecorder struct {
	mu    sync.Mutex
	errs  []error
	nacks int
	got   chan struct{} // one send per delivery
}

func newErrorRecorder(nacks int) *errorRecorder {
	return &errorRecorder{nacks: nacks, got: make(chan struct{}, 100)}
}

func (r *errorRecorder) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		r.mu.Lock()
		r.errs = append(r.errs, err)
		n := len(r.errs)
		r.mu.Unlock()
		r.got <- struct{}{}
		if err != nil && n > r.nacks {
			return nil, nil // acked: the test has seen enough
		}
		return out, err
	}
}

// await waits for n deliveries to end and returns their errors.
func (r *errorRecorder) await(t *testing.T, n int) []error {
	t.Helper()
	for i := range n {
		select {
		case <-r.got:
		case <-time.After(30 * time.Second):
			t.Fatalf("delivery %d did not end within 30s: the two middlewares wait on each other", i+1)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.errs...)
}

// TestNestedMiddlewareRefused: the middleware router-wide, and another one
// (each mode) on one handler: every delivery fails with
// ErrNestedMiddleware, which says what happened and what to do, logged at
// ERROR by the middleware each time (and not again by the router through
// RouterLogger); the handler never runs and nothing is claimed. Nacked,
// the message comes back and fails the same way.
// Before: the inner claim waited for the outer one's uncommitted row (a
// hang), or, in lease mode, was refused as "another worker holds the
// lease" at DEBUG on every redelivery (a silent livelock).
func TestNestedMiddlewareRefused(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t)
	for _, outer := range eoModes {
		for _, inner := range eoModes {
			t.Run(outer.name+"/"+inner.name, func(t *testing.T) {
				t.Parallel()
				var log fh2Log
				newEO := func(set func(*exactlyonce.Config)) *exactlyonce.Guard {
					cfg := exactlyonce.Config{DB: db, Logger: &log, NackDelay: 20 * time.Millisecond}
					set(&cfg)
					eo, err := exactlyonce.New(cfg)
					require.NoError(t, err)
					return eo
				}
				ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
				t.Cleanup(func() { _ = ps.Close() })
				r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, exactlyonce.RouterLogger(&log))
				require.NoError(t, err)
				rec := newErrorRecorder(2)
				r.AddMiddleware(rec.Middleware)
				r.AddMiddleware(newEO(outer.set).Middleware) // the quick start's
				name := "nested-" + outer.name + "-" + inner.name
				var runs atomic.Int64
				h := r.AddConsumerHandler(name, "topic-"+name, ps, func(*message.Message) error {
					runs.Add(1)
					return nil
				})
				h.AddMiddleware(newEO(inner.set).Middleware) // the handler's own
				testenv.StartRouter(t, r)

				require.NoError(t, ps.Publish("topic-"+name, message.NewMessage("m-"+name, nil)))
				errs := rec.await(t, 3) // nacked twice, redelivered
				for i, err := range errs {
					require.ErrorIs(t, err, exactlyonce.ErrNestedMiddleware, "delivery %d", i+1)
					require.ErrorContains(t, err, name, "the error names the handler")
					require.ErrorContains(t, err, "AddMiddleware", "the error says what to do")
					require.True(t, exactlyonce.IsPermanent(err), "no redelivery can fix the wiring")
				}
				require.NoError(t, r.Close())
				require.Zero(t, runs.Load(), "the handler never ran")
				require.Equal(t, 3, log.count("ERROR", "two exactly-once middlewares"), "logged at ERROR, each time")
				if n := log.count("ERROR", "Handler returned error"); n > 0 {
					log.dump(t, "ERROR")
					t.Fatalf("the router logged the reported error again at ERROR (%d)", n)
				}
				require.Zero(t, testenv.Count(t, db.Conn, "SELECT count(*) FROM "+db.Inbox()+" WHERE message_key = $1 AND status = 'done'", "m-"+name),
					"nothing recorded done")
			})
		}
	}
}

// TestNestedRetryOutside: Watermill's Retry outside the middleware (the
// usual place) calls it again with the same *message.Message. The mark of
// the first attempt must not be left on it: a handler that fails once and
// then succeeds is processed, once, in every mode.
func TestNestedRetryOutside(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t)
	for _, mode := range eoModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			effects := pgx.Identifier{db.Schema, "effects_" + strings.ReplaceAll(mode.name, "-", "_")}.Sanitize()
			_, err := db.Conn.ExecContext(t.Context(), "CREATE TABLE "+effects+" (id text NOT NULL)")
			require.NoError(t, err)
			var ev eventLog
			cfg := exactlyonce.Config{DB: db, Logger: testenv.Logger(t), NackDelay: -1, OnEvent: ev.observe}
			mode.set(&cfg)
			eo, err := exactlyonce.New(cfg)
			require.NoError(t, err)
			ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
			t.Cleanup(func() { _ = ps.Close() })
			r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, testenv.Logger(t))
			require.NoError(t, err)
			rec := newErrorRecorder(0)
			r.AddMiddleware(rec.Middleware, wmiddleware.Retry{MaxRetries: 3}.Middleware, eo.Middleware)
			var calls atomic.Int64
			name := "retry-" + mode.name
			r.AddConsumerHandler(name, "topic-"+name, ps, func(msg *message.Message) error {
				if calls.Add(1) == 1 {
					return errors.New("fails once")
				}
				return testenv.Exec(msg.Context(), "INSERT INTO "+effects+" (id) VALUES ($1)", msg.UUID)
			})
			testenv.StartRouter(t, r)

			require.NoError(t, ps.Publish("topic-"+name, message.NewMessage("r-"+mode.name, nil)))
			errs := rec.await(t, 1)
			require.NoError(t, errs[0], "Retry's second attempt succeeded")
			require.Equal(t, int64(2), calls.Load(), "the handler ran twice: failed, then succeeded")
			outcomes := ev.outcomes("r-" + mode.name)
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Nacked, exactlyonce.Processed}, outcomes)
			for _, e := range ev.of("r-" + mode.name) {
				require.NotErrorIs(t, e.Err, exactlyonce.ErrNestedMiddleware)
			}
			require.Equal(t, int64(1), testenv.Count(t, db.Conn, "SELECT count(*) FROM "+effects), "one effect")
			require.Equal(t, int64(1), testenv.Count(t, db.Conn, "SELECT count(*) FROM "+db.Inbox()+" WHERE message_key = $1 AND status = 'done'", "r-"+mode.name))
		})
	}
}
