package metrics

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// WatchRelay exports r's counters (Relay.Stats, read at each scrape). Call
// it once per Relay; the counters of several relays are summed. A Relay
// stays watched for the life of m.
func (m *Metrics) WatchRelay(r *outbox.Relay) error {
	if r == nil {
		return errors.New("metrics: WatchRelay: nil Relay")
	}
	m.relay.mu.Lock()
	defer m.relay.mu.Unlock()
	for _, have := range m.relay.relays {
		if have == r {
			return nil
		}
	}
	m.relay.relays = append(m.relay.relays, r)
	return nil
}

// WatchOutbox exports the backlog of db's outbox table: each scrape runs
// one outbox.Store.Pending query, bounded by Config.ScrapeTimeout. A query
// that fails increments exactlyonce_outbox_scrape_errors_total, is logged
// at warning level, and the outbox gauges are left out of that scrape
// rather than reported with a made-up value. A second call replaces the
// first db. Several instances of a service watching one table report the
// same values: aggregate them with max, not sum.
func (m *Metrics) WatchOutbox(db sqlschema.DB) error {
	if db.Conn == nil {
		return errors.New("metrics: WatchOutbox: DB.Conn is nil")
	}
	if err := db.Validate(); err != nil {
		return err
	}
	store, err := outbox.NewStore(db)
	if err != nil {
		return err
	}
	m.outbox.mu.Lock()
	defer m.outbox.mu.Unlock()
	m.outbox.store = store
	return nil
}

// WatchInbox exports the inbox records by status (inbox.Store.Stats) for
// each of consumers, or for the whole table under consumer="" when none is
// given. Stats scans the table (or the consumer's part of its primary key),
// so it runs at most once per Config.InboxInterval, during a scrape and
// bounded by Config.ScrapeTimeout; scrapes in between export the cached
// result. A query that fails increments
// exactlyonce_inbox_scrape_errors_total, is logged, and the gauges are left
// out until a query succeeds. A second call replaces the first.
func (m *Metrics) WatchInbox(store *inbox.Store, consumers ...string) error {
	if store == nil {
		return errors.New("metrics: WatchInbox: nil Store")
	}
	consumers = append([]string(nil), consumers...)
	if len(consumers) == 0 {
		consumers = []string{""}
	}
	m.inbox.stats.watch(func(ctx context.Context, consumer string) (map[string]int64, error) {
		st, err := store.Stats(ctx, consumer)
		if err != nil {
			return nil, err
		}
		byStatus := make(map[string]int64, len(inboxStatuses))
		for _, s := range inboxStatuses {
			byStatus[s] = 0
		}
		for s, n := range st.Rows {
			byStatus[s] = n
		}
		return byStatus, nil
	}, consumers)
	return nil
}

// relayCollector reads the watched relays' Stats at scrape.
type relayCollector struct {
	mu     sync.Mutex
	relays []*outbox.Relay

	relayed, batches, failedBatches, failedPublishes, quarantined, listening *prometheus.Desc
}

func newRelayCollector(ns string) *relayCollector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(ns, "relay", name), help, nil, nil)
	}
	return &relayCollector{
		relayed:         d("relayed_total", "Messages the outbox relay published and deleted."),
		batches:         d("batches_total", "Relay batches committed that relayed a message or recorded a failure."),
		failedBatches:   d("failed_batches_total", "Relay batches that returned an error (a publish failed, a row was quarantined, or the database failed)."),
		failedPublishes: d("failed_publishes_total", "Messages whose publish by the relay failed (each failure of a row counts; the row is retried)."),
		quarantined:     d("quarantined_total", "Outbox rows the relay quarantined (skipped until outbox.Store.RequeueFailed)."),
		listening:       d("listening", "Watched relays that hold their wake-on-commit LISTEN connection (the others poll; always 0 on MySQL/MariaDB, which has no LISTEN)."),
	}
}

func (c *relayCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.relayed
	ch <- c.batches
	ch <- c.failedBatches
	ch <- c.failedPublishes
	ch <- c.quarantined
	ch <- c.listening
}

func (c *relayCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	relays := append([]*outbox.Relay(nil), c.relays...)
	c.mu.Unlock()
	if len(relays) == 0 {
		return
	}
	var sum outbox.RelayStats
	listening := 0
	for _, r := range relays {
		s := r.Stats()
		if s.Listening {
			listening++
		}
		sum.Relayed += s.Relayed
		sum.Batches += s.Batches
		sum.Failures += s.Failures
		sum.FailedPublishes += s.FailedPublishes
		sum.Quarantined += s.Quarantined
	}
	counter := func(d *prometheus.Desc, v int64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	counter(c.relayed, sum.Relayed)
	counter(c.batches, sum.Batches)
	counter(c.failedBatches, sum.Failures)
	counter(c.failedPublishes, sum.FailedPublishes)
	counter(c.quarantined, sum.Quarantined)
	ch <- prometheus.MustNewConstMetric(c.listening, prometheus.GaugeValue, float64(listening))
}

// outboxCollector runs outbox.Store.Pending at scrape.
type outboxCollector struct {
	timeout time.Duration
	logger  *slog.Logger
	errors  atomic.Int64

	mu    sync.Mutex
	store *outbox.Store // WatchOutbox's

	pending, failing, quarantined, blockedKeys, blocked, oldestAge, scrapeErrors *prometheus.Desc
}

func newOutboxCollector(ns string, timeout time.Duration, logger *slog.Logger) *outboxCollector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(ns, "outbox", name), help, nil, nil)
	}
	return &outboxCollector{
		timeout:      timeout,
		logger:       logger,
		pending:      d("pending_rows", "Outbox rows not relayed yet, quarantined ones included."),
		failing:      d("failing_rows", "Outbox rows not quarantined whose publish failed at least once (retried with backoff)."),
		quarantined:  d("quarantined_rows", "Outbox rows the relay gave up on, skipped until outbox.Store.RequeueFailed."),
		blockedKeys:  d("blocked_keys", "Ordering keys with a failing or quarantined outbox row: their later rows wait until it is published, requeued or discarded."),
		blocked:      d("blocked_rows", "Outbox rows waiting behind a failing or quarantined row of their ordering key."),
		oldestAge:    d("oldest_pending_age_seconds", "Age of the oldest outbox row not quarantined: the relay lag (0 when there is none)."),
		scrapeErrors: d("scrape_errors_total", "Outbox backlog queries (outbox.Store.Pending) that failed during a scrape."),
	}
}

func (c *outboxCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.failing
	ch <- c.quarantined
	ch <- c.blockedKeys
	ch <- c.blocked
	ch <- c.oldestAge
	ch <- c.scrapeErrors
}

func (c *outboxCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	store := c.store
	c.mu.Unlock()
	if store == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	p, err := store.Pending(ctx)
	if err != nil {
		c.errors.Add(1)
		c.logger.Warn("metrics: outbox backlog query failed; the outbox gauges are left out of this scrape", "error", err)
	} else {
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
		}
		gauge(c.pending, float64(p.Count))
		gauge(c.failing, float64(p.Failing))
		gauge(c.quarantined, float64(p.Quarantined))
		gauge(c.blockedKeys, float64(p.BlockedKeys))
		gauge(c.blocked, float64(p.Blocked))
		gauge(c.oldestAge, p.OldestAge.Seconds())
	}
	ch <- prometheus.MustNewConstMetric(c.scrapeErrors, prometheus.CounterValue, float64(c.errors.Load()))
}

// inboxStatuses are the statuses always exported, 0 when absent.
var inboxStatuses = []string{"processing", "done", "failed", "parked", "discarded"}

// inboxCollector exports inbox.Store.Stats, run at most once per interval
// (consumerCache), and the purge progress ObservePurge reports.
type inboxCollector struct {
	lastPurge atomic.Int64                     // Unix nanoseconds; 0 before the first
	stats     *consumerCache[map[string]int64] // consumer -> status -> records

	rowsDesc, scrapeErrors, lastPurgeDesc *prometheus.Desc
}

func newInboxCollector(ns string, timeout, interval time.Duration, logger *slog.Logger) *inboxCollector {
	return &inboxCollector{
		stats: &consumerCache[map[string]int64]{timeout: timeout, interval: interval, logger: logger,
			failed: "metrics: inbox statistics query failed; the inbox gauges are left out until the next query"},
		rowsDesc: prometheus.NewDesc(prometheus.BuildFQName(ns, "inbox", "rows"),
			"Inbox records by consumer and status (processing, done, failed, parked, discarded), refreshed at most once per interval; consumer is empty for the whole table.",
			[]string{"consumer", "status"}, nil),
		scrapeErrors: prometheus.NewDesc(prometheus.BuildFQName(ns, "inbox", "scrape_errors_total"),
			"Inbox statistics queries (inbox.Store.Stats) that failed during a scrape.", nil, nil),
		lastPurgeDesc: prometheus.NewDesc(prometheus.BuildFQName(ns, "inbox", "last_purge_timestamp_seconds"),
			"Unix time of the last progress report of a retention purge of this process.", nil, nil),
	}
}

func (c *inboxCollector) purged(at time.Time) { c.lastPurge.Store(at.UnixNano()) }

func (c *inboxCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.rowsDesc
	ch <- c.scrapeErrors
	ch <- c.lastPurgeDesc
}

func (c *inboxCollector) Collect(ch chan<- prometheus.Metric) {
	if ns := c.lastPurge.Load(); ns != 0 {
		ch <- prometheus.MustNewConstMetric(c.lastPurgeDesc, prometheus.GaugeValue, float64(ns)/1e9)
	}
	rows, errs, watched := c.stats.get()
	if !watched {
		return
	}
	for consumer, byStatus := range rows {
		for status, n := range byStatus {
			ch <- prometheus.MustNewConstMetric(c.rowsDesc, prometheus.GaugeValue, float64(n), consumer, status)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.scrapeErrors, prometheus.CounterValue, float64(errs))
}
