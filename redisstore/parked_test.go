package redisstore_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// parkedBundle is what a test of parked messages in Redis works with.
type parkedBundle struct {
	ctx    context.Context
	s      *redisstore.Store
	c      *redis.Client
	prefix string
}

func newParked(t *testing.T, cfg redisstore.Config) parkedBundle {
	t.Helper()
	s, c, prefix := newStore(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return parkedBundle{ctx: ctx, s: s, c: c, prefix: prefix}
}

func (b parkedBundle) rec(consumer, key string) string {
	return b.prefix + "{" + consumer + "}:k:" + key
}

// redisMsg is a parked message to seed, as the middleware keeps it.
type redisMsg struct {
	consumer, key, uuid, topic string
	payload                    string
	notKept                    bool
	meta                       map[string]string
	reason                     string
	ago                        time.Duration
}

// park parks m's key through the lease backend (a Permanent error), then
// writes its message into the record as the middleware does.
func (b parkedBundle) park(t *testing.T, m redisMsg) {
	t.Helper()
	lb := leasestore.BackendOf(b.s)
	claim, err := lb.Claim(b.ctx, m.consumer, m.key, leasestore.Options{Lease: time.Minute})
	require.NoError(t, err)
	require.Equal(t, leasestore.Acquired, claim.Outcome)
	if m.reason == "" {
		m.reason = "permanent"
	}
	require.NoError(t, lb.Fail(b.ctx, leasestore.Attempt{Consumer: m.consumer, Key: m.key, Token: claim.Token}, m.reason, true))
	b.setMessage(t, m)
}

func (b parkedBundle) setMessage(t *testing.T, m redisMsg) {
	t.Helper()
	if m.uuid == "" {
		m.uuid = "uuid-" + m.key
	}
	if m.meta == nil {
		m.meta = map[string]string{}
	}
	meta, err := json.Marshal(m.meta)
	require.NoError(t, err)
	fields := []any{"m_uuid", m.uuid, "m_topic", m.topic, "m_size", len(m.payload), "m_meta", string(meta),
		"parked_at_ms", time.Now().Add(-m.ago).UnixMilli()}
	if !m.notKept {
		fields = append(fields, "m_payload", m.payload)
	}
	require.NoError(t, b.c.HSet(b.ctx, b.rec(m.consumer, m.key), fields...).Err())
}

func (b parkedBundle) status(t *testing.T, consumer, key string) string {
	t.Helper()
	r, err := b.s.Get(b.ctx, consumer, key)
	if err != nil {
		require.ErrorIs(t, err, inbox.ErrNotFound)
		return ""
	}
	return r.Status
}

func (b parkedBundle) inSet(t *testing.T, consumer, key string) bool {
	t.Helper()
	_, err := b.c.ZScore(b.ctx, b.prefix+"{"+consumer+"}:parked", key).Result()
	if errors.Is(err, redis.Nil) {
		return false
	}
	require.NoError(t, err)
	return true
}

func (b parkedBundle) find(t *testing.T, f inbox.ParkedFilter) []string {
	t.Helper()
	page, err := b.s.FindParked(b.ctx, f, inbox.Page{})
	require.NoError(t, err)
	require.Empty(t, page.Next)
	n, err := b.s.CountParked(b.ctx, f)
	require.NoError(t, err)
	require.Equal(t, int64(len(page.Messages)), n, "CountParked agrees with FindParked")
	out := []string{}
	for _, m := range page.Messages {
		out = append(out, m.Key)
	}
	return out
}

// publisher records what it publishes; fail makes Publish fail, block
// makes it wait until the channel is closed.
type publisher struct {
	mu    sync.Mutex
	sent  []published
	fail  error
	block chan struct{}
}

type published struct {
	topic    string
	uuid     string
	payload  string
	metadata map[string]string
}

func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	if p.block != nil {
		<-p.block
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fail != nil {
		return p.fail
	}
	for _, m := range msgs {
		p.sent = append(p.sent, published{topic: topic, uuid: m.UUID, payload: string(m.Payload), metadata: m.Metadata})
	}
	return nil
}

func (p *publisher) Close() error { return nil }

func (p *publisher) messages() []published {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]published(nil), p.sent...)
}

// What the operator contract (internal/ops/opstest: FindParked) does not
// say of the Redis store: a filter needs its consumer; a parked key
// without a message is a key, not a message; a released key's record does
// not expire while it holds its message; a find prunes the parked set of a
// member whose record is gone.
func TestRedisFindParked(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	b.park(t, redisMsg{consumer: "orders", key: "acme:1", topic: "orders.in", payload: `{"n":1}`, ago: 50 * time.Minute})
	b.park(t, redisMsg{consumer: "orders", key: "acme:2", topic: "orders.in", payload: `{"n":2}`, ago: 40 * time.Minute})
	b.park(t, redisMsg{consumer: "orders", key: "globex:3", topic: "orders.in", payload: "three", ago: 30 * time.Minute})
	b.park(t, redisMsg{consumer: "orders", key: "big", topic: "orders.in", payload: "0123456789", notKept: true, ago: 20 * time.Minute})
	// A parked key without a message (parked by an earlier version): a
	// key, not a message.
	claim, err := leasestore.BackendOf(b.s).Claim(b.ctx, "orders", "bare", leasestore.Options{Lease: time.Minute})
	require.NoError(t, err)
	require.NoError(t, leasestore.BackendOf(b.s).Fail(b.ctx, leasestore.Attempt{Consumer: "orders", Key: "bare", Token: claim.Token}, "x", true))

	_, err = b.s.FindParked(b.ctx, inbox.ParkedFilter{}, inbox.Page{})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	require.ErrorContains(t, err, "ParkedFilter.Consumer is required")

	all := []string{"acme:1", "acme:2", "globex:3", "big"}
	require.Equal(t, all, b.find(t, inbox.ParkedFilter{Consumer: "orders"}), "a key without a message is not listed")
	_, err = b.s.GetParked(b.ctx, "orders", "bare")
	require.ErrorIs(t, err, inbox.ErrNotParked)

	// Release keeps the message, and the record does not expire while it
	// holds it.
	ok, err := b.s.Release(b.ctx, "orders", "acme:2", inbox.Expect{})
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, time.Duration(-1), b.c.PTTL(b.ctx, b.rec("orders", "acme:2")).Val())
	parkedKeys, err := b.s.Parked(b.ctx, "orders", 100)
	require.NoError(t, err)
	require.Len(t, parkedKeys, 4, "Parked lists parked keys only (the bare one too)")
	n, err := b.s.CountParkedKeys(b.ctx, "orders")
	require.NoError(t, err)
	require.Equal(t, int64(4), n)

	// A member whose record is gone (a released record that expired) is
	// pruned from the parked set by a find.
	require.NoError(t, b.c.Del(b.ctx, b.rec("orders", "acme:2")).Err())
	require.Equal(t, []string{"acme:1", "globex:3", "big"}, b.find(t, inbox.ParkedFilter{Consumer: "orders"}))
	require.False(t, b.inSet(t, "orders", "acme:2"))
	require.True(t, b.inSet(t, "orders", "bare"), "a parked key stays")
}

// What the operator contract (internal/ops/opstest: ReplayParked) does
// not say of the Redis store: a replay needs a publisher; the replayed
// key's record keeps no message field, leaves the parked set and expires
// as after Release.
func TestRedisReplayParked(t *testing.T) {
	t.Parallel()
	const ttl = time.Hour
	b := newParked(t, redisstore.Config{DoneTTL: ttl})
	b.park(t, redisMsg{consumer: "sms", key: "k1", uuid: "018f-1", topic: "sms.send", payload: `{"to":"+1"}`, reason: "invalid number"})

	pub := &publisher{}
	_, err := b.s.ReplayParked(b.ctx, "sms", "k1", nil, inbox.ReplayOptions{})
	require.ErrorContains(t, err, "nil publisher")
	_, err = b.s.ReplayParked(b.ctx, "sms", "k1", pub, inbox.ReplayOptions{})
	require.NoError(t, err)
	require.False(t, b.inSet(t, "sms", "k1"))
	pttl := b.c.PTTL(b.ctx, b.rec("sms", "k1")).Val()
	require.True(t, pttl > 0 && pttl <= ttl, "%s", pttl)
	fields, err := b.c.HKeys(b.ctx, b.rec("sms", "k1")).Result()
	require.NoError(t, err)
	for _, f := range fields {
		require.NotRegexp(t, "^m_", f, "no message field left")
	}
}

// A released key's message, replayed, leaves a record that expires. The
// refusals and the replays are the operator contract's
// (internal/ops/opstest: ReplayParkedRefusals).
func TestRedisReplayOfAReleasedKeyExpires(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	pub := &publisher{}
	b.park(t, redisMsg{consumer: "c", key: "released", topic: "t", payload: "r"})
	ok, err := b.s.Release(b.ctx, "c", "released", inbox.Expect{})
	require.NoError(t, err)
	require.True(t, ok)
	m, err := b.s.ReplayParked(b.ctx, "c", "released", pub, inbox.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, "failed", m.Status)
	require.Greater(t, b.c.PTTL(b.ctx, b.rec("c", "released")).Val(), time.Duration(0), "expires once its message is gone")
}

// TestRedisReplayParkedPublishFails: a failed publish parks the key again
// with its message; the next replay delivers it.
func TestRedisReplayParkedPublishFails(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	b.park(t, redisMsg{consumer: "c", key: "k", topic: "t", payload: "x"})
	down := errors.New("broker unreachable")
	pub := &publisher{fail: down}
	_, err := b.s.ReplayParked(b.ctx, "c", "k", pub, inbox.ReplayOptions{})
	require.ErrorIs(t, err, down)
	require.ErrorContains(t, err, "parked again")
	require.Equal(t, "parked", b.status(t, "c", "k"))
	m, err := b.s.GetParked(b.ctx, "c", "k")
	require.NoError(t, err)
	require.Equal(t, []byte("x"), m.Payload)
	require.True(t, b.inSet(t, "c", "k"))
	fields, err := b.c.HKeys(b.ctx, b.rec("c", "k")).Result()
	require.NoError(t, err)
	require.NotContains(t, fields, "m_replay", "the mark is removed")

	rep, err := b.s.ReplayParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c", Key: "k"}, pub, inbox.ReplayOptions{})
	require.ErrorIs(t, err, down, "a bulk replay stops at a failed publish")
	require.Zero(t, rep)
	pub.mu.Lock()
	pub.fail = nil
	pub.mu.Unlock()
	_, err = b.s.ReplayParked(b.ctx, "c", "k", pub, inbox.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, pub.messages(), 1)
}

// TestRedisReplayParkedConcurrently: of replays of one message at once,
// one publishes it; the others are refused while it runs, or find it gone.
func TestRedisReplayParkedConcurrently(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	b.park(t, redisMsg{consumer: "c", key: "k", topic: "t", payload: "x"})
	pub := &publisher{block: make(chan struct{})}
	const n = 8
	errs := make([]error, n)
	var refused atomic.Int64
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			_, err := b.s.ReplayParked(b.ctx, "c", "k", pub, inbox.ReplayOptions{})
			errs[i] = err
			if err != nil {
				refused.Add(1)
			}
		})
	}
	// The replays that find the message marked return at once; one waits
	// in Publish. Let it go once the others have been refused.
	require.Eventually(t, func() bool { return refused.Load() == n-1 }, 10*time.Second, 5*time.Millisecond)
	close(pub.block)
	wg.Wait()
	ok := 0
	for _, err := range errs {
		if err == nil {
			ok++
			continue
		}
		require.ErrorIs(t, err, inbox.ErrReplayInProgress)
		require.ErrorIs(t, err, inbox.ErrNotReplayable)
	}
	require.Equal(t, 1, ok)
	require.Len(t, pub.messages(), 1, "published once")
	_, err := b.s.ReplayParked(b.ctx, "c", "k", pub, inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrNotParked)
}

// The Redis store's bulk replay of a consumer's every message needs All
// (the consumer is required, so it is no criterion); the bulk replay
// itself is the operator contract's (internal/ops/opstest:
// ReplayParkedMatching).
func TestRedisReplayParkedMatchingNeedsAll(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	b.park(t, redisMsg{consumer: "c", key: "k", topic: "t", payload: "x"})
	_, err := b.s.ReplayParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c"}, &publisher{}, inbox.ReplayOptions{})
	require.ErrorContains(t, err, "ReplayOptions.All")
}

// What the operator contract (internal/ops/opstest: DiscardParked) does
// not say of the Redis store: a discarded key leaves the parked set, a
// released one's record expires once its message is discarded, and a bulk
// discard of a consumer's every message needs All.
func TestRedisDiscardParked(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	b.park(t, redisMsg{consumer: "c", key: "forget", topic: "t", payload: "x"})
	require.NoError(t, b.s.DiscardParked(b.ctx, "c", "forget", inbox.DiscardOptions{Forget: true}))
	require.False(t, b.inSet(t, "c", "forget"))

	b.park(t, redisMsg{consumer: "c", key: "rel", topic: "t", payload: "x"})
	_, err := b.s.Release(b.ctx, "c", "rel", inbox.Expect{})
	require.NoError(t, err)
	require.True(t, b.inSet(t, "c", "rel"))
	require.NoError(t, b.s.DiscardParked(b.ctx, "c", "rel", inbox.DiscardOptions{}))
	require.False(t, b.inSet(t, "c", "rel"))
	require.Greater(t, b.c.PTTL(b.ctx, b.rec("c", "rel")).Val(), time.Duration(0))

	_, err = b.s.DiscardParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.DiscardOptions{})
	require.ErrorContains(t, err, "DiscardOptions.All")
}
