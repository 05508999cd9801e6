package tests

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

const (
	// concurrentKeys is the number of messages raced, each delivered to
	// both instances.
	concurrentKeys = 20
	// concurrentConsumer is the inbox consumer name both instances share:
	// they are two replicas of one service.
	concurrentConsumer = "concurrent-consumer"
	// overlapTimeout bounds how long the winning handler waits for the
	// other instance's delivery to block on its uncommitted claim.
	overlapTimeout = 10 * time.Second
)

// backendPID returns the PostgreSQL backend pid of the middleware's
// transaction in ctx.
func backendPID(ctx context.Context) (int64, error) {
	var pid int64
	err := testenv.QueryRow(ctx, `SELECT pg_backend_pid()`, nil, &pid)
	return pid, err
}

// waitUntilBlocking waits until some other backend is blocked by the
// transaction of backend pid (pg_blocking_pids): here, the other instance's
// claim of the same key waiting on the unique index for this transaction to
// end. It polls every 2ms, for at most timeout.
func waitUntilBlocking(ctx context.Context, db wsql.ContextExecutor, pid int64, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var n int64
		err := seam.QueryRow(ctx, db, `SELECT count(*) FROM pg_stat_activity WHERE $1::int4 = ANY(pg_blocking_pids(pid))`,
			[]any{pid}, &n)
		if err != nil {
			return err
		}
		if n > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no concurrent delivery blocked on this claim within %s", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// keyTimes records a time per message key; safe for concurrent use.
type keyTimes struct {
	mu sync.Mutex
	m  map[string]time.Time
}

func (k *keyTimes) Set(key string, at time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m == nil {
		k.m = map[string]time.Time{}
	}
	k.m[key] = at
}

func (k *keyTimes) Get(key string) (time.Time, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	at, ok := k.m[key]
	return at, ok
}

// TestConcurrentInstances: two service instances (two routers, each with
// its own subscriber on its own queue, sharing the consumer name and the
// database) receive the same message at the same moment, for 20 messages.
// The handler of the instance that claims first holds its transaction open
// until the other instance's claim is observed blocked on it in PostgreSQL,
// so every race really overlaps. Each message runs the handler once, writes
// one effect and one output, both deliveries are acked, and the duplicate is
// acked only after the winner's effects were committed.
func TestConcurrentInstances(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		d := e.Driver
		inB := testenv.Queue(t, "inb_")

		var runs, winsBy runCounter
		var handlerEnd keyTimes // winner's handler returned (before its commit)
		var dupAt keyTimes      // duplicate's OnEvent (before its ack)
		var processedAt keyTimes
		var visibleAtDup sync.Map // key -> effect rows committed when the duplicate was settled
		onEvent := func(ev exactlyonce.Event) {
			e.Log.Observe(ev)
			switch ev.Outcome {
			case exactlyonce.Processed:
				processedAt.Set(ev.Key, time.Now())
			case exactlyonce.Duplicate:
				at := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
				defer cancel()
				var n int64
				if err := seam.QueryRow(ctx, d.DB, `SELECT count(*) FROM `+e.Effects.Name+` WHERE msg_key = $1`, []any{ev.Key}, &n); err != nil {
					t.Errorf("counting effects of %s: %v", ev.Key, err)
				}
				visibleAtDup.Store(ev.Key, n)
				dupAt.Set(ev.Key, at)
			}
		}
		handler := func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			attempt := runs.Next(msg.UUID)
			if err := e.Effects.Insert(ctx, msg.UUID, attempt); err != nil {
				return nil, err
			}
			pid, err := backendPID(ctx)
			if err != nil {
				return nil, err
			}
			if err := waitUntilBlocking(ctx, d.DB, pid, overlapTimeout); err != nil {
				return nil, err
			}
			handlerEnd.Set(msg.UUID, time.Now())
			winsBy.Next(message.HandlerNameFromCtx(ctx))
			return []*message.Message{message.NewMessage(outputUUID(msg.UUID, attempt), []byte(`{}`))}, nil
		}

		var routers []*message.Router
		deliveries := make([]*deliveryLog, 2)
		for i, in := range []string{e.In, inB} {
			eo := newMiddleware(t, exactlyonce.Config{DB: e.DB, Consumer: concurrentConsumer, OnEvent: onEvent})
			deliveries[i] = &deliveryLog{}
			r := newRouter(t)
			r.AddMiddleware(deliveries[i].Middleware, eo.Middleware)
			addHandler(t, r, fmt.Sprintf("instance-%d", i), in, e.Out, handler)
			testenv.StartRouter(t, r)
			routers = append(routers, r)
		}

		// One race per key: both instances are idle (the previous key
		// is settled on both) when the key is published to both queues
		// at once, so either may win.
		pub := e.Pub
		keys := make([]string, concurrentKeys)
		for i := range keys {
			waitSettled(t, e.Log, int64(2*i))
			keys[i] = watermill.NewUUID()
			var wg sync.WaitGroup
			for _, q := range []string{e.In, inB} {
				wg.Go(func() {
					if err := pub.Publish(q, message.NewMessage(keys[i], []byte(`{}`))); err != nil {
						t.Errorf("publishing %s to %s: %v", keys[i], q, err)
					}
				})
			}
			wg.Wait()
		}

		waitSettled(t, e.Log, 2*concurrentKeys)
		for _, r := range routers {
			closeRouter(t, r)
		}
		requireQueueDrained(t, e.In)
		requireQueueDrained(t, inB)

		for i := range deliveries {
			require.Equal(t, int64(concurrentKeys), deliveries[i].Total(), "deliveries to instance %d", i)
		}
		require.Equal(t, int64(concurrentKeys), e.Log.Processed.Load(), "processed")
		require.Equal(t, int64(concurrentKeys), e.Log.Duplicates.Load(), "duplicates")
		require.Zero(t, e.Log.Failed.Load()+e.Log.ClaimFailed.Load()+e.Log.Rejected.Load()+e.Log.DBUnavailable.Load()+e.Log.FailOpen.Load(),
			"no delivery may fail")
		require.Equal(t, int64(concurrentKeys), e.Effects.Count(t, ""), "effect rows")

		var gaps []time.Duration
		for _, key := range keys {
			require.Equal(t, 1, runs.Get(key), "handler runs of %s", key)
			require.Equal(t, []int{1}, e.Effects.Attempts(t, key), "effects of %s", key)
			rec := inboxRecord(t, e.DB, concurrentConsumer, key)
			require.Equal(t, int64(1), rec.Duplicates, "inbox duplicates of %s", key)

			// The duplicate was settled (and so acked) only once the
			// winner's effect was committed and visible to others.
			visible, ok := visibleAtDup.Load(key)
			require.True(t, ok, "no duplicate event for %s", key)
			require.Equal(t, int64(1), visible, "effects of %s committed when its duplicate was acked", key)
			end, ok := handlerEnd.Get(key)
			require.True(t, ok)
			dup, ok := dupAt.Get(key)
			require.True(t, ok)
			require.False(t, dup.Before(end), "duplicate of %s acked before the winner's handler returned", key)
			processed, ok := processedAt.Get(key)
			require.True(t, ok)
			gaps = append(gaps, dup.Sub(processed))
		}
		sort.Slice(gaps, func(i, j int) bool { return gaps[i] < gaps[j] })
		t.Logf("wins: instance-0 %d, instance-1 %d; duplicate event minus processed event: min %s, median %s, max %s",
			winsBy.Get("instance-0"), winsBy.Get("instance-1"), gaps[0], gaps[len(gaps)/2], gaps[len(gaps)-1])

		rows := outboxRows(t, e.DB)
		require.Len(t, rows, concurrentKeys, "outbox rows")
		want := make([]string, 0, concurrentKeys)
		for _, key := range keys {
			want = append(want, outputUUID(key, 1))
		}
		var got []string
		for _, row := range rows {
			require.Equal(t, e.Out, row.Topic)
			got = append(got, row.UUID)
		}
		require.ElementsMatch(t, want, got, "outbox UUIDs")

		c := collect(t, e.Out)
		require.Equal(t, concurrentKeys, relayOutbox(t, e.DB), "relayed messages")
		c.WaitFor(t, concurrentKeys)
		c.Stop(t)
		require.ElementsMatch(t, want, c.UUIDs(), "messages received downstream")
		requireQueueDrained(t, e.Out)
	})
}
