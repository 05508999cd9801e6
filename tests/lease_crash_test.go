package tests

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Lease mode, the one window exactly-once cannot close alone: the worker
// process is killed (SIGKILL, a real subprocess) while its call to the
// external provider is in flight. The claim was committed with a lease; the
// completion never happened; whether the SMS went out is unknown. RabbitMQ
// requeues the unacked delivery. With RetryExpired the key runs again after
// the lease expires, with the same idempotency key, and completes; with
// ParkExpired the key is parked and acked, an operator sees it and releases
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
	return &http.Client{Timeout: 2 * faultWait, Transport: &http.Transport{DisableKeepAlives: true}}
}

// leaseCrashHandler is the SMS handler, the same in the worker and in the
// restarted router: it reports its lease info, sends the SMS with the
// lease's idempotency key, and on success writes the business row (id =
// message UUID, unique: a second application would fail loudly) in the
// completion transaction and returns one output message.
func leaseCrashHandler(tables sqlschema.Config, providerURL string, client *http.Client, onInfo func(middleware.LeaseInfo)) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		info, ok := middleware.LeaseFromContext(ctx)
		if !ok {
			return nil, fmt.Errorf("no lease info in the handler's context")
		}
		onInfo(info)
		if err := testenv.SendSMS(ctx, client, providerURL, info.IdempotencyKey, "+15550100", "your order "+msg.UUID+" shipped"); err != nil {
			return nil, err
		}
		note := fmt.Sprintf("key=%s attempt=%d interrupted=%t", info.IdempotencyKey, info.Attempt, info.Interrupted)
		if err := faultInsertEffect(ctx, tables, msg.UUID, note); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(leaseCrashOutputUUID(msg.UUID), []byte(`{"event":"sms-sent"}`))}, nil
	}
}

// TestLeaseCrashWorkerProcess is the worker of TestLeaseCrash, run in a
// subprocess that the parent kills mid-call. It does nothing in a normal
// test run.
func TestLeaseCrashWorkerProcess(t *testing.T) {
	if !faultIsWorker(t.Name()) {
		return
	}
	d := faultDriver(t, faultEnv(t, leaseCrashEnvDriver))
	tables := sqlschema.Config{Schema: faultEnv(t, leaseCrashEnvSchema)}
	in, out := faultEnv(t, leaseCrashEnvIn), faultEnv(t, leaseCrashEnvOut)
	providerURL := faultEnv(t, leaseCrashEnvProvider)

	eo, err := middleware.New(middleware.Config{
		DB: d.DB, Tables: tables, Mode: middleware.Lease, Consumer: leaseCrashConsumer, Lease: leaseCrashLease,
	})
	require.NoError(t, err)
	client := leaseCrashHTTPClient()
	r := faultNewRouter(t)
	h := r.AddHandler(leaseCrashConsumer, in, testenv.AMQPSubscriber(t, 0), out, routerMustNotPublish{t: t},
		leaseCrashHandler(tables, providerURL, client, func(middleware.LeaseInfo) {}))
	h.AddMiddleware(eo.Middleware)
	testenv.StartRouter(t, r)

	// The parent kills this process while the provider call hangs.
	select {
	case <-time.After(faultWait):
		t.Fatalf("worker: not killed within %s", faultWait)
	case <-t.Context().Done():
	}
}

// leaseCrashWorker is a running worker subprocess.
type leaseCrashWorker struct {
	cmd    *exec.Cmd
	out    bytes.Buffer // read only after exited is closed
	exited chan struct{}
}

// leaseCrashStartWorker starts the worker subprocess with env added. At
// cleanup a worker still running is killed and awaited.
func leaseCrashStartWorker(t testing.TB, env map[string]string) *leaseCrashWorker {
	t.Helper()
	w := &leaseCrashWorker{exited: make(chan struct{})}
	w.cmd = exec.Command(os.Args[0], "-test.run=^"+leaseCrashWorkerTest+"$", "-test.v", "-test.count=1", "-test.timeout=80s")
	w.cmd.Env = append(os.Environ(), faultWorkerEnv+"="+leaseCrashWorkerTest)
	for k, v := range env {
		w.cmd.Env = append(w.cmd.Env, k+"="+v)
	}
	w.cmd.Stdout = &w.out
	w.cmd.Stderr = &w.out
	require.NoError(t, w.cmd.Start())
	go func() {
		_ = w.cmd.Wait()
		close(w.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-w.exited:
			return
		default:
		}
		_ = w.cmd.Process.Kill()
		select {
		case <-w.exited:
		case <-time.After(faultWait):
			t.Errorf("worker pid %d did not exit after SIGKILL", w.cmd.Process.Pid)
		}
	})
	return w
}

// Output returns the worker's combined output; only after it exited.
func (w *leaseCrashWorker) Output() string {
	select {
	case <-w.exited:
		return w.out.String()
	default:
		return "(worker still running)"
	}
}

// KillAndWait sends SIGKILL to the worker, waits for it to exit, and
// requires that it died of that signal (not of its own accord).
func (w *leaseCrashWorker) KillAndWait(t testing.TB) {
	t.Helper()
	require.NoError(t, w.cmd.Process.Kill())
	select {
	case <-w.exited:
	case <-time.After(faultWait):
		t.Fatalf("worker pid %d did not exit within %s of SIGKILL", w.cmd.Process.Pid, faultWait)
	}
	ws, ok := w.cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok, "wait status of type %T", w.cmd.ProcessState.Sys())
	require.True(t, ws.Signaled() && ws.Signal() == syscall.SIGKILL,
		"the worker must die of SIGKILL, got %s; output:\n%s", w.cmd.ProcessState, w.Output())
}

// leaseCrashBundle is one crash scenario for one driver.
type leaseCrashBundle struct {
	d        testenv.Driver
	tables   sqlschema.Config
	store    *inbox.Store
	in, out  string
	conn     *amqp.Connection
	pub      message.Publisher
	provider *testenv.Provider
	// inFlight receives the idempotency key of the provider's first call,
	// once the provider holds it; firstCallAborted is closed when that
	// call's client went away.
	inFlight         chan string
	firstCallAborted chan struct{}
	msgUUID          string
	payload          []byte
}

// leaseCrashSetup creates the schema, business table, queues and the fake
// provider, whose first request hangs until its client goes away and whose
// later requests succeed.
func leaseCrashSetup(t *testing.T, d testenv.Driver) *leaseCrashBundle {
	t.Helper()
	b := &leaseCrashBundle{
		d:                d,
		tables:           testenv.Schema(t),
		in:               testenv.Queue(t, "lcrash_in_"),
		out:              testenv.Queue(t, "lcrash_out_"),
		conn:             testenv.AMQPConn(t),
		pub:              testenv.AMQPPublisher(t),
		provider:         testenv.NewProvider(t),
		inFlight:         make(chan string, 1),
		firstCallAborted: make(chan struct{}),
		msgUUID:          watermill.NewUUID(),
		payload:          []byte(`{"order":42,"phone":"+15550100"}`),
	}
	faultCreateEffects(t, d.DB, b.tables)
	var err error
	b.store, err = inbox.NewStore(inbox.Config{Tables: b.tables})
	require.NoError(t, err)
	var hung atomic.Bool
	b.provider.OnRequest = func(r *http.Request, key string, call int) int {
		// Only the very first request hangs (whatever its key, so that a
		// wrong key on a later attempt fails the assertions, not a wait).
		if !hung.CompareAndSwap(false, true) {
			return http.StatusOK
		}
		b.inFlight <- key
		select {
		case <-r.Context().Done(): // the worker died mid-call
			close(b.firstCallAborted)
			return http.StatusServiceUnavailable
		case <-time.After(faultWait):
			return http.StatusGatewayTimeout
		}
	}
	// Provider's serve reads OnRequest after taking its mutex: this call
	// orders the assignment above before every request (race detector).
	_ = b.provider.Calls("")
	return b
}

// key is the expected idempotency key: "<consumer>:<message UUID>".
func (b *leaseCrashBundle) key() string { return leaseCrashConsumer + ":" + b.msgUUID }

// record returns the inbox record of the message.
func (b *leaseCrashBundle) record(t testing.TB) inbox.Record {
	t.Helper()
	rec, err := b.store.Lookup(faultCtx(t), b.d.DB, leaseCrashConsumer, b.msgUUID)
	require.NoError(t, err)
	return rec
}

// killMidCall publishes the message, runs the worker, waits until its SMS
// call is in flight at the provider, and kills it with SIGKILL. It checks
// that the claim committed before the call and that nothing else did.
func (b *leaseCrashBundle) killMidCall(t *testing.T) {
	t.Helper()
	require.NoError(t, b.pub.Publish(b.in, message.NewMessage(b.msgUUID, b.payload)))
	w := leaseCrashStartWorker(t, map[string]string{
		leaseCrashEnvDriver: b.d.Name, leaseCrashEnvSchema: b.tables.Schema,
		leaseCrashEnvIn: b.in, leaseCrashEnvOut: b.out, leaseCrashEnvProvider: b.provider.URL(),
	})
	select {
	case key := <-b.inFlight:
		require.Equal(t, b.key(), key, "the worker's idempotency key")
	case <-w.exited:
		t.Fatalf("the worker exited before its provider call; output:\n%s", w.Output())
	case <-time.After(faultWait):
		t.Fatalf("the worker's provider call did not arrive within %s", faultWait)
	}
	rec := b.record(t)
	require.Equal(t, inbox.StatusProcessing, rec.Status, "the claim is committed before the provider call")
	require.Equal(t, 1, rec.Attempts)
	require.NotNil(t, rec.LeaseUntil)

	w.KillAndWait(t)
	select {
	case <-b.firstCallAborted:
	case <-time.After(faultWait):
		t.Fatal("the provider did not see its client go away")
	}
	rec = b.record(t)
	require.Equal(t, inbox.StatusProcessing, rec.Status, "the dead worker recorded nothing after its claim")
	require.Equal(t, 1, rec.Attempts)
	require.Empty(t, rec.LastError)
	require.Equal(t, int64(0), faultEffects(t, b.d.DB, b.tables), "no business row from the dead worker")
	require.Equal(t, int64(0), faultPending(t, b.d.DB, b.tables), "no output from the dead worker")
	require.Equal(t, 0, b.provider.Successes(b.key()))
}

// leaseCrashRun is a router restarted in the test process on the same
// queue, consumer name and lease.
type leaseCrashRun struct {
	r  *message.Router
	ev *faultEvents

	mu          sync.Mutex
	infos       []middleware.LeaseInfo
	redelivered []bool
}

// Acked is the number of deliveries the middleware acked: processed,
// parked or duplicate. The tests await it, then assert which it was.
func (l *leaseCrashRun) Acked() int64 {
	return l.ev.Processed.Load() + l.ev.Parked.Load() + l.ev.Duplicates.Load()
}

// waitAcked waits until run acked one delivery.
func (l *leaseCrashRun) waitAcked(t *testing.T, what string) {
	t.Helper()
	testenv.Eventually(t, faultWait, func() bool { return l.Acked() >= 1 }, "%s: no delivery acked", what)
	t.Logf("%s: busy %d, processed %d, parked %d, duplicates %d, failed %d", what, l.ev.Busy.Load(),
		l.ev.Processed.Load(), l.ev.Parked.Load(), l.ev.Duplicates.Load(), l.ev.Failed.Load())
}

func (l *leaseCrashRun) Infos() []middleware.LeaseInfo {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]middleware.LeaseInfo(nil), l.infos...)
}

func (l *leaseCrashRun) Redelivered() []bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]bool(nil), l.redelivered...)
}

// startRouter starts the restarted router with policy.
func (b *leaseCrashBundle) startRouter(t *testing.T, policy middleware.ExpiredPolicy) *leaseCrashRun {
	t.Helper()
	run := &leaseCrashRun{ev: &faultEvents{}}
	eo, err := middleware.New(middleware.Config{
		DB: b.d.DB, Tables: b.tables, Mode: middleware.Lease, Consumer: leaseCrashConsumer,
		Lease: leaseCrashLease, OnExpired: policy, NackDelay: leaseCrashNackDelay, OnEvent: run.ev.Observe,
	})
	require.NoError(t, err)
	client := leaseCrashHTTPClient()
	run.r = faultNewRouter(t)
	run.r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			run.mu.Lock()
			run.redelivered = append(run.redelivered, wamqp.IsMessageRedelivered(msg))
			run.mu.Unlock()
			return h(msg)
		}
	}, eo.Middleware)
	run.r.AddHandler(leaseCrashConsumer, b.in, testenv.AMQPSubscriber(t, 0), b.out, routerMustNotPublish{t: t},
		leaseCrashHandler(b.tables, b.provider.URL(), client, func(info middleware.LeaseInfo) {
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
	busy := run.ev.Of(middleware.EventBusy)
	require.NotEmpty(t, busy, "the redelivery must first meet the dead worker's live lease (a %s lease)", leaseCrashLease)
	for _, e := range busy {
		require.Equal(t, b.msgUUID, e.Key)
		require.Equal(t, 1, e.Attempt, "busy on the dead worker's attempt")
		require.ErrorIs(t, e.Err, middleware.ErrLeaseHeld)
	}
}

func TestLeaseCrash(t *testing.T) {
	t.Parallel()
	// Both policies on both drivers: the four subtests run in parallel and
	// each is dominated by the 2s lease, so the whole test takes seconds.
	for _, d := range testenv.Drivers(t) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			t.Run("Retry", func(t *testing.T) {
				t.Parallel()
				leaseCrashRetry(t, d)
			})
			t.Run("Park", func(t *testing.T) {
				t.Parallel()
				leaseCrashPark(t, d)
			})
		})
	}
}

// leaseCrashRetry: after the lease expires, the requeued delivery runs as
// attempt 2, interrupted, with the same idempotency key, and completes.
func leaseCrashRetry(t *testing.T, d testenv.Driver) {
	b := leaseCrashSetup(t, d)
	b.killMidCall(t)

	run := b.startRouter(t, middleware.RetryExpired)
	run.waitAcked(t, "restarted router (RetryExpired)")
	require.NoError(t, run.r.Close())
	faultRequireQueueSettled(t, b.conn, b.in, 0)

	b.requireBusyFirst(t, run)
	require.Equal(t, int64(0), run.ev.Parked.Load())
	require.Equal(t, int64(0), run.ev.Duplicates.Load())
	processed := run.ev.Of(middleware.EventProcessed)
	require.Len(t, processed, 1)
	require.Equal(t, 2, processed[0].Attempt)
	require.True(t, processed[0].Interrupted)
	require.Equal(t, int64(1), run.ev.Interrupted.Load())
	require.Equal(t, int64(0), run.ev.Failed.Load())
	for _, r := range run.Redelivered() {
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
	require.Equal(t, inbox.StatusDone, rec.Status)
	require.Equal(t, 2, rec.Attempts)
	require.Nil(t, rec.LeaseUntil)
	require.Equal(t, int64(1), faultEffects(t, d.DB, b.tables), "one business row")
	var note string
	require.NoError(t, seam.QueryRow(faultCtx(t), d.DB, "SELECT note FROM "+faultTable(b.tables, "effects")+" WHERE id = $1",
		[]any{b.msgUUID}, &note))
	require.Equal(t, fmt.Sprintf("key=%s attempt=2 interrupted=true", b.key()), note)
	requireExactlyOneOutput(t, d, b.tables, b.out, leaseCrashOutputUUID(b.msgUUID))
}

// leaseCrashPark: after the lease expires, the requeued delivery parks the
// key and is acked without running; an operator lists and releases it, and
// the re-published message runs as attempt 2 and completes.
func leaseCrashPark(t *testing.T, d testenv.Driver) {
	b := leaseCrashSetup(t, d)
	b.killMidCall(t)
	ctx := faultCtx(t)

	run := b.startRouter(t, middleware.ParkExpired)
	run.waitAcked(t, "restarted router (ParkExpired)")
	require.NoError(t, run.r.Close())
	faultRequireQueueSettled(t, b.conn, b.in, 0) // acked

	b.requireBusyFirst(t, run)
	parkedEv := run.ev.Of(middleware.EventParked)
	require.Len(t, parkedEv, 1)
	require.Equal(t, b.msgUUID, parkedEv[0].Key)
	require.Equal(t, 1, parkedEv[0].Attempt)
	require.Equal(t, int64(0), run.ev.Processed.Load())
	require.Equal(t, int64(0), run.ev.Duplicates.Load())
	require.Equal(t, int64(0), run.ev.Failed.Load())
	require.Empty(t, run.Infos(), "the handler must not run for a parked key")
	require.Equal(t, 1, b.provider.Calls(b.key()), "only the dead worker's call")

	// The operator's view.
	parked, err := b.store.ListParked(ctx, d.DB, leaseCrashConsumer, 10)
	require.NoError(t, err)
	require.Len(t, parked, 1)
	require.Equal(t, b.msgUUID, parked[0].Key)
	require.Equal(t, inbox.StatusParked, parked[0].Status)
	require.Equal(t, 1, parked[0].Attempts)
	require.Contains(t, parked[0].LastError, "lease expired during attempt 1")
	require.Equal(t, int64(0), faultEffects(t, d.DB, b.tables))
	require.Equal(t, int64(0), faultPending(t, d.DB, b.tables))

	// Release, re-publish the same message (same UUID): it runs and completes.
	released, err := b.store.Release(ctx, d.DB, leaseCrashConsumer, b.msgUUID)
	require.NoError(t, err)
	require.True(t, released)
	run2 := b.startRouter(t, middleware.ParkExpired)
	require.NoError(t, b.pub.Publish(b.in, message.NewMessage(b.msgUUID, b.payload)))
	run2.waitAcked(t, "router after release")
	require.NoError(t, run2.r.Close())
	faultRequireQueueSettled(t, b.conn, b.in, 0)

	require.Equal(t, int64(1), run2.ev.Processed.Load())
	require.Equal(t, int64(0), run2.ev.Failed.Load())
	require.Equal(t, int64(0), run2.ev.Parked.Load())
	require.Equal(t, int64(0), run2.ev.Duplicates.Load())
	require.Equal(t, int64(0), run2.ev.Busy.Load())
	infos := run2.Infos()
	require.Len(t, infos, 1)
	require.Equal(t, b.key(), infos[0].IdempotencyKey, "same idempotency key after release")
	require.Equal(t, 2, infos[0].Attempt)
	require.True(t, infos[0].Interrupted, "the parked attempt was cut off mid-call: the released run must know")
	require.Equal(t, map[string]int{b.key(): 2}, b.provider.AllCalls(), "calls per idempotency key")
	require.Equal(t, 1, b.provider.Successes(b.key()))

	rec := b.record(t)
	require.Equal(t, inbox.StatusDone, rec.Status)
	require.Equal(t, 2, rec.Attempts)
	parked, err = b.store.ListParked(ctx, d.DB, leaseCrashConsumer, 10)
	require.NoError(t, err)
	require.Empty(t, parked)
	require.Equal(t, int64(1), faultEffects(t, d.DB, b.tables), "one business row")
	requireExactlyOneOutput(t, d, b.tables, b.out, leaseCrashOutputUUID(b.msgUUID))
}
