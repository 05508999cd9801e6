package redisstore_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// parkWith parks (consumer, key) through the lease backend as the
// middleware does, keeping msg.
func (b parkedBundle) parkWith(t *testing.T, consumer, key, reason string, msg *inboxdb.ParkedMessage) {
	t.Helper()
	lb := leasestore.BackendOf(b.s)
	c, err := lb.Claim(b.ctx, consumer, key, leasestore.Options{Lease: time.Minute, Message: msg})
	require.NoError(t, err)
	require.Equal(t, leasestore.Acquired, c.Outcome)
	require.NoError(t, lb.Fail(b.ctx, leasestore.Attempt{Consumer: consumer, Key: key, Token: c.Token, Message: msg}, reason, true))
}

// takeAndFail is a delivery of a released key that fails transiently.
func (b parkedBundle) takeAndFail(t *testing.T, consumer, key, reason string, msg *inboxdb.ParkedMessage) {
	t.Helper()
	lb := leasestore.BackendOf(b.s)
	c, err := lb.Claim(b.ctx, consumer, key, leasestore.Options{Lease: time.Minute, Message: msg})
	require.NoError(t, err)
	require.Equal(t, leasestore.Acquired, c.Outcome)
	require.NoError(t, lb.Fail(b.ctx, leasestore.Attempt{Consumer: consumer, Key: key, Token: c.Token, Message: msg}, reason, false))
}

// unknownOutcome is a publisher whose publish reaches the broker but
// reports an error (a confirm that never came); during runs meanwhile.
type unknownOutcome struct{ during func() }

func (p unknownOutcome) Publish(string, ...*message.Message) error {
	p.during()
	return errors.New("no confirm (outcome unknown)")
}
func (p unknownOutcome) Close() error { return nil }

// A replay whose publish reported an error although its copy was taken
// (the consumer failed on it transiently: the record is failed, with the
// DoneTTL expiry) must not park the key again: that parked record would
// expire with its message, never replayed nor discarded, and the copy's
// redelivery would be acknowledged as parked instead of running.
func TestAbortedReplayDoesNotReparkAKeyADeliveryTook(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{DoneTTL: time.Hour})
	msg := &inboxdb.ParkedMessage{UUID: "u-1", Topic: "orders", Payload: []byte("p"), Metadata: map[string]string{"order_id": "A-1"}}
	b.parkWith(t, "c", "k", "card declined", msg)

	pub := unknownOutcome{during: func() { b.takeAndFail(t, "c", "k", "db down", msg) }}
	_, err := b.s.ReplayParked(b.ctx, "c", "k", pub, inbox.ReplayOptions{})
	require.ErrorContains(t, err, "no confirm")
	require.Equal(t, "failed", b.status(t, "c", "k"), "a delivery took the key since the replay began: it stays released")
	c, err := leasestore.BackendOf(b.s).Claim(b.ctx, "c", "k", leasestore.Options{Lease: time.Minute, Message: msg})
	require.NoError(t, err)
	require.Equal(t, leasestore.Acquired, c.Outcome, "the copy's redelivery runs")

	// Without a delivery meanwhile, the key is parked again, and a parked
	// record never expires.
	b.parkWith(t, "c", "k2", "card declined", msg)
	_, err = b.s.ReplayParked(b.ctx, "c", "k2", unknownOutcome{during: func() {}}, inbox.ReplayOptions{})
	require.ErrorContains(t, err, "(parked again)")
	require.Equal(t, "parked", b.status(t, "c", "k2"))
	ttl, err := b.c.PTTL(b.ctx, b.rec("c", "k2")).Result()
	require.NoError(t, err)
	require.Equal(t, time.Duration(-1), ttl, "a parked record has no expiry")
}

// Store.Parked(consumer, limit) lists limit parked keys even when older
// released keys, whose kept message holds them in the parked set, come
// first.
func TestParkedListsParkedKeysBehindReleasedOnes(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	msg := &inboxdb.ParkedMessage{UUID: "u", Topic: "orders", Payload: []byte("p"), Metadata: map[string]string{}}
	for _, k := range []string{"old-1", "old-2", "new-3", "new-4"} {
		b.parkWith(t, "c", k, "permanent", msg)
		time.Sleep(2 * time.Millisecond) // distinct first-seen times: the set's order
	}
	for _, k := range []string{"old-1", "old-2"} {
		ok, err := b.s.Release(b.ctx, "c", k, inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
	}
	recs, err := b.s.Parked(b.ctx, "c", 2)
	require.NoError(t, err)
	keys := []string{}
	for _, r := range recs {
		keys = append(keys, r.Key)
	}
	require.Equal(t, []string{"new-3", "new-4"}, keys)
	recs, err = b.s.Parked(b.ctx, "c", 1)
	require.NoError(t, err)
	require.Len(t, recs, 1, "no more than the limit")
}

// Discarding with Forget deletes a key's record only while it waits for an
// operator: not a processing one (its attempt would lose its lease after
// its effect, and the redelivery run again). The done record's case is the
// operator contract's (internal/ops/opstest: DiscardForgetKeepsADoneRecord).
func TestRedisDiscardForgetKeepsAProcessingRecord(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	lb := leasestore.BackendOf(b.s)
	k := "k-processing"
	msg := &inboxdb.ParkedMessage{UUID: "u-" + k, Topic: "orders", Payload: []byte("p"), Metadata: map[string]string{}}
	b.parkWith(t, "c", k, "declined", msg)
	ok, err := b.s.Release(b.ctx, "c", k, inbox.Expect{})
	require.NoError(t, err)
	require.True(t, ok)
	c, err := lb.Claim(b.ctx, "c", k, leasestore.Options{Lease: time.Minute, Message: msg})
	require.NoError(t, err)
	require.Equal(t, leasestore.Acquired, c.Outcome)
	a := leasestore.Attempt{Consumer: "c", Key: k, Token: c.Token, Message: msg}
	n, err := b.s.DiscardParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c", Key: k}, inbox.DiscardOptions{Forget: true})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	_, err = b.s.GetParked(b.ctx, "c", k)
	require.ErrorIs(t, err, inbox.ErrNotParked, "the message is discarded")
	require.NoError(t, lb.Complete(b.ctx, a), "the attempt keeps its lease")
	require.Equal(t, "done", b.status(t, "c", k))
	again, err := lb.Claim(b.ctx, "c", k, leasestore.Options{Lease: time.Minute, Message: msg})
	require.NoError(t, err)
	require.Equal(t, leasestore.Duplicate, again.Outcome, "a later copy is a duplicate")
}

// A released key keeps the reason it was parked for, listed and found by
// it, whatever errors its later attempts meet.
func TestRedisParkedReasonOutlivesLaterAttempts(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	msg := &inboxdb.ParkedMessage{UUID: "u-1", Topic: "orders", Payload: []byte("p"), Metadata: map[string]string{}}
	b.parkWith(t, "c", "k", "card declined", msg)
	ok, err := b.s.Release(b.ctx, "c", "k", inbox.Expect{})
	require.NoError(t, err)
	require.True(t, ok)
	b.takeAndFail(t, "c", "k", "db down", msg)

	m, err := b.s.GetParked(b.ctx, "c", "k")
	require.NoError(t, err)
	require.Equal(t, "card declined", m.Reason)
	require.Equal(t, []string{"k"}, b.find(t, inbox.ParkedFilter{Consumer: "c", Reason: "card declined"}))
	r, err := b.s.Get(b.ctx, "c", "k")
	require.NoError(t, err)
	require.Equal(t, "db down", r.LastError, "the record says what its last attempt met")
}

// batchPublisher is an outbox.BatchPublisher that waits for its context's
// end (a confirm that does not come).
type batchPublisher struct{ batch, plain atomic.Int32 }

func (p *batchPublisher) PublishBatch(ctx context.Context, batch []msgid.TopicMessage) []error {
	p.batch.Add(1)
	<-ctx.Done()
	errs := make([]error, len(batch))
	for i := range errs {
		errs[i] = ctx.Err()
	}
	return errs
}

func (p *batchPublisher) Publish(string, ...*message.Message) error {
	p.plain.Add(1)
	time.Sleep(5 * time.Second) // a publisher's own, longer timeout
	return errors.New("timed out")
}
func (p *batchPublisher) Close() error { return nil }

// A replay's publish through a publisher that takes a context ends with
// Config.ReplayTimeout, before the replay's mark lapses: a second replay
// cannot publish the message while the first still waits for its confirm.
func TestReplayPublishEndsWithReplayTimeout(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{ReplayTimeout: time.Second})
	msg := &inboxdb.ParkedMessage{UUID: "u-1", Topic: "orders", Payload: []byte("p"), Metadata: map[string]string{}}
	b.parkWith(t, "c", "k", "card declined", msg)
	pub := &batchPublisher{}
	_, err := b.s.ReplayParked(b.ctx, "c", "k", pub, inbox.ReplayOptions{})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.EqualValues(t, 1, pub.batch.Load(), "PublishBatch, with the replay's context")
	require.Zero(t, pub.plain.Load())
	require.Equal(t, "parked", b.status(t, "c", "k"))
}

// callbackPublisher accepts every message and runs during on the first.
type callbackPublisher struct {
	publisher
	once   atomic.Bool
	during func()
}

func (p *callbackPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.once.CompareAndSwap(false, true) {
		p.during()
	}
	return p.publisher.Publish(topic, msgs...)
}

// A bulk replay acts on the messages as it found them: one parked again
// since (released, delivered, parked for another reason) no longer matches
// the filter, and is skipped, as the PostgreSQL store skips it.
func TestRedisBulkReplaySkipsAMessageParkedAgainSince(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	msg := func(k string) *inboxdb.ParkedMessage {
		return &inboxdb.ParkedMessage{UUID: "u-" + k, Topic: "orders", Payload: []byte("p"), Metadata: map[string]string{}}
	}
	b.parkWith(t, "c", "k1", "card declined", msg("k1"))
	time.Sleep(2 * time.Millisecond)
	b.parkWith(t, "c", "k2", "card declined", msg("k2"))
	pub := &callbackPublisher{during: func() { // meanwhile, k2 is released, delivered and parked for another reason
		ok, err := b.s.Release(b.ctx, "c", "k2", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		time.Sleep(2 * time.Millisecond)
		b.parkWith(t, "c", "k2", "address invalid", msg("k2"))
	}}
	rep, err := b.s.ReplayParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c", Reason: "card declined"}, pub, inbox.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, inbox.ReplayReport{Replayed: 1, Skipped: 1}, rep)
	sent := pub.messages()
	require.Len(t, sent, 1)
	require.Equal(t, "u-k1", sent[0].uuid)
	m, err := b.s.GetParked(b.ctx, "c", "k2")
	require.NoError(t, err)
	require.Equal(t, "parked", m.Status)
	require.Equal(t, "address invalid", m.Reason)
}
