package redisstore_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func newStore(t *testing.T, cfg redisstore.Config) (*redisstore.Store, *redis.Client, string) {
	t.Helper()
	c := testenv.Redis(t)
	cfg.Client = c
	cfg.Prefix = testenv.RedisPrefix(t, c)
	s, err := redisstore.New(cfg)
	require.NoError(t, err)
	return s, c, cfg.Prefix
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = c.Close() })
	for _, tc := range []struct {
		cfg  redisstore.Config
		want string
	}{
		{redisstore.Config{}, "Config.Client is required"},
		{redisstore.Config{Client: c, Prefix: "a{b"}, "Config.Prefix"},
		{redisstore.Config{Client: c, Prefix: "a}b"}, "Config.Prefix"},
		{redisstore.Config{Client: c, DoneTTL: time.Millisecond}, "Config.DoneTTL"},
	} {
		_, err := redisstore.New(tc.cfg)
		require.ErrorContains(t, err, tc.want)
	}
	d := redisstore.Config{}.WithDefaults()
	require.Equal(t, "exactlyonce:", d.Prefix)
	require.Equal(t, 7*24*time.Hour, d.DoneTTL)
}

// hashTag is the part of a key Redis Cluster hashes: between the first '{'
// and the first '}' after it, when not empty; else the whole key.
func hashTag(key string) string {
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return key
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j <= 0 {
		return key
	}
	return key[i+1 : i+1+j]
}

// TestKeysOfAConsumerShareASlot: a record and its consumer's parked set
// must hash to one Cluster slot (the park scripts touch both), whatever
// braces the consumer name holds; names that differ only by how they would
// be escaped stay apart.
func TestKeysOfAConsumerShareASlot(t *testing.T) {
	t.Parallel()
	s, c, prefix := newStore(t, redisstore.Config{})
	b := leasestore.BackendOf(s)
	ctx := context.Background()
	consumers := []string{"sms", "a}b", "a%7Db", "}x", "{x}", "{", "50%"}
	for _, consumer := range consumers {
		claim, err := b.Claim(ctx, consumer, "k{1}", leasestore.Options{Lease: time.Minute})
		require.NoError(t, err)
		require.Equal(t, leasestore.Acquired, claim.Outcome, consumer)
		require.NoError(t, b.Fail(ctx, leasestore.Attempt{Consumer: consumer, Key: "k{1}", Token: claim.Token}, "no", true))
	}
	keys := testenv.RedisKeys(t, c, prefix)
	require.Len(t, keys, 2*len(consumers), "a record and a parked set per consumer: %v", keys)
	tags := map[string][]string{}
	for _, k := range keys {
		tags[hashTag(k)] = append(tags[hashTag(k)], k)
	}
	require.Len(t, tags, len(consumers), "one slot per consumer: %v", tags)
	for tag, ks := range tags {
		require.Len(t, ks, 2, "tag %q", tag)
	}
	for _, consumer := range consumers {
		parked, err := s.Parked(ctx, consumer, 10)
		require.NoError(t, err)
		require.Len(t, parked, 1, consumer)
		require.Equal(t, consumer, parked[0].Consumer)
		require.Equal(t, "k{1}", parked[0].Key)
	}
}

// TestDoneTTLIsTheDeduplicationWindow: a done record is a duplicate until
// DoneTTL passed, then it is gone and the key runs again; processing and
// parked records never expire; failed and released ones after DoneTTL.
func TestDoneTTLIsTheDeduplicationWindow(t *testing.T) {
	t.Parallel()
	const ttl = 1500 * time.Millisecond
	s, c, prefix := newStore(t, redisstore.Config{DoneTTL: ttl})
	b := leasestore.BackendOf(s)
	ctx := context.Background()
	opts := leasestore.Options{Lease: time.Minute}
	pttl := func(key string) time.Duration {
		t.Helper()
		d, err := c.PTTL(ctx, prefix+"{c}:k:"+key).Result()
		require.NoError(t, err)
		return d
	}

	claim, err := b.Claim(ctx, "c", "k", opts)
	require.NoError(t, err)
	require.Equal(t, time.Duration(-1), pttl("k"), "a processing record never expires")
	require.NoError(t, b.Complete(ctx, leasestore.Attempt{Consumer: "c", Key: "k", Token: claim.Token}))
	require.True(t, pttl("k") > 0 && pttl("k") <= ttl, "done: expires after DoneTTL (%s)", pttl("k"))
	dup, err := b.Claim(ctx, "c", "k", opts)
	require.NoError(t, err)
	require.Equal(t, leasestore.Duplicate, dup.Outcome)

	failed, err := b.Claim(ctx, "c", "f", opts)
	require.NoError(t, err)
	require.NoError(t, b.Fail(ctx, leasestore.Attempt{Consumer: "c", Key: "f", Token: failed.Token}, "500", false))
	require.Greater(t, pttl("f"), time.Duration(0), "failed: expires")
	again, err := b.Claim(ctx, "c", "f", opts)
	require.NoError(t, err)
	require.Equal(t, 2, again.Attempt)
	require.Equal(t, time.Duration(-1), pttl("f"), "processing again: the expiry is removed")
	require.NoError(t, b.Fail(ctx, leasestore.Attempt{Consumer: "c", Key: "f", Token: again.Token}, "bad number", true))
	require.Equal(t, time.Duration(-1), pttl("f"), "a parked record never expires")

	time.Sleep(ttl + 300*time.Millisecond)
	_, err = s.Get(ctx, "c", "k")
	require.ErrorIs(t, err, inbox.ErrNotFound, "the done record is gone after DoneTTL")
	rerun, err := b.Claim(ctx, "c", "k", opts)
	require.NoError(t, err)
	require.Equal(t, leasestore.Acquired, rerun.Outcome, "a copy after the window runs again")
	require.Equal(t, 1, rerun.Attempt)
	rec, err := s.Get(ctx, "c", "f")
	require.NoError(t, err)
	require.Equal(t, inboxdb.StatusParked, rec.Status, "parked records stay")

	released, err := s.Release(ctx, "c", "f", inbox.Expect{})
	require.NoError(t, err)
	require.True(t, released)
	require.Greater(t, pttl("f"), time.Duration(0), "released (failed): expires")
	released, err = s.Release(ctx, "c", "f", inbox.Expect{})
	require.NoError(t, err)
	require.False(t, released, "only a parked record is released")
}

// TestConcurrentClaimsOneWinner: many workers claim one key at once:
// exactly one acquires it, the others see it busy.
func TestConcurrentClaimsOneWinner(t *testing.T) {
	t.Parallel()
	s, _, _ := newStore(t, redisstore.Config{})
	b := leasestore.BackendOf(s)
	const n = 32
	var wg sync.WaitGroup
	outcomes := make([]leasestore.Outcome, n)
	errs := make([]error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			c, err := b.Claim(context.Background(), "c", "k", leasestore.Options{Lease: time.Minute})
			outcomes[i], errs[i] = c.Outcome, err
		})
	}
	close(start)
	wg.Wait()
	acquired := 0
	for i := range n {
		require.NoError(t, errs[i])
		switch outcomes[i] {
		case leasestore.Acquired:
			acquired++
		case leasestore.Busy:
		default:
			t.Fatalf("unexpected outcome %s", outcomes[i])
		}
	}
	require.Equal(t, 1, acquired)
}

// TestUnreachable: what counts as Redis being unreachable (the middleware's
// ErrDBUnavailable) and what does not (ErrClaimFailed).
func TestUnreachable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	opts := leasestore.Options{Lease: time.Minute}

	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = down.Close() })
	s, err := redisstore.New(redisstore.Config{Client: down})
	require.NoError(t, err)
	_, err = leasestore.BackendOf(s).Claim(ctx, "c", "k", opts)
	require.Error(t, err)
	require.True(t, leasestore.BackendOf(s).Unreachable(err), "connection refused: %v", err)

	closed := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	require.NoError(t, closed.Close())
	s, err = redisstore.New(redisstore.Config{Client: closed})
	require.NoError(t, err)
	_, err = leasestore.BackendOf(s).Claim(ctx, "c", "k", opts)
	require.ErrorIs(t, err, redis.ErrClosed)
	require.False(t, leasestore.BackendOf(s).Unreachable(err), "a closed client is a program error")

	live, c, prefix := newStore(t, redisstore.Config{})
	require.NoError(t, c.Set(ctx, prefix+"{c}:k:k", "not a hash", 0).Err())
	_, err = leasestore.BackendOf(live).Claim(ctx, "c", "k", opts)
	require.Error(t, err, "WRONGTYPE")
	require.False(t, leasestore.BackendOf(live).Unreachable(err), "an error reply: %v", err)
	require.False(t, leasestore.BackendOf(live).Unreachable(errors.New("other")))
	require.False(t, leasestore.BackendOf(live).Unreachable(context.Canceled))
}
