package tests

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

const (
	// leaseLoadKeys is the number of distinct messages of the load test.
	leaseLoadKeys = 1000
	// leaseLoadMaxCopies is the most copies of one message published.
	leaseLoadMaxCopies = 3
	// leaseLoadRouters is the number of routers (replicas) consuming the
	// one input queue.
	leaseLoadRouters = 3
	// leaseLoadPrefetch is each router's subscriber prefetch.
	leaseLoadPrefetch = 10
	// leaseLoadWindow spreads the copies of a message over about this many
	// neighbouring queue positions (a local shuffle), so that two routers
	// often hold copies of the same key at the same moment.
	leaseLoadWindow = 8
	// leaseLoadTimeout bounds the wait for every copy to settle: about 10s
	// here under -race with both drivers at once; the margin is for a
	// machine loaded by other test packages.
	leaseLoadTimeout = 90 * time.Second
)

// leaseSeed returns the seed of a randomised test, from $LEASE_SEED to
// replay a run, or else from the clock; it is logged.
func leaseSeed(t *testing.T) uint64 {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("LEASE_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "LEASE_SEED")
		seed = v
	}
	t.Logf("seed %d (replay with LEASE_SEED=%d)", seed, seed)
	return seed
}

// TestLeaseManyMessagesThreeRouters: 1,000 distinct SMS messages, each
// published 1-3 times (copies close together in the queue), consumed by
// three routers sharing the queue and the consumer name. Each idempotency
// key reaches the provider exactly once; the inbox, the business table and
// the outbox (then the output queue) hold exactly one entry per message;
// every delivery is acked, copies as duplicates, and copies that met a live
// lease are nacked and redelivered until the holder completed.
func TestLeaseManyMessagesThreeRouters(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		start := time.Now()
		provider := testenv.NewProvider(t)
		sender := newLeaseSender(t, e, provider)

		// The deliveries: copies of message i next to each other, then
		// each position swapped with one at most leaseLoadWindow-1
		// further on.
		rng := rand.New(rand.NewPCG(leaseSeed(t), 0x1ea5e))
		keys := make([]string, leaseLoadKeys)
		var order []int // message index per published copy
		for i := range keys {
			keys[i] = fmt.Sprintf("sms-%04d-%s", i, watermill.NewShortUUID())
			for range 1 + rng.IntN(leaseLoadMaxCopies) {
				order = append(order, i)
			}
		}
		for i := range order {
			j := i + rng.IntN(min(leaseLoadWindow, len(order)-i))
			order[i], order[j] = order[j], order[i]
		}
		total := len(order)
		t.Logf("%d messages, %d copies published", leaseLoadKeys, total)

		deliveries := make([]*deliveryLog, leaseLoadRouters)
		routers := make([]*message.Router, leaseLoadRouters)
		for i := range routers {
			deliveries[i] = &deliveryLog{}
			routers[i] = leaseStartRouter(t, e, fmt.Sprintf("sms-router-%d", i),
				testenv.AMQPSubscriber(t, leaseLoadPrefetch), sender.Handle, deliveries[i])
		}

		msgs := make([]*message.Message, total)
		for n, i := range order {
			msgs[n] = message.NewMessage(keys[i], leasePayload(i))
		}
		require.NoError(t, e.Pub.Publish(e.In, msgs...))

		testenv.Eventually(t, leaseLoadTimeout, func() bool { return e.Log.Settled() >= int64(total) },
			"expected %d processed+duplicate deliveries", total)
		for _, r := range routers {
			closeRouter(t, r)
		}
		requireQueueDrained(t, e.In)
		t.Logf("settled in %s: %d processed, %d duplicates, %d busy nacks",
			time.Since(start).Round(time.Millisecond), e.Log.Processed.Load(), e.Log.Duplicates.Load(), e.Log.Busy.Load())

		// Middleware outcomes: one run per message, every extra copy a
		// duplicate, every busy nack redelivered exactly once more.
		require.Equal(t, int64(leaseLoadKeys), e.Log.Processed.Load(), "processed")
		require.Equal(t, int64(total-leaseLoadKeys), e.Log.Duplicates.Load(), "duplicates")
		require.Zero(t, e.Log.Failed.Load()+e.Log.Rejected.Load()+e.Log.DBUnavailable.Load()+
			e.Log.FailOpen.Load()+e.Log.Parked.Load()+e.Log.Interrupted.Load(), "no delivery may fail, park or be interrupted")
		var delivered int64
		for i, n := range deliveries {
			require.Positive(t, n.Total(), "router %d received no delivery", i)
			delivered += n.Total()
		}
		require.Equal(t, int64(total)+e.Log.Busy.Load(), delivered, "deliveries: each copy once, plus one redelivery per busy nack")
		// Copies published close together meet a live lease now and then
		// (60-90 times a run here): the load exercised the lease itself,
		// not only the done record. Transactional mode would show none.
		require.Positive(t, e.Log.Busy.Load(), "no copy met a live lease")

		// The handler and the provider: each key once.
		nKeys, nRuns := sender.Keys()
		require.Equal(t, leaseLoadKeys, nKeys, "keys the handler ran for")
		require.Equal(t, leaseLoadKeys, nRuns, "handler runs")
		calls, successes := provider.AllCalls(), provider.AllSuccesses()
		require.Len(t, calls, leaseLoadKeys, "idempotency keys seen by the provider")
		require.Len(t, successes, leaseLoadKeys, "idempotency keys sent successfully")
		for _, k := range keys {
			require.Equal(t, 1, calls[leaseIdemKey(k)], "provider calls with the key of %s", k)
			require.Equal(t, 1, successes[leaseIdemKey(k)], "provider successes with the key of %s", k)
			runs := sender.Runs(k)
			require.Len(t, runs, 1, "handler runs of %s", k)
			require.Equal(t, leaseIdemKey(k), runs[0].Info.IdempotencyKey)
			require.Equal(t, 1, runs[0].Info.Attempt)
			require.False(t, runs[0].Info.Interrupted)
		}

		// The inbox, the business table, the outbox.
		st := inboxStats(t, e.DB, leaseConsumer)
		require.Equal(t, map[string]int64{inboxdb.StatusDone: leaseLoadKeys}, st.Rows, "inbox rows by status")
		require.Equal(t, int64(total-leaseLoadKeys), st.Duplicates, "duplicates recorded in the inbox")
		require.Equal(t, int64(leaseLoadKeys), e.Effects.Count(t, ""), "business rows")
		require.Equal(t, int64(leaseLoadKeys), e.Count(t, `SELECT count(DISTINCT msg_key) FROM `+e.Effects.Name+` WHERE attempt = 1`),
			"business rows: one per message, from attempt 1")
		rows := outboxRows(t, e.DB)
		require.Len(t, rows, leaseLoadKeys, "outbox rows")
		want := make(map[outboxRow]bool, leaseLoadKeys)
		for _, k := range keys {
			want[outboxRow{Topic: e.Out, UUID: outputUUID(k, 1)}] = true
		}
		for _, r := range rows {
			require.True(t, want[r], "unexpected outbox row %+v", r)
			delete(want, r)
		}
		require.Equal(t, leaseLoadKeys, relayOutbox(t, e.DB), "relayed")
		require.Equal(t, leaseLoadKeys, queueReady(t, e.Conn, e.Out), "messages on the output queue")
		t.Logf("done in %s", time.Since(start).Round(time.Millisecond))
	})
}

// leaseFailing says whether key index i of TestLeaseProviderFailsFirstAttempt
// gets a 500 on its first provider call.
func leaseFailing(i int) bool { return i%3 == 0 }

// TestLeaseProviderFailsFirstAttempt: the provider answers 500 to the first
// call of every third of 60 keys. Those messages are nacked, redelivered by
// RabbitMQ and complete as attempt 2 with the same idempotency key (two
// provider calls, one success); the others complete at once (one call).
func TestLeaseProviderFailsFirstAttempt(t *testing.T) {
	t.Parallel()
	const n = 60
	eachDriver(t, func(t *testing.T, e *e2e) {
		provider := testenv.NewProvider(t)
		keys := make([]string, n)
		failing := map[string]bool{}
		for i := range keys {
			keys[i] = watermill.NewUUID()
			if leaseFailing(i) {
				failing[leaseIdemKey(keys[i])] = true
			}
		}
		provider.OnRequest = func(_ *http.Request, key string, call int) int {
			if failing[key] && call == 1 {
				return http.StatusInternalServerError
			}
			return http.StatusOK
		}
		sender := newLeaseSender(t, e, provider)

		var deliveries deliveryLog
		r := leaseStartRouter(t, e, "sms-router", testenv.AMQPSubscriber(t, 10), sender.Handle, &deliveries)
		msgs := make([]*message.Message, n)
		for i, k := range keys {
			msgs[i] = message.NewMessage(k, leasePayload(i))
		}
		require.NoError(t, e.Pub.Publish(e.In, msgs...))

		waitSettled(t, e.Log, n)
		closeRouter(t, r)
		requireQueueDrained(t, e.In)

		nFailing := int64(len(failing))
		require.Equal(t, int64(n), e.Log.Processed.Load(), "processed")
		require.Equal(t, nFailing, e.Log.Failed.Load(), "failed first attempts")
		require.Zero(t, e.Log.Duplicates.Load()+e.Log.Busy.Load()+e.Log.Parked.Load()+e.Log.Interrupted.Load(),
			"no duplicate, busy, parked or interrupted delivery")
		require.Equal(t, n+nFailing, deliveries.Total(), "deliveries: one per message, plus the redelivery of each failed one")

		store := inboxStore(t, e.DB)
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		var wantOutbox []outboxRow
		for i, k := range keys {
			wantAttempt := 1
			if leaseFailing(i) {
				wantAttempt = 2
			}
			require.Equal(t, wantAttempt, provider.Calls(leaseIdemKey(k)), "provider calls for key %d", i)
			require.Equal(t, 1, provider.Successes(leaseIdemKey(k)), "provider successes for key %d", i)
			runs := sender.Runs(k)
			require.Len(t, runs, wantAttempt, "handler runs for key %d", i)
			for a, run := range runs {
				require.Equal(t, a+1, run.Info.Attempt, "attempt number of run %d of key %d", a+1, i)
				require.Equal(t, leaseIdemKey(k), run.Info.IdempotencyKey, "same idempotency key on every attempt")
				require.False(t, run.Info.Interrupted)
			}
			rec, err := store.Get(ctx, leaseConsumer, k)
			require.NoError(t, err)
			require.Equal(t, inboxdb.StatusDone, rec.Status, "key %d", i)
			require.Equal(t, wantAttempt, rec.Attempts, "inbox attempts of key %d", i)
			require.Empty(t, rec.LastError, "a completed key keeps no error")
			require.Equal(t, []int{wantAttempt}, e.Effects.Attempts(t, k), "business rows of key %d", i)
			wantOutbox = append(wantOutbox, outboxRow{Topic: e.Out, UUID: outputUUID(k, wantAttempt)})
		}
		require.ElementsMatch(t, wantOutbox, outboxRows(t, e.DB), "outbox rows")
		require.Equal(t, map[string]int64{inboxdb.StatusDone: n}, inboxStats(t, e.DB, leaseConsumer).Rows, "inbox rows by status")
		require.Equal(t, n, relayOutbox(t, e.DB), "relayed")
		require.Equal(t, n, queueReady(t, e.Conn, e.Out), "messages on the output queue")
	})
}

// TestLeasePermanentFailureParks: the provider rejects one SMS (422) and
// the handler wraps that with exactlyonce.Permanent. The key is parked with
// the error and the message acked (no redelivery, queue empty), after one
// provider call; a re-publish is acked without running; after
// Store.Release a re-publish runs attempt 2 with the same idempotency key,
// and it completes. Another message is unaffected throughout.
func TestLeasePermanentFailureParks(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, e *e2e) {
		provider := testenv.NewProvider(t)
		rejected, other := watermill.NewUUID(), watermill.NewUUID()
		provider.OnRequest = func(_ *http.Request, key string, call int) int {
			if key == leaseIdemKey(rejected) && call == 1 {
				return http.StatusUnprocessableEntity
			}
			return http.StatusOK
		}
		sender := newLeaseSender(t, e, provider)
		pub := e.Pub
		store := inboxStore(t, e.DB)
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()

		// Phase 1: the rejection parks the key; the delivery is acked.
		var deliveries1 deliveryLog
		r1 := leaseStartRouter(t, e, "sms-router", testenv.AMQPSubscriber(t, 0), sender.Handle, &deliveries1)
		require.NoError(t, pub.Publish(e.In, message.NewMessage(rejected, leasePayload(1)), message.NewMessage(other, leasePayload(2))))
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Parked.Load() >= 1 && e.Log.Processed.Load() >= 1 },
			"expected the rejected message parked and the other processed")
		closeRouter(t, r1)
		requireQueueDrained(t, e.In)
		require.Equal(t, int64(2), deliveries1.Total(), "deliveries: the parked message was acked, not nacked and redelivered")
		require.Equal(t, int64(1), e.Log.Parked.Load(), "parked")
		require.Equal(t, int64(1), e.Log.Processed.Load(), "processed")
		require.Zero(t, e.Log.Failed.Load()+e.Log.Duplicates.Load()+e.Log.Busy.Load(), "failed, duplicate or busy")
		evs := e.Log.OfKey(rejected)
		require.Len(t, evs, 1)
		require.Equal(t, exactlyonce.Parked, evs[0].Outcome)
		require.True(t, exactlyonce.IsPermanent(evs[0].Err), "the parked event carries the permanent error: %v", evs[0].Err)
		require.ErrorContains(t, evs[0].Err, "provider answered 422", "the parked event carries the handler's error")

		parked, err := store.Parked(ctx, leaseConsumer, 10)
		require.NoError(t, err)
		require.Len(t, parked, 1, "parked keys")
		require.Equal(t, rejected, parked[0].Key)
		require.Equal(t, 1, parked[0].Attempts)
		require.Contains(t, parked[0].LastError, "422", "the provider's answer is recorded")
		require.Equal(t, 1, provider.Calls(leaseIdemKey(rejected)), "provider calls")
		require.Zero(t, provider.Successes(leaseIdemKey(rejected)), "provider successes")
		require.Empty(t, e.Effects.Attempts(t, rejected), "no business row for a parked key")

		// Phase 2 (a restarted replica): a re-publish of the parked key is
		// acked without running; after Release, the next one runs.
		var deliveries2 deliveryLog
		r2 := leaseStartRouter(t, e, "sms-router", testenv.AMQPSubscriber(t, 0), sender.Handle, &deliveries2)
		publishCopies(t, pub, e.In, rejected, leasePayload(1), 1)
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Parked.Load() >= 2 }, "expected the re-published message acked as parked")
		require.Len(t, sender.Runs(rejected), 1, "a parked key does not run")
		require.Equal(t, 1, provider.Calls(leaseIdemKey(rejected)), "provider calls")

		released, err := store.Release(ctx, leaseConsumer, rejected, inbox.Expect{})
		require.NoError(t, err)
		require.True(t, released, "Release found the parked key")
		publishCopies(t, pub, e.In, rejected, leasePayload(1), 1)
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Processed.Load() >= 2 }, "expected the released key processed")
		closeRouter(t, r2)
		requireQueueDrained(t, e.In)
		require.Equal(t, int64(2), deliveries2.Total(), "deliveries in phase 2")
		require.Equal(t, int64(2), e.Log.Parked.Load(), "parked")
		require.Equal(t, int64(2), e.Log.Processed.Load(), "processed")
		require.Zero(t, e.Log.Failed.Load()+e.Log.Duplicates.Load()+e.Log.Busy.Load(), "failed, duplicate or busy")

		runs := sender.Runs(rejected)
		require.Len(t, runs, 2, "handler runs of the rejected key")
		require.Equal(t, 2, runs[1].Info.Attempt, "the released key runs as attempt 2")
		require.Equal(t, runs[0].Info.IdempotencyKey, runs[1].Info.IdempotencyKey, "with the same idempotency key")
		require.Equal(t, 2, provider.Calls(leaseIdemKey(rejected)), "provider calls")
		require.Equal(t, 1, provider.Successes(leaseIdemKey(rejected)), "provider successes")
		require.Equal(t, 1, provider.Calls(leaseIdemKey(other)), "provider calls of the other message")
		rec, err := store.Get(ctx, leaseConsumer, rejected)
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 2, rec.Attempts)
		require.Empty(t, rec.LastError)
		parked, err = store.Parked(ctx, leaseConsumer, 10)
		require.NoError(t, err)
		require.Empty(t, parked, "parked keys after the release")
		require.Equal(t, []int{2}, e.Effects.Attempts(t, rejected), "business rows of the rejected key")
		require.Equal(t, []int{1}, e.Effects.Attempts(t, other), "business rows of the other key")
		require.ElementsMatch(t, []outboxRow{{Topic: e.Out, UUID: outputUUID(other, 1)}, {Topic: e.Out, UUID: outputUUID(rejected, 2)}},
			outboxRows(t, e.DB), "outbox rows")
	})
}

// TestLeaseSecondCopyWaitsForHolder: a router (the holder) runs a message
// and blocks inside the provider call; a second copy of the message reaches
// another router (the second). The second copy is nacked with ErrLeaseHeld
// (Outcome Nacked) and redelivered, again and again, without running the
// handler, while the holder is in flight. Then:
//
//   - holder_completes: the provider answers 200; the second copy becomes a
//     duplicate and is acked; one provider call.
//   - holder_fails: the provider answers 500; the second copy runs as
//     attempt 2 with the same idempotency key and completes; two calls,
//     one success.
//
// The holder's subscriber drops the messages it nacks, so in holder_fails
// the holder's own copy is gone: only the second copy can complete the key,
// which it can only do if the middleware never acked it while it was busy.
func TestLeaseSecondCopyWaitsForHolder(t *testing.T) {
	t.Parallel()
	for _, dn := range testenv.DriverNames {
		t.Run(dn, func(t *testing.T) {
			t.Parallel()
			for _, holderFails := range []bool{false, true} {
				name := "holder_completes"
				if holderFails {
					name = "holder_fails"
				}
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					leaseRunHolderTest(t, setupE2E(t, testenv.DriverNamed(t, dn)), holderFails)
				})
			}
		})
	}
}

func leaseRunHolderTest(t *testing.T, e *e2e, holderFails bool) {
	provider := testenv.NewProvider(t)
	key := watermill.NewUUID()
	holderStatus := http.StatusOK
	if holderFails {
		holderStatus = http.StatusInternalServerError
	}
	firstCall, release := make(chan struct{}), make(chan struct{})
	provider.OnRequest = func(r *http.Request, _ string, call int) int {
		if call != 1 {
			return http.StatusOK
		}
		close(firstCall)
		select {
		case <-release:
		case <-r.Context().Done():
		case <-time.After(waitTimeout):
		}
		return holderStatus
	}
	sender := newLeaseSender(t, e, provider)
	pub := e.Pub

	// The holder takes the first copy and blocks in the provider call; its
	// prefetch of 1 is used up, so the second copy can only go to the
	// second router.
	var holderDeliveries, secondDeliveries deliveryLog
	holder := leaseStartRouter(t, e, "holder", leaseDroppingSubscriber(t, 1), sender.Handle, &holderDeliveries)
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(unblock) // runs before the routers' cleanups
	publishCopies(t, pub, e.In, key, leasePayload(1), 1)
	waitClosed(t, firstCall, "the holder's provider call")
	second := leaseStartRouter(t, e, "second", testenv.AMQPSubscriber(t, 1), sender.Handle, &secondDeliveries)
	t.Cleanup(unblock)
	publishCopies(t, pub, e.In, key, leasePayload(1), 1)

	// The second copy is nacked as busy, goes back to the queue and is
	// delivered again: twice at least, while the holder is still blocked.
	testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Busy.Load() >= 2 && secondDeliveries.Total() >= 3 },
		"expected the second copy nacked as busy and redelivered")
	require.Len(t, sender.Runs(key), 1, "the handler did not run for the second copy")
	require.Zero(t, e.Log.Settled()+e.Log.Failed.Load()+e.Log.Parked.Load(), "nothing settled while the holder is in flight")
	require.Equal(t, int64(1), holderDeliveries.Total(), "holder deliveries")
	for _, ev := range e.Log.OfKey(key) {
		require.Equal(t, exactlyonce.Nacked, ev.Outcome)
		require.ErrorIs(t, ev.Err, exactlyonce.ErrLeaseHeld)
		require.Equal(t, 1, ev.Attempt, "the busy copy sees the holder's attempt")
	}
	rec := inboxRecord(t, e.DB, leaseConsumer, key)
	require.Equal(t, inboxdb.StatusProcessing, rec.Status)
	require.Equal(t, 1, rec.Attempts)
	require.NotNil(t, rec.LeaseUntil)
	require.True(t, rec.LeaseUntil.After(time.Now()), "the holder's lease is live")
	require.Equal(t, 1, provider.Calls(leaseIdemKey(key)), "provider calls while the holder is in flight")

	unblock()
	if holderFails {
		testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Processed.Load() >= 1 }, "expected the second copy processed")
	} else {
		waitSettled(t, e.Log, 2)
	}
	closeRouter(t, holder)
	closeRouter(t, second)
	requireQueueDrained(t, e.In)
	require.Equal(t, int64(1), holderDeliveries.Total(), "holder deliveries")
	require.Equal(t, int64(1), e.Log.Processed.Load(), "processed")
	busy := e.Log.Busy.Load()

	runs := sender.Runs(key)
	evs := e.Log.OfKey(key)
	if !holderFails {
		require.Equal(t, int64(1), e.Log.Duplicates.Load(), "duplicates")
		require.Zero(t, e.Log.Failed.Load(), "failed")
		require.Equal(t, 2+busy, holderDeliveries.Total()+secondDeliveries.Total(), "deliveries: two copies, plus a redelivery per busy nack")
		// The second copy ends as a duplicate, which the middleware only
		// answers for a record already done: after the holder's completion
		// committed. The events say so by their outcomes, not by their order:
		// the holder's event may be reported after the duplicate's.
		outcomes := map[exactlyonce.Outcome]int{}
		for _, ev := range evs {
			outcomes[ev.Outcome]++
		}
		require.Equal(t, 1, outcomes[exactlyonce.Duplicate], "the second copy ends as a duplicate: %v", outcomes)
		require.Equal(t, 1, outcomes[exactlyonce.Processed], "the holder's completion is reported: %v", outcomes)
		require.Equal(t, len(evs), outcomes[exactlyonce.Duplicate]+outcomes[exactlyonce.Processed]+outcomes[exactlyonce.Nacked], "no other outcome: %v", outcomes)
		require.Len(t, runs, 1, "handler runs")
		require.Equal(t, 1, provider.Calls(leaseIdemKey(key)), "provider calls")
		require.Equal(t, 1, provider.Successes(leaseIdemKey(key)), "provider successes")
		rec = inboxRecord(t, e.DB, leaseConsumer, key)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 1, rec.Attempts)
		require.Equal(t, int64(1), rec.Duplicates)
		require.Equal(t, []int{1}, e.Effects.Attempts(t, key), "business rows")
		require.Equal(t, []outboxRow{{Topic: e.Out, UUID: outputUUID(key, 1)}}, outboxRows(t, e.DB), "outbox rows")
		requireExactlyOneOutput(t, e.DB, e.Out, outputUUID(key, 1))
		return
	}
	require.Equal(t, int64(1), e.Log.Failed.Load(), "the holder's attempt failed")
	require.Zero(t, e.Log.Duplicates.Load(), "duplicates")
	require.Equal(t, 2+busy, holderDeliveries.Total()+secondDeliveries.Total(), "deliveries: two copies, plus a redelivery per busy nack")
	// The holder's failure frees the key when it commits; its event may be
	// reported after the second copy, redelivered meanwhile, completed: the
	// order of the two events is not the order of the commits.
	var done *timedEvent
	for i := range evs {
		if evs[i].Outcome == exactlyonce.Processed {
			done = &evs[i]
		}
	}
	require.NotNil(t, done, "the second copy's completion is reported")
	require.Equal(t, 2, done.Attempt, "the second copy completes attempt 2")
	require.Len(t, runs, 2, "handler runs")
	require.Equal(t, leaseRun{Info: exactlyonce.Info{Consumer: leaseConsumer, Key: key, IdempotencyKey: leaseIdemKey(key), Attempt: 1,
		LeaseUntil: runs[0].Info.LeaseUntil}, Handler: "holder"}, runs[0])
	require.Equal(t, leaseRun{Info: exactlyonce.Info{Consumer: leaseConsumer, Key: key, IdempotencyKey: leaseIdemKey(key), Attempt: 2,
		LeaseUntil: runs[1].Info.LeaseUntil}, Handler: "second"}, runs[1],
		"the second copy runs attempt 2 with the same idempotency key, not interrupted")
	require.Equal(t, 2, provider.Calls(leaseIdemKey(key)), "provider calls")
	require.Equal(t, 1, provider.Successes(leaseIdemKey(key)), "provider successes")
	rec = inboxRecord(t, e.DB, leaseConsumer, key)
	require.Equal(t, inboxdb.StatusDone, rec.Status)
	require.Equal(t, 2, rec.Attempts)
	require.Empty(t, rec.LastError)
	require.Equal(t, []int{2}, e.Effects.Attempts(t, key), "business rows")
	require.Equal(t, []outboxRow{{Topic: e.Out, UUID: outputUUID(key, 2)}}, outboxRows(t, e.DB), "outbox rows")
	requireExactlyOneOutput(t, e.DB, e.Out, outputUUID(key, 2))
}
