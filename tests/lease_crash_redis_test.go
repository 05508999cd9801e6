package tests

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// The lease-mode crash tests of lease_crash_test.go with the Redis store:
// a worker process is SIGKILLed while its provider call is in flight; its
// claim (in Redis) keeps the key until the lease expires; then the requeued
// delivery runs as attempt 2, interrupted, with the same idempotency key
// (Retry), or, with MaxInterruptedAttempts 1, the key is parked, listed,
// released, and the re-published message runs (Park). The handler only
// calls the provider: the Redis store records nothing else.

const (
	leaseCrashRedisWorkerTest = "TestLeaseCrashRedisWorkerProcess"
	leaseCrashEnvRedisPrefix  = "LEASE_CRASH_REDIS_PREFIX"
)

// leaseCrashRedisHandler reports its lease info and sends the SMS with the
// lease's idempotency key.
func leaseCrashRedisHandler(providerURL string, client *http.Client, onInfo func(exactlyonce.Info)) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		info, err := exactlyonce.InfoFromContext(ctx)
		if err != nil {
			return err
		}
		if info.Attempt == 0 {
			return fmt.Errorf("no lease attempt in the handler's context: not running in lease mode")
		}
		onInfo(info)
		return testenv.SendSMS(ctx, client, providerURL, info.IdempotencyKey, "+15550100", "your order "+msg.UUID+" shipped")
	}
}

// redisStoreFor returns the Redis lease store under prefix, on the test
// Redis (REDIS_URL).
func redisStoreFor(t testing.TB, prefix string) *redisstore.Store {
	t.Helper()
	store, err := redisstore.New(redisstore.Config{Client: testenv.Redis(t), Prefix: prefix})
	require.NoError(t, err)
	return store
}

// TestLeaseCrashRedisWorkerProcess is the worker of TestLeaseCrashRedis, run
// in a subprocess that the parent kills mid-call. It does nothing in a
// normal test run.
func TestLeaseCrashRedisWorkerProcess(t *testing.T) {
	if !isWorker(t.Name()) {
		return
	}
	store := redisStoreFor(t, workerEnv(t, leaseCrashEnvRedisPrefix))
	eo := newMiddleware(t, exactlyonce.Config{
		Lease: &exactlyonce.LeaseConfig{Duration: leaseCrashLease, Store: store}, Consumer: leaseCrashConsumer,
	})
	r := newRouter(t)
	h := r.AddConsumerHandler(leaseCrashConsumer, workerEnv(t, leaseCrashEnvIn), testenv.AMQPSubscriber(t, 0),
		leaseCrashRedisHandler(workerEnv(t, leaseCrashEnvProvider), leaseCrashHTTPClient(), func(exactlyonce.Info) {}))
	h.AddMiddleware(eo.Middleware)
	testenv.StartRouter(t, r)
	// The parent kills this process while the provider call hangs.
	select {
	case <-time.After(waitTimeout):
		t.Fatalf("worker: not killed within %s", waitTimeout)
	case <-t.Context().Done():
	}
}

// leaseCrashRedisBundle is one crash scenario with the Redis store.
type leaseCrashRedisBundle struct {
	prefix           string
	store            *redisstore.Store
	in               string
	conn             *amqp.Connection
	pub              message.Publisher
	provider         *testenv.Provider
	inFlight         chan string
	firstCallAborted chan struct{}
	msgUUID          string
	payload          []byte
}

func leaseCrashRedisSetup(t *testing.T) *leaseCrashRedisBundle {
	t.Helper()
	prefix := testenv.RedisPrefix(t, testenv.Redis(t))
	b := &leaseCrashRedisBundle{
		prefix: prefix, store: redisStoreFor(t, prefix),
		in: testenv.Queue(t, "in_"), conn: testenv.AMQPConn(t), pub: testenv.AMQPPublisher(t),
		msgUUID: watermill.NewUUID(), payload: []byte(`{"order":42,"phone":"+15550100"}`),
	}
	b.provider, b.inFlight, b.firstCallAborted = leaseCrashProvider(t)
	return b
}

func (b *leaseCrashRedisBundle) key() string { return leaseCrashConsumer + ":" + b.msgUUID }

func (b *leaseCrashRedisBundle) record(t testing.TB) inbox.Record {
	t.Helper()
	rec, err := b.store.Get(testCtx(t), leaseCrashConsumer, b.msgUUID)
	require.NoError(t, err)
	return rec
}

// killMidCall publishes the message, runs the worker, waits until its SMS
// call is in flight, and kills it with SIGKILL: the claim is in Redis, and
// nothing else was recorded.
func (b *leaseCrashRedisBundle) killMidCall(t *testing.T) {
	t.Helper()
	require.NoError(t, b.pub.Publish(b.in, message.NewMessage(b.msgUUID, b.payload)))
	w := startWorker(t, leaseCrashRedisWorkerTest, map[string]string{
		leaseCrashEnvRedisPrefix: b.prefix, leaseCrashEnvIn: b.in, leaseCrashEnvProvider: b.provider.URL(),
	})
	select {
	case key := <-b.inFlight:
		require.Equal(t, b.key(), key, "the worker's idempotency key")
	case <-w.exited:
		t.Fatalf("the worker exited before its provider call; output:\n%s", w.Output())
	case <-testCtx(t).Done():
		t.Fatalf("the worker's provider call did not arrive within %s", waitTimeout)
	}
	rec := b.record(t)
	require.Equal(t, inboxdb.StatusProcessing, rec.Status, "the claim is recorded before the provider call")
	require.Equal(t, 1, rec.Attempts)
	require.NotNil(t, rec.LeaseUntil)

	w.KillAndWait(t)
	waitClosed(t, b.firstCallAborted, "the provider to see its client go away")
	rec = b.record(t)
	require.Equal(t, inboxdb.StatusProcessing, rec.Status, "the dead worker recorded nothing after its claim")
	require.Equal(t, 1, rec.Attempts)
	require.Empty(t, rec.LastError)
	require.Equal(t, 0, b.provider.Successes(b.key()))
}

// startRouter starts the restarted router in this process.
func (b *leaseCrashRedisBundle) startRouter(t *testing.T, maxInterrupted int) *leaseCrashRun {
	t.Helper()
	run := &leaseCrashRun{log: &eventLog{}, deliveries: &deliveryLog{}}
	eo := newMiddleware(t, exactlyonce.Config{
		Consumer:  leaseCrashConsumer,
		Lease:     &exactlyonce.LeaseConfig{Duration: leaseCrashLease, MaxInterruptedAttempts: maxInterrupted, Store: b.store},
		NackDelay: leaseCrashNackDelay, OnEvent: run.log.Observe,
	})
	run.r = newRouter(t)
	run.r.AddMiddleware(run.deliveries.Middleware, eo.Middleware)
	run.r.AddConsumerHandler(leaseCrashConsumer, b.in, testenv.AMQPSubscriber(t, 0),
		leaseCrashRedisHandler(b.provider.URL(), leaseCrashHTTPClient(), func(info exactlyonce.Info) {
			run.mu.Lock()
			run.infos = append(run.infos, info)
			run.mu.Unlock()
		}))
	testenv.StartRouter(t, run.r)
	return run
}

func (b *leaseCrashRedisBundle) requireBusyFirst(t *testing.T, run *leaseCrashRun) {
	t.Helper()
	busy := run.log.Of(exactlyonce.Nacked, exactlyonce.ErrLeaseHeld)
	require.NotEmpty(t, busy, "the redelivery must first meet the dead worker's live lease (a %s lease)", leaseCrashLease)
	for _, e := range busy {
		require.Equal(t, 1, e.Attempt, "busy on the dead worker's attempt")
	}
}

func TestLeaseCrashRedis(t *testing.T) {
	t.Parallel()
	t.Run("Retry", func(t *testing.T) {
		t.Parallel()
		b := leaseCrashRedisSetup(t)
		b.killMidCall(t)

		run := b.startRouter(t, 0)
		run.waitAcked(t, "restarted router (default MaxInterruptedAttempts)")
		closeRouter(t, run.r)
		requireQueueSettled(t, b.conn, b.in, 0)

		b.requireBusyFirst(t, run)
		processed := run.log.Of(exactlyonce.Processed, nil)
		require.Len(t, processed, 1)
		require.Equal(t, 2, processed[0].Attempt)
		require.True(t, processed[0].Interrupted)
		require.Equal(t, int64(0), run.log.Parked.Load())
		require.Equal(t, int64(0), run.log.Failed.Load())
		infos := run.Infos()
		require.Len(t, infos, 1, "the handler runs once, after the lease expired")
		require.Equal(t, b.key(), infos[0].IdempotencyKey)
		require.Equal(t, 2, infos[0].Attempt)
		require.True(t, infos[0].Interrupted)
		require.Equal(t, map[string]int{b.key(): 2}, b.provider.AllCalls(), "both calls with the same idempotency key")
		require.Equal(t, 1, b.provider.Successes(b.key()))
		rec := b.record(t)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 2, rec.Attempts)
		require.Equal(t, 1, rec.Interruptions)
	})
	t.Run("Park", func(t *testing.T) {
		t.Parallel()
		b := leaseCrashRedisSetup(t)
		b.killMidCall(t)
		ctx := testCtx(t)

		run := b.startRouter(t, 1)
		run.waitAcked(t, "restarted router (MaxInterruptedAttempts 1)")
		closeRouter(t, run.r)
		requireQueueSettled(t, b.conn, b.in, 0) // acked

		b.requireBusyFirst(t, run)
		require.Len(t, run.log.Of(exactlyonce.Parked, nil), 1)
		require.Equal(t, int64(0), run.log.Processed.Load())
		require.Empty(t, run.Infos(), "the handler must not run for a parked key")
		require.Equal(t, 1, b.provider.Calls(b.key()), "only the dead worker's call")
		parked, err := b.store.Parked(ctx, leaseCrashConsumer, 10)
		require.NoError(t, err)
		require.Len(t, parked, 1)
		require.Equal(t, b.msgUUID, parked[0].Key)
		require.Equal(t, inboxdb.StatusParked, parked[0].Status)
		require.Contains(t, parked[0].LastError, "lease expired during attempt 1")

		released, err := b.store.Release(ctx, leaseCrashConsumer, b.msgUUID, inbox.Expect{})
		require.NoError(t, err)
		require.True(t, released)
		run2 := b.startRouter(t, 1)
		require.NoError(t, b.pub.Publish(b.in, message.NewMessage(b.msgUUID, b.payload)))
		run2.waitAcked(t, "router after release")
		closeRouter(t, run2.r)
		requireQueueSettled(t, b.conn, b.in, 0)
		require.Equal(t, int64(1), run2.log.Processed.Load())
		infos := run2.Infos()
		require.Len(t, infos, 1)
		require.Equal(t, b.key(), infos[0].IdempotencyKey, "same idempotency key after release")
		require.Equal(t, 2, infos[0].Attempt)
		require.True(t, infos[0].Interrupted, "the parked attempt was cut off mid-call: the released run must know")
		require.Equal(t, map[string]int{b.key(): 2}, b.provider.AllCalls())
		require.Equal(t, inboxdb.StatusDone, b.record(t).Status)
		parked, err = b.store.Parked(ctx, leaseCrashConsumer, 10)
		require.NoError(t, err)
		require.Empty(t, parked)
	})
}
