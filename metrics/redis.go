package metrics

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// ParkedKeyCounter counts the parked keys of a consumer of a lease-mode
// store without an inbox table. redisstore.Store implements it; the
// metrics package does not import Redis (only redisstore does).
type ParkedKeyCounter interface {
	CountParkedKeys(ctx context.Context, consumer string) (int64, error)
}

// WatchRedisStore exports the parked keys of each of consumers (at least
// one: the Redis store keeps parked keys per consumer) of store, a
// redisstore.Store: the Redis counterpart of WatchInbox's
// exactlyonce_inbox_rows{status="parked"}. Counting reads every member of
// a consumer's parked set, so it runs at most once per
// Config.InboxInterval, during a scrape and bounded by
// Config.ScrapeTimeout; scrapes in between export the cached result. A
// count that fails increments exactlyonce_redis_scrape_errors_total, is
// logged, and the gauges are left out until a count succeeds. A second
// call replaces the first.
func (m *Metrics) WatchRedisStore(store ParkedKeyCounter, consumers ...string) error {
	if store == nil {
		return errors.New("metrics: WatchRedisStore: nil store")
	}
	if len(consumers) == 0 {
		return errors.New("metrics: WatchRedisStore: no consumer named")
	}
	for _, c := range consumers {
		if c == "" {
			return errors.New("metrics: WatchRedisStore: empty consumer name")
		}
	}
	m.redis.parked.watch(store.CountParkedKeys, consumers)
	return nil
}

// redisCollector exports ParkedKeyCounter.CountParkedKeys, run at most
// once per interval (consumerCache).
type redisCollector struct {
	parked *consumerCache[int64] // consumer -> parked keys

	parkedDesc, scrapeErrors *prometheus.Desc
}

func newRedisCollector(ns string, timeout, interval time.Duration, logger *slog.Logger) *redisCollector {
	return &redisCollector{
		parked: &consumerCache[int64]{timeout: timeout, interval: interval, logger: logger,
			failed: "metrics: counting the Redis store's parked keys failed; the gauges are left out until the next count"},
		parkedDesc: prometheus.NewDesc(prometheus.BuildFQName(ns, "redis", "parked_keys"),
			"Parked keys of the Redis lease store by consumer (waiting for an operator), refreshed at most once per interval.",
			[]string{"consumer"}, nil),
		scrapeErrors: prometheus.NewDesc(prometheus.BuildFQName(ns, "redis", "scrape_errors_total"),
			"Counts of the Redis store's parked keys that failed during a scrape.", nil, nil),
	}
}

func (c *redisCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.parkedDesc
	ch <- c.scrapeErrors
}

func (c *redisCollector) Collect(ch chan<- prometheus.Metric) {
	parked, errs, watched := c.parked.get()
	if !watched {
		return
	}
	for consumer, n := range parked {
		ch <- prometheus.MustNewConstMetric(c.parkedDesc, prometheus.GaugeValue, float64(n), consumer)
	}
	ch <- prometheus.MustNewConstMetric(c.scrapeErrors, prometheus.CounterValue, float64(errs))
}
