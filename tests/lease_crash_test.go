package tests

import (
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Lease mode, the one window exactly-once cannot close alone: the worker
// process is killed (SIGKILL, a real subprocess) while its call to the
// external provider is in flight. The claim was committed with a lease; the
// completion never happened; whether the SMS went out is unknown. RabbitMQ
// requeues the unacked delivery. By default (MaxInterruptedAttempts 3) the
// key runs again after the lease expires, with the same idempotency key, and
// completes; with MaxInterruptedAttempts 1 the key is parked and acked, an operator sees it and releases
// it, and the next delivery runs. Nothing is lost either way.

const (
	// leaseCrashConsumer is the consumer name of the worker and of the
	// restarted router: the inbox key is (consumer, message UUID).
	leaseCrashConsumer = "lease-crash-sms"
	// leaseCrashLease is the lease of both; short, so that expiry is quick.
	leaseCrashLease = 2 * time.Second
	// leaseCrashNackDelay paces the restarted router's busy nacks.
	leaseCrashNackDelay = 100 * time.Millisecond

	leaseCrashWorkerTest = "TestLeaseCrashWorkerProcess"

	leaseCrashEnvDriver   = "LEASE_CRASH_DRIVER"
	leaseCrashEnvSchema   = "LEASE_CRASH_SCHEMA"
	leaseCrashEnvIn       = "LEASE_CRASH_IN"
	leaseCrashEnvOut      = "LEASE_CRASH_OUT"
	leaseCrashEnvProvider = "LEASE_CRASH_PROVIDER"
)

// leaseCrashOutputUUID is the UUID of the output message of msgUUID's
// handler run: the same on every attempt, so that a test can name it.
func leaseCrashOutputUUID(msgUUID string) string { return msgUUID + "-sms-sent" }

// leaseCrashHTTPClient is the handler's client to the provider. Keep-alives
// are off so that no idle connection outlives the test (goleak).
func leaseCrashHTTPClient() *http.Client {
	return &http.Client{Timeout: 2 * waitTimeout, Transport: &http.Transport{DisableKeepAlives: true}}
}

// leaseCrashHandler is the SMS handler, the same in the worker and in the
// restarted router: it reports its lease info, sends the SMS with the
// lease's idempotency key, and on success writes the business row (the
// message UUID, the attempt, and a note of its lease info) in the
// completion transaction and returns one output message.
func leaseCrashHandler(effects effectsTable, providerURL string, client *http.Client, onInfo func(exactlyonce.Info)) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		info, err := exactlyonce.InfoFromContext(ctx)
		if err != nil {
			return nil, err
		}
		if info.Attempt == 0 {
			return nil, fmt.Errorf("no lease attempt in the handler's context: not running in lease mode")
		}
		onInfo(info)
		if err := testenv.SendSMS(ctx, client, providerURL, info.IdempotencyKey, "+15550100", "your order "+msg.UUID+" shipped"); err != nil {
			return nil, err
		}
		note := fmt.Sprintf("key=%s attempt=%d interrupted=%t", info.IdempotencyKey, info.Attempt, info.Interrupted)
		if err := effects.InsertNote(ctx, msg.UUID, info.Attempt, note); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(leaseCrashOutputUUID(msg.UUID), []byte(`{"event":"sms-sent"}`))}, nil
	}
}

// TestLeaseCrashWorkerProcess is the worker of TestLeaseCrash, run in a
// subprocess that the parent kills mid-call. It does nothing in a normal
// test run.
func TestLeaseCrashWorkerProcess(t *testing.T) {
	if !isWorker(t.Name()) {
		return
	}
	d := testenv.DriverNamed(t, workerEnv(t, leaseCrashEnvDriver))
	db := sqlschema.DB{Conn: d.DB, Schema: workerEnv(t, leaseCrashEnvSchema)}
	in, out := workerEnv(t, leaseCrashEnvIn), workerEnv(t, leaseCrashEnvOut)
	providerURL := workerEnv(t, leaseCrashEnvProvider)

	eo := newMiddleware(t, exactlyonce.Config{
		DB: db, Lease: &exactlyonce.LeaseConfig{Duration: leaseCrashLease}, Consumer: leaseCrashConsumer,
	})
	client := leaseCrashHTTPClient()
	r := newRouter(t)
	h := r.AddHandler(leaseCrashConsumer, in, testenv.AMQPSubscriber(t, 0), out, outboxOnly(t),
		leaseCrashHandler(effectsOf(db), providerURL, client, func(exactlyonce.Info) {}))
	h.AddMiddleware(eo.Middleware)
	testenv.StartRouter(t, r)

	// The parent kills this process while the provider call hangs.
	select {
	case <-time.After(waitTimeout):
		t.Fatalf("worker: not killed within %s", waitTimeout)
	case <-t.Context().Done():
	}
}

// leaseCrashBundle is one crash scenario for one driver: the e2e bundle,
// and the fake provider.
type leaseCrashBundle struct {
	*e2e
	provider *testenv.Provider
	// inFlight receives the idempotency key of the provider's first call,
	// once the provider holds it; firstCallAborted is closed when that
	// call's client went away.
	inFlight         chan string
	firstCallAborted chan struct{}
	msgUUID          string
	payload          []byte
}

// leaseCrashSetup creates the e2e bundle and the fake provider, whose first
// request hangs until its client goes away and whose later requests succeed.
func leaseCrashSetup(t *testing.T, e *e2e) *leaseCrashBundle {
	t.Helper()
	b := &leaseCrashBundle{
		e2e:     e,
		msgUUID: watermill.NewUUID(),
		payload: []byte(`{"order":42,"phone":"+15550100"}`),
	}
	b.provider, b.inFlight, b.firstCallAborted = leaseCrashProvider(t)
	return b
}

// leaseCrashProvider returns the fake provider of a crash scenario: its
// first request hangs until its client goes away (inFlight receives that
// request's idempotency key; firstCallAborted is closed when the client
// went away), and its later requests succeed.
func leaseCrashProvider(t *testing.T) (provider *testenv.Provider, inFlight chan string, firstCallAborted chan struct{}) {
	t.Helper()
	provider, inFlight, firstCallAborted = testenv.NewProvider(t), make(chan string, 1), make(chan struct{})
	var hung atomic.Bool
	provider.OnRequest = func(r *http.Request, key string, call int) int {
		// Only the very first request hangs (whatever its key, so that a
		// wrong key on a later attempt fails the assertions, not a wait).
		if !hung.CompareAndSwap(false, true) {
			return http.StatusOK
		}
		inFlight <- key
		select {
		case <-r.Context().Done(): // the worker died mid-call
			close(firstCallAborted)
			return http.StatusServiceUnavailable
		case <-time.After(waitTimeout):
			return http.StatusGatewayTimeout
		}
	}
	// Provider's serve reads OnRequest after taking its mutex: this call
	// orders the assignment above before every request (race detector).
	_ = provider.Calls("")
	return provider, inFlight, firstCallAborted
}

// key is the expected idempotency key: "<consumer>:<message UUID>".
func (b *leaseCrashBundle) key() string { return leaseCrashConsumer + ":" + b.msgUUID }

// record returns the inbox record of the message.
func (b *leaseCrashBundle) record(t testing.TB) inbox.Record {
	t.Helper()
	return inboxRecord(t, b.DB, leaseCrashConsumer, b.msgUUID)
}

// killMidCall publishes the message, runs the worker, waits until its SMS
// call is in flight at the provider, and kills it with SIGKILL. It checks
// that the claim committed before the call and that nothing else did.
func (b *leaseCrashBundle) killMidCall(t *testing.T) {
	t.Helper()
	require.NoError(t, b.Pub.Publish(b.In, message.NewMessage(b.msgUUID, b.payload)))
	w := startWorker(t, leaseCrashWorkerTest, map[string]string{
		leaseCrashEnvDriver: b.Driver.Name, leaseCrashEnvSchema: b.DB.Schema,
		leaseCrashEnvIn: b.In, leaseCrashEnvOut: b.Out, leaseCrashEnvProvider: b.provider.URL(),
	})
	select {
	case key := <-b.inFlight:
		require.Equal(t, b.key(), key, "the worker's idempotency key")
	case <-w.exited:
		t.Fatalf("the worker exited before its provider call; output:\n%s", w.Output())
	case <-time.After(waitTimeout):
		t.Fatalf("the worker's provider call did not arrive within %s", waitTimeout)
	}
	rec := b.record(t)
	require.Equal(t, inboxdb.StatusProcessing, rec.Status, "the claim is committed before the provider call")
	require.Equal(t, 1, rec.Attempts)
	require.NotNil(t, rec.LeaseUntil)

	w.KillAndWait(t)
	waitClosed(t, b.firstCallAborted, "the provider to see its client go away")
	rec = b.record(t)
	require.Equal(t, inboxdb.StatusProcessing, rec.Status, "the dead worker recorded nothing after its claim")
	require.Equal(t, 1, rec.Attempts)
	require.Empty(t, rec.LastError)
	require.Equal(t, int64(0), b.Effects.Count(t, ""), "no business row from the dead worker")
	require.Equal(t, int64(0), outboxPending(t, b.DB), "no output from the dead worker")
	require.Equal(t, 0, b.provider.Successes(b.key()))
}

// leaseCrashRun is a router restarted in the test process on the same
// queue, consumer name and lease, with its own event log.
type leaseCrashRun struct {
	r          *message.Router
	log        *eventLog
	deliveries *deliveryLog

	mu    sync.Mutex
	infos []exactlyonce.Info
}

// waitAcked waits until run acked one delivery (processed, parked or
// duplicate); the tests then assert which it was.
func (l *leaseCrashRun) waitAcked(t *testing.T, what string) {
	t.Helper()
	testenv.Eventually(t, waitTimeout, func() bool { return l.log.Acked() >= 1 }, "%s: no delivery acked", what)
	t.Logf("%s: busy %d, processed %d, parked %d, duplicates %d, failed %d", what, l.log.Busy.Load(),
		l.log.Processed.Load(), l.log.Parked.Load(), l.log.Duplicates.Load(), l.log.Failed.Load())
}

func (l *leaseCrashRun) Infos() []exactlyonce.Info {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]exactlyonce.Info(nil), l.infos...)
}

// startRouter starts the restarted router, which parks a key after
// maxInterrupted interrupted attempts (0: the default).
func (b *leaseCrashBundle) startRouter(t *testing.T, maxInterrupted int) *leaseCrashRun {
	t.Helper()
	run := &leaseCrashRun{log: &eventLog{}, deliveries: &deliveryLog{}}
	eo := newMiddleware(t, exactlyonce.Config{
		DB: b.DB, Consumer: leaseCrashConsumer,
		Lease:     &exactlyonce.LeaseConfig{Duration: leaseCrashLease, MaxInterruptedAttempts: maxInterrupted},
		NackDelay: leaseCrashNackDelay, OnEvent: run.log.Observe,
	})
	client := leaseCrashHTTPClient()
	run.r = newRouter(t)
	run.r.AddMiddleware(run.deliveries.Middleware, eo.Middleware)
	run.r.AddHandler(leaseCrashConsumer, b.In, testenv.AMQPSubscriber(t, 0), b.Out, outboxOnly(t),
		leaseCrashHandler(b.Effects, b.provider.URL(), client, func(info exactlyonce.Info) {
			run.mu.Lock()
			run.infos = append(run.infos, info)
			run.mu.Unlock()
		}))
	testenv.StartRouter(t, run.r)
	return run
}

// requireBusyFirst checks that the requeued delivery first met the dead
// worker's live lease: nacked (never acked, never run) as attempt 1.
func (b *leaseCrashBundle) requireBusyFirst(t *testing.T, run *leaseCrashRun) {
	t.Helper()
	busy := run.log.Of(exactlyonce.Nacked, exactlyonce.ErrLeaseHeld)
	require.NotEmpty(t, busy, "the redelivery must first meet the dead worker's live lease (a %s lease)", leaseCrashLease)
	for _, e := range busy {
		require.Equal(t, b.msgUUID, e.Key)
		require.Equal(t, 1, e.Attempt, "busy on the dead worker's attempt")
		require.ErrorIs(t, e.Err, exactlyonce.ErrLeaseHeld)
	}
}

func TestLeaseCrash(t *testing.T) {
	t.Parallel()
	// Retry and park on both drivers: the four subtests run in parallel and
	// each is dominated by the 2s lease, so the whole test takes seconds.
	for _, dn := range testenv.DriverNames {
		t.Run(dn, func(t *testing.T) {
			t.Parallel()
			t.Run("Retry", func(t *testing.T) {
				t.Parallel()
				leaseCrashRetry(t, leaseCrashSetup(t, setupE2E(t, testenv.DriverNamed(t, dn))))
			})
			t.Run("Park", func(t *testing.T) {
				t.Parallel()
				leaseCrashPark(t, leaseCrashSetup(t, setupE2E(t, testenv.DriverNamed(t, dn))))
			})
		})
	}
}

// leaseCrashRetry: after the lease expires, the requeued delivery runs as
// attempt 2, interrupted, with the same idempotency key, and completes.
func leaseCrashRetry(t *testing.T, b *leaseCrashBundle) {
	b.killMidCall(t)

	run := b.startRouter(t, 0)
	run.waitAcked(t, "restarted router (default MaxInterruptedAttempts)")
	closeRouter(t, run.r)
	requireQueueSettled(t, b.Conn, b.In, 0)

	b.requireBusyFirst(t, run)
	require.Equal(t, int64(0), run.log.Parked.Load())
	require.Equal(t, int64(0), run.log.Duplicates.Load())
	processed := run.log.Of(exactlyonce.Processed, nil)
	require.Len(t, processed, 1)
	require.Equal(t, 2, processed[0].Attempt)
	require.True(t, processed[0].Interrupted)
	require.Equal(t, int64(1), run.log.Interrupted.Load())
	require.Equal(t, int64(0), run.log.Failed.Load())
	for _, r := range run.deliveries.Redelivered() {
		require.True(t, r, "every delivery is RabbitMQ's requeue of the killed worker's delivery")
	}

	// The handler ran once here: attempt 2, interrupted, same key.
	infos := run.Infos()
	require.Len(t, infos, 1, "the handler runs once, after the lease expired")
	require.Equal(t, b.key(), infos[0].IdempotencyKey)
	require.Equal(t, 2, infos[0].Attempt)
	require.True(t, infos[0].Interrupted)

	// The provider saw both calls with the same key: it can deduplicate.
	require.Equal(t, map[string]int{b.key(): 2}, b.provider.AllCalls(), "calls per idempotency key")
	require.Equal(t, 1, b.provider.Successes(b.key()))

	rec := b.record(t)
	require.Equal(t, inboxdb.StatusDone, rec.Status)
	require.Equal(t, 2, rec.Attempts)
	require.Nil(t, rec.LeaseUntil)
	require.Equal(t, int64(1), b.Effects.Count(t, ""), "one business row")
	require.Equal(t, []string{fmt.Sprintf("key=%s attempt=2 interrupted=true", b.key())}, b.Effects.Notes(t, b.msgUUID))
	requireExactlyOneOutput(t, b.DB, b.Out, leaseCrashOutputUUID(b.msgUUID))
}

// leaseCrashPark: after the lease expires, the requeued delivery parks the
// key and is acked without running; an operator lists and releases it, and
// the re-published message runs as attempt 2 and completes.
func leaseCrashPark(t *testing.T, b *leaseCrashBundle) {
	b.killMidCall(t)
	ctx := testCtx(t)
	store := inboxStore(t, b.DB)

	run := b.startRouter(t, 1)
	run.waitAcked(t, "restarted router (MaxInterruptedAttempts 1)")
	closeRouter(t, run.r)
	requireQueueSettled(t, b.Conn, b.In, 0) // acked

	b.requireBusyFirst(t, run)
	parkedEv := run.log.Of(exactlyonce.Parked, nil)
	require.Len(t, parkedEv, 1)
	require.Equal(t, b.msgUUID, parkedEv[0].Key)
	require.Equal(t, 1, parkedEv[0].Attempt)
	require.Equal(t, int64(0), run.log.Processed.Load())
	require.Equal(t, int64(0), run.log.Duplicates.Load())
	require.Equal(t, int64(0), run.log.Failed.Load())
	require.Empty(t, run.Infos(), "the handler must not run for a parked key")
	require.Equal(t, 1, b.provider.Calls(b.key()), "only the dead worker's call")

	// The operator's view.
	parked, err := store.Parked(ctx, leaseCrashConsumer, 10)
	require.NoError(t, err)
	require.Len(t, parked, 1)
	require.Equal(t, b.msgUUID, parked[0].Key)
	require.Equal(t, inboxdb.StatusParked, parked[0].Status)
	require.Equal(t, 1, parked[0].Attempts)
	require.Contains(t, parked[0].LastError, "lease expired during attempt 1")
	require.Equal(t, int64(0), b.Effects.Count(t, ""))
	require.Equal(t, int64(0), outboxPending(t, b.DB))

	// Release, re-publish the same message (same UUID): it runs and completes.
	released, err := store.Release(ctx, leaseCrashConsumer, b.msgUUID, inbox.Expect{})
	require.NoError(t, err)
	require.True(t, released)
	run2 := b.startRouter(t, 1)
	require.NoError(t, b.Pub.Publish(b.In, message.NewMessage(b.msgUUID, b.payload)))
	run2.waitAcked(t, "router after release")
	closeRouter(t, run2.r)
	requireQueueSettled(t, b.Conn, b.In, 0)

	require.Equal(t, int64(1), run2.log.Processed.Load())
	require.Equal(t, int64(0), run2.log.Failed.Load())
	require.Equal(t, int64(0), run2.log.Parked.Load())
	require.Equal(t, int64(0), run2.log.Duplicates.Load())
	require.Equal(t, int64(0), run2.log.Busy.Load())
	infos := run2.Infos()
	require.Len(t, infos, 1)
	require.Equal(t, b.key(), infos[0].IdempotencyKey, "same idempotency key after release")
	require.Equal(t, 2, infos[0].Attempt)
	require.True(t, infos[0].Interrupted, "the parked attempt was cut off mid-call: the released run must know")
	require.Equal(t, map[string]int{b.key(): 2}, b.provider.AllCalls(), "calls per idempotency key")
	require.Equal(t, 1, b.provider.Successes(b.key()))

	rec := b.record(t)
	require.Equal(t, inboxdb.StatusDone, rec.Status)
	require.Equal(t, 2, rec.Attempts)
	parked, err = store.Parked(ctx, leaseCrashConsumer, 10)
	require.NoError(t, err)
	require.Empty(t, parked)
	require.Equal(t, int64(1), b.Effects.Count(t, ""), "one business row")
	requireExactlyOneOutput(t, b.DB, b.Out, leaseCrashOutputUUID(b.msgUUID))
}
