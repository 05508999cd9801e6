package metrics_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/metrics"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

func TestWatchRedisStore(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := testenv.Redis(t)
	store, err := redisstore.New(redisstore.Config{Client: c, Prefix: testenv.RedisPrefix(t, c)})
	require.NoError(t, err)
	b := leasestore.BackendOf(store)
	park := func(consumer, key string) {
		claim, err := b.Claim(ctx, consumer, key, leasestore.Options{Lease: time.Minute})
		require.NoError(t, err)
		require.NoError(t, b.Fail(ctx, leasestore.Attempt{Consumer: consumer, Key: key, Token: claim.Token}, "never", true))
	}
	park("sms", "k1")
	park("sms", "k2")
	park("sms", "k3")
	park("mail", "k1")
	_, err = store.Release(ctx, "sms", "k3", inbox.Expect{})
	require.NoError(t, err)

	m, reg := newMetrics(t, metrics.Config{InboxInterval: time.Hour})
	require.ErrorContains(t, m.WatchRedisStore(store), "no consumer")
	require.ErrorContains(t, m.WatchRedisStore(store, ""), "empty consumer")
	require.ErrorContains(t, m.WatchRedisStore(nil, "sms"), "nil store")
	require.Empty(t, withPrefix(scrape(t, reg), "exactlyonce_redis_"), "nothing watched yet")

	require.NoError(t, m.WatchRedisStore(store, "sms", "mail", "nobody"))
	require.Equal(t, map[string]float64{
		`exactlyonce_redis_parked_keys{consumer="sms"}`:    2,
		`exactlyonce_redis_parked_keys{consumer="mail"}`:   1,
		`exactlyonce_redis_parked_keys{consumer="nobody"}`: 0,
		`exactlyonce_redis_scrape_errors_total`:            0,
	}, withPrefix(scrape(t, reg), "exactlyonce_redis_"))
	park("sms", "k4")
	require.Equal(t, float64(2), scrape(t, reg)[`exactlyonce_redis_parked_keys{consumer="sms"}`], "cached within the interval")

	m2, reg2 := newMetrics(t, metrics.Config{InboxInterval: time.Nanosecond})
	require.NoError(t, m2.WatchRedisStore(store, "sms"))
	require.Equal(t, float64(3), scrape(t, reg2)[`exactlyonce_redis_parked_keys{consumer="sms"}`])

	// A count that fails: counted, the gauges left out.
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { _ = down.Close() })
	bad, err := redisstore.New(redisstore.Config{Client: down})
	require.NoError(t, err)
	m3, reg3 := newMetrics(t, metrics.Config{InboxInterval: time.Hour})
	require.NoError(t, m3.WatchRedisStore(bad, "sms"))
	require.Equal(t, map[string]float64{"exactlyonce_redis_scrape_errors_total": 1}, withPrefix(scrape(t, reg3), "exactlyonce_redis_"))
}
