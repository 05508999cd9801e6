package testenv

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// RedisURL is $REDIS_URL, or the loopback default.
func RedisURL() string {
	if u := os.Getenv("REDIS_URL"); u != "" {
		return u
	}
	return "redis://127.0.0.1:6379/0"
}

// Redis returns a client of the test Redis, closed at cleanup. The test
// fails (never skips) when Redis does not answer.
func Redis(t testing.TB) *redis.Client {
	t.Helper()
	opts, err := redis.ParseURL(RedisURL())
	require.NoError(t, err, "REDIS_URL")
	c := redis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, c.Ping(ctx).Err(), "Redis at "+RedisURL()+" (is it running? `make services` starts it; REDIS_URL overrides the loopback default)")
	return c
}

// RedisPrefix returns a key prefix of the test's own ("eo_test:<test
// name>_<random>:") and deletes every key under it at cleanup.
func RedisPrefix(t testing.TB, c redis.UniversalClient) string {
	t.Helper()
	prefix := "eo_test:" + Unique(t, "") + ":"
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := DeleteRedisKeys(ctx, c, prefix); err != nil {
			t.Errorf("deleting the Redis keys under %s: %v", prefix, err)
		}
	})
	return prefix
}

// DeleteRedisKeys deletes every key that starts with prefix (SCAN, then
// UNLINK in batches).
func DeleteRedisKeys(ctx context.Context, c redis.UniversalClient, prefix string) error {
	iter := c.Scan(ctx, 0, escapeGlob(prefix)+"*", 1000).Iterator()
	var batch []string
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == 500 {
			if err := c.Unlink(ctx, batch...).Err(); err != nil {
				return err
			}
			batch = batch[:0]
		}
	}
	if err := iter.Err(); err != nil {
		return err
	}
	if len(batch) > 0 {
		return c.Unlink(ctx, batch...).Err()
	}
	return nil
}

// RedisKeys returns the keys that start with prefix.
func RedisKeys(t testing.TB, c redis.UniversalClient, prefix string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	keys, err := c.Keys(ctx, escapeGlob(prefix)+"*").Result()
	require.NoError(t, err)
	return keys
}

// escapeGlob escapes the glob characters of Redis's MATCH patterns.
func escapeGlob(s string) string {
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '*', '?', '[', ']', '\\':
			out = append(out, '\\')
		}
		out = append(out, s[i])
	}
	return string(out)
}
