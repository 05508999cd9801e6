package metrics

import (
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"time"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Config configures New. Every field has a default.
type Config struct {
	// Registerer receives the collectors. Defaults to
	// prometheus.DefaultRegisterer. Wrap it (prometheus.WrapRegistererWith)
	// to add constant labels.
	Registerer prometheus.Registerer

	// Namespace is the prefix of every metric name. Defaults to
	// "exactlyonce", the prefix the shipped dashboard and alert rules use.
	Namespace string

	// ScrapeTimeout bounds each database query made during a scrape
	// (WatchOutbox, WatchInbox), and each round of counts of
	// WatchRedisStore. Defaults to 5s.
	ScrapeTimeout time.Duration

	// InboxInterval is the shortest time between two inbox.Store.Stats
	// queries of WatchInbox (and two counts of WatchRedisStore): scrapes
	// in between export the last result. Stats scans the inbox table;
	// keep this well above the scrape interval on a large table. Defaults
	// to 1m.
	InboxInterval time.Duration

	// Logger logs the database queries of a scrape that failed (warning
	// level; each is also counted in a scrape_errors_total counter).
	// Defaults to slog.Default().
	Logger *slog.Logger

	// Outbox, when set, is the database whose outbox backlog New watches,
	// as WatchOutbox(Outbox) does: the same sqlschema.DB as the relay's.
	// Zero (the default): none until WatchOutbox.
	Outbox sqlschema.DB

	// Relays are watched by New, as WatchRelay does for each. Empty (the
	// default): none until WatchRelay.
	Relays []*outbox.Relay
}

// WithDefaults returns a copy of c with empty fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Registerer == nil {
		c.Registerer = prometheus.DefaultRegisterer
	}
	if c.Namespace == "" {
		c.Namespace = "exactlyonce"
	}
	if c.ScrapeTimeout <= 0 {
		c.ScrapeTimeout = 5 * time.Second
	}
	if c.InboxInterval <= 0 {
		c.InboxInterval = time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Metrics holds the collectors. Its methods are safe for concurrent use.
type Metrics struct {
	deliveries       *prometheus.CounterVec
	errors           *prometheus.CounterVec
	deliveryDuration *prometheus.HistogramVec
	claimDuration    *prometheus.HistogramVec
	batchSize        *prometheus.HistogramVec
	takeovers        *prometheus.CounterVec
	parked           *prometheus.CounterVec
	purged           prometheus.Counter

	relay  *relayCollector
	outbox *outboxCollector
	inbox  *inboxCollector
	redis  *redisCollector
}

// Buckets of the duration histograms, in seconds. A delivery includes the
// handler (possibly an external call); a claim is one or two statements.
var (
	deliveryBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}
	claimBuckets    = []float64{.0002, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5}
	// batchBuckets: group commit batches hold 1 to Config.Batch.MaxSize
	// (default 64) deliveries.
	batchBuckets = []float64{1, 2, 4, 8, 16, 32, 64, 128, 256}
)

// New creates the collectors, watches cfg.Outbox and cfg.Relays (as
// WatchOutbox and WatchRelay do), and registers the collectors with
// cfg.Registerer. It returns the registration's error (a name already
// registered, for example by a second New on the same registry) instead
// of panicking, and a watch's error before registering anything.
func New(cfg Config) (*Metrics, error) {
	cfg = cfg.WithDefaults()
	ns := cfg.Namespace
	m := &Metrics{
		deliveries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "deliveries_total",
			Help: "Deliveries seen by the exactly-once middleware, by consumer and outcome (processed, duplicate, parked, nacked, fail_open).",
		}, []string{"consumer", "outcome"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "delivery_errors_total",
			Help: "Deliveries whose error was returned to the router (nacked, or a failed fail-open run), by consumer and reason (invalid_key, db_unavailable, claim_failed, lease_held, lease_lost, no_destination, panic, handler_error).",
		}, []string{"consumer", "reason"}),
		deliveryDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "delivery_duration_seconds",
			Help:    "Time spent in the exactly-once middleware per delivery, handler included, by consumer and outcome.",
			Buckets: deliveryBuckets,
		}, []string{"consumer", "outcome"}),
		claimDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "claim_duration_seconds",
			Help:    "Time of the inbox check (the claim) per delivery that ran one, by consumer.",
			Buckets: claimBuckets,
		}, []string{"consumer"}),
		batchSize: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "batch_size",
			Help:    "Deliveries per group-commit batch (Config.Batch), observed once per batch, by consumer: a sum near the count means no batching happens.",
			Buckets: batchBuckets,
		}, []string{"consumer"}),
		takeovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "lease_takeovers_total",
			Help: "Lease-mode attempts that took over a key whose previous attempt was interrupted (lease expired mid-attempt, or completion failed).",
		}, []string{"consumer"}),
		parked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "keys_parked_total",
			Help: "Keys parked for an operator by this process (a Permanent handler error, too many interrupted attempts, a completion that can never commit).",
		}, []string{"consumer"}),
		purged: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "inbox_purged_rows_total",
			Help: "Inbox records removed by retention purges (inbox.Store.Purge) of this process.",
		}),
		relay:  newRelayCollector(ns),
		outbox: newOutboxCollector(ns, cfg.ScrapeTimeout, cfg.Logger),
		inbox:  newInboxCollector(ns, cfg.ScrapeTimeout, cfg.InboxInterval, cfg.Logger),
		redis:  newRedisCollector(ns, cfg.ScrapeTimeout, cfg.InboxInterval, cfg.Logger),
	}
	// The watches first: a Config New refuses registers nothing.
	if !reflect.ValueOf(cfg.Outbox).IsZero() { // set: WatchOutbox says what is missing
		if err := m.WatchOutbox(cfg.Outbox); err != nil {
			return nil, fmt.Errorf("metrics: New: Config.Outbox: %w", err)
		}
	}
	for i, r := range cfg.Relays {
		if r == nil {
			return nil, fmt.Errorf("metrics: New: Config.Relays[%d] is nil", i)
		}
		_ = m.WatchRelay(r) // fails only for a nil Relay
	}
	cs := []prometheus.Collector{
		m.deliveries, m.errors, m.deliveryDuration, m.claimDuration, m.batchSize, m.takeovers, m.parked,
		m.purged, m.relay, m.outbox, m.inbox, m.redis,
	}
	for i, c := range cs {
		if err := cfg.Registerer.Register(c); err != nil {
			for _, r := range cs[:i] {
				cfg.Registerer.Unregister(r)
			}
			return nil, fmt.Errorf("metrics: registering the collectors: %w", err)
		}
	}
	return m, nil
}

// OnEvent records one delivery. Use it as exactlyonce.Config.OnEvent, or
// call it from your own hook. It is fast and never blocks on I/O.
func (m *Metrics) OnEvent(e exactlyonce.Event) {
	outcome := string(e.Outcome)
	m.deliveries.WithLabelValues(e.Consumer, outcome).Inc()
	m.deliveryDuration.WithLabelValues(e.Consumer, outcome).Observe(e.Duration.Seconds())
	if e.ClaimDuration > 0 {
		m.claimDuration.WithLabelValues(e.Consumer).Observe(e.ClaimDuration.Seconds())
	}
	if e.Err != nil && (e.Outcome == exactlyonce.Nacked || e.Outcome == exactlyonce.FailOpen) {
		m.errors.WithLabelValues(e.Consumer, Reason(e.Err)).Inc()
	}
	if e.Outcome == exactlyonce.Parked && e.Err != nil {
		m.parked.WithLabelValues(e.Consumer).Inc()
	}
	if e.BatchFirst {
		m.batchSize.WithLabelValues(e.Consumer).Observe(float64(e.BatchSize))
	}
	if e.Interrupted {
		m.takeovers.WithLabelValues(e.Consumer).Inc()
	}
}

// Reason returns the reason label of exactlyonce_delivery_errors_total for
// an error the middleware returned: the sentinel it wraps (invalid_key,
// db_unavailable, claim_failed, lease_held, lease_lost, no_destination),
// panic for a recovered handler panic, handler_error for any other error,
// and "" for nil.
func Reason(err error) string {
	var panicked middleware.RecoveredPanicError
	switch {
	case err == nil:
		return ""
	case errors.Is(err, exactlyonce.ErrInvalidKey):
		return "invalid_key"
	case errors.Is(err, exactlyonce.ErrLeaseLost):
		// Before db_unavailable: a lost lease can be found while the
		// database fails too.
		return "lease_lost"
	case errors.Is(err, exactlyonce.ErrLeaseHeld):
		return "lease_held"
	case errors.Is(err, exactlyonce.ErrClaimFailed):
		return "claim_failed"
	case errors.Is(err, exactlyonce.ErrDBUnavailable):
		return "db_unavailable"
	case errors.Is(err, exactlyonce.ErrNoDestination):
		return "no_destination"
	case errors.As(err, &panicked):
		return "panic"
	}
	return "handler_error"
}

// ObservePurge records the progress of a retention purge: deleted is the
// number of inbox records one batch (or partition) removed. Pass it as
// inbox.PurgeOptions.Progress. It adds deleted to
// exactlyonce_inbox_purged_rows_total and sets
// exactlyonce_inbox_last_purge_timestamp_seconds to now, also when deleted
// is 0 (the purge ran and found nothing to remove).
func (m *Metrics) ObservePurge(deleted int64) {
	if deleted > 0 {
		m.purged.Add(float64(deleted))
	}
	m.inbox.purged(time.Now())
}
