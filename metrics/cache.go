package metrics

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// consumerCache runs fetch for each watched consumer at most once per
// interval, during a scrape and bounded by timeout, and keeps the result
// for the scrapes in between. mu is held during a round, so that
// concurrent scrapes wait for one round instead of running several. On the
// first error a round drops every value (no partial or stale picture),
// counts the failure, logs failed, and waits out the interval too, so that
// a struggling store is not queried at every scrape.
type consumerCache[T any] struct {
	timeout, interval time.Duration
	logger            *slog.Logger
	failed            string // the log message of a failed round

	mu        sync.Mutex
	fetch     func(ctx context.Context, consumer string) (T, error) // nil: nothing watched
	consumers []string
	fetchedAt time.Time
	values    map[string]T // consumer -> value; nil: none to export
	errors    int64
}

// watch replaces what the cache fetches; the next scrape runs a round.
func (c *consumerCache[T]) watch(fetch func(context.Context, string) (T, error), consumers []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.fetch = fetch
	c.consumers = append([]string(nil), consumers...)
	c.fetchedAt = time.Time{}
	c.values = nil
}

// get runs a round when one is due and returns the values to export (nil
// when the last round failed) and the failed rounds so far; watched is
// false when nothing is watched.
func (c *consumerCache[T]) get() (values map[string]T, errors int64, watched bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fetch == nil {
		return nil, 0, false
	}
	if c.fetchedAt.IsZero() || time.Since(c.fetchedAt) >= c.interval {
		c.refresh()
	}
	return c.values, c.errors, true
}

// refresh runs a round. Called with c.mu held.
func (c *consumerCache[T]) refresh() {
	c.fetchedAt = time.Now()
	c.values = nil
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	values := make(map[string]T, len(c.consumers))
	for _, consumer := range c.consumers {
		v, err := c.fetch(ctx, consumer)
		if err != nil {
			c.errors++
			c.logger.Warn(c.failed, "consumer", consumer, "error", err, "next_query_in", c.interval)
			return
		}
		values[consumer] = v
	}
	c.values = values
}
