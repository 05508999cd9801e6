package exactlyonce_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

func (p *capturePublisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.msgs)
}

// The commit of a handler's outputs wakes a listening relay whatever the
// other deliveries' transactions do. The writers' NOTIFY debounce used to
// be taken at the outbox INSERT: a delivery that wrote its outbox row and
// then went on (an external call) or failed held it, and the deliveries
// that committed in the next 10 ms sent no NOTIFY of their own: their rows
// waited for that transaction's commit, or, when it rolled back, for
// PollInterval. The middleware owns the commit, so it decides the NOTIFY
// right before it.
func TestOutputsWakeTheRelayWhateverOtherTransactionsDo(t *testing.T) {
	t.Parallel()
	tables := testenv.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	pub := &capturePublisher{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: tables, Publisher: pub, PollInterval: time.Hour, Logger: testenv.Logger(t),
		ListenConnString: testenv.ListenConnString()})
	require.NoError(t, err)
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	defer func() { stopRelay(); require.NoError(t, <-relayDone) }()
	testenv.Eventually(t, 10*time.Second, func() bool { return relay.Stats().Listening }, "the relay never listened")

	wrote := make(chan struct{})
	release := make(chan error)
	proceed := make(chan struct{})
	var finished sync.WaitGroup
	defer func() {
		// A failed assertion must not leave a delivery waiting with its
		// transaction open (the schema's cleanup would wait for it).
		close(proceed)
		close(release)
		finished.Wait()
	}()
	eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, Consumer: "c", PublishTopic: "out", Logger: testenv.Logger(t)})
	require.NoError(t, err)
	h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get("hold") == "" {
			<-proceed // right after the other delivery's outbox write
			return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
		}
		ob, err := exactlyonce.OutboxFromContext(msg.Context())
		if err != nil {
			return nil, err
		}
		if err := ob.Publish("out", message.NewMessage("out-"+msg.UUID, nil)); err != nil {
			return nil, err
		}
		select {
		case wrote <- struct{}{}:
		case err := <-release:
			return nil, err
		}
		return nil, <-release // an external call, then success or failure
	})
	run := func(uuid string, hold bool) <-chan error {
		m := message.NewMessage(uuid, nil)
		if hold {
			m.Metadata.Set("hold", "1")
		}
		done := make(chan error, 1)
		finished.Add(1)
		go func() { defer finished.Done(); _, err := h(m); done <- err }()
		return done
	}
	relayedWithin := func(n int, d time.Duration, what string) {
		t.Helper()
		testenv.Eventually(t, d, func() bool { return pub.count() >= n }, "%s: %d of %d outputs relayed within %s", what, pub.count(), n, d)
	}

	// A delivery commits its output while another, which wrote its
	// outbox row just before, is still running.
	time.Sleep(20 * time.Millisecond) // past the debounce of the relay's start
	fast := run("fast1", false)
	slow := run("slow", true)
	<-wrote
	proceed <- struct{}{}
	require.NoError(t, <-fast)
	relayedWithin(1, time.Second, "while another delivery's transaction is open")
	release <- nil
	require.NoError(t, <-slow)
	relayedWithin(2, time.Second, "the slow delivery")

	// The same, and the other delivery fails (its transaction rolls back).
	time.Sleep(20 * time.Millisecond)
	fast = run("fast2", false)
	slow = run("failing", true)
	<-wrote
	proceed <- struct{}{}
	require.NoError(t, <-fast)
	release <- errors.New("the external call failed")
	require.Error(t, <-slow)
	relayedWithin(3, time.Second, "after another delivery's transaction rolled back")
}

// In every mode the commit of a delivery's outputs wakes a listening relay
// (the NOTIFY goes out right before the commit), a second delivery's too
// (past the debounce), and one right after it (within the debounce: the
// relay's catch-up finds it).
func TestOutputsWakeTheRelayInEveryMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []struct {
		name string
		cfg  func(*exactlyonce.Config)
	}{
		{"transactional", func(*exactlyonce.Config) {}},
		{"group commit", func(c *exactlyonce.Config) { c.Batch = &exactlyonce.BatchConfig{} }},
		{"lease", func(c *exactlyonce.Config) { c.Lease = &exactlyonce.LeaseConfig{} }},
	} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			tables := testenv.Schema(t)
			ctx, cancel := context.WithCancel(context.Background())
			pub := &capturePublisher{}
			relay, err := outbox.NewRelay(outbox.RelayConfig{DB: tables, Publisher: pub, PollInterval: time.Hour, Logger: testenv.Logger(t),
				ListenConnString: testenv.ListenConnString()})
			require.NoError(t, err)
			relayDone := make(chan error, 1)
			go func() { relayDone <- relay.Run(ctx) }()
			defer func() { cancel(); require.NoError(t, <-relayDone) }()
			testenv.Eventually(t, 10*time.Second, func() bool { return relay.Stats().Listening }, "the relay never listened")

			cfg := exactlyonce.Config{DB: tables, Consumer: "c", PublishTopic: "out", Logger: testenv.Logger(t)}
			mode.cfg(&cfg)
			eo, err := exactlyonce.New(cfg)
			require.NoError(t, err)
			h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
			})
			for i, id := range []string{"m1", "m2", "m3"} {
				if i == 1 {
					time.Sleep(20 * time.Millisecond)
				}
				_, err := h(message.NewMessage(id, nil))
				require.NoError(t, err)
				testenv.Eventually(t, time.Second, func() bool { return pub.count() == i+1 }, "%s: %d of %d outputs relayed", id, pub.count(), i+1)
			}
		})
	}
}
