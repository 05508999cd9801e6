package main

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	exactlyonce "github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// metrics are the notifier's Prometheus metrics, on their own registry.
type metrics struct {
	reg        *prometheus.Registry
	events     *prometheus.CounterVec
	claims     *prometheus.CounterVec
	takeovers  *prometheus.CounterVec
	durations  *prometheus.HistogramVec
	receipts   *prometheus.CounterVec
	duplicates *prometheus.CounterVec // convenience: events{kind="duplicate"}
}

func newMetrics(s *Service) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "exactlyonce_deliveries_total",
			Help: "Deliveries seen by the exactly-once middleware, by consumer and outcome (processed, duplicate, failed, busy, parked, rejected, db_unavailable, claim_failed, fail_open).",
		}, []string{"consumer", "outcome"}),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "exactlyonce_duplicates_blocked_total",
			Help: "Deliveries acked as duplicates without running the handler.",
		}, []string{"consumer"}),
		claims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "exactlyonce_claims_total",
			Help: "Attempts that claimed a key and ran the handler.",
		}, []string{"consumer"}),
		takeovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "exactlyonce_lease_takeovers_total",
			Help: "Lease-mode attempts that took over a key whose previous attempt's lease expired mid-attempt.",
		}, []string{"consumer"}),
		durations: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "exactlyonce_handler_duration_seconds",
			Help:    "Time spent in the middleware and handler per delivery, by outcome.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 12),
		}, []string{"consumer", "outcome"}),
		receipts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "notifier_receipts_total",
			Help: "Delivery-receipt webhooks, by result (applied, duplicate, unknown_notification, invalid).",
		}, []string{"result"}),
	}
	m.reg.MustRegister(m.events, m.duplicates, m.claims, m.takeovers, m.durations, m.receipts,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "exactlyonce_parked_keys",
			Help: "Keys parked for an operator.",
		}, func() float64 {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			st, err := s.store.Stats(ctx, "")
			if err != nil {
				return -1
			}
			return float64(st.Rows["parked"])
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "exactlyonce_outbox_pending",
			Help: "Outbox rows not relayed yet.",
		}, func() float64 {
			p, err := s.pending()
			if err != nil {
				return -1
			}
			return float64(p.Count)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "exactlyonce_outbox_oldest_pending_age_seconds",
			Help: "Age of the oldest unrelayed outbox row (0 when none). Alert on it.",
		}, func() float64 {
			p, err := s.pending()
			if err != nil {
				return -1
			}
			return p.OldestAge.Seconds()
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "exactlyonce_outbox_relayed_total",
			Help: "Messages relayed from the outbox by this process.",
		}, func() float64 {
			if s.relay == nil {
				return 0
			}
			return float64(s.relay.Stats().Relayed)
		}),
	)
	return m
}

// outcome is the metric label of a delivery: the middleware's Outcome,
// with the nacked deliveries split by cause (the sentinel Event.Err wraps).
func outcome(e exactlyonce.Event) string {
	if e.Outcome != exactlyonce.Nacked {
		return string(e.Outcome) // processed, duplicate, parked, fail_open
	}
	switch {
	case errors.Is(e.Err, exactlyonce.ErrInvalidKey):
		return "rejected" // no usable key
	case errors.Is(e.Err, exactlyonce.ErrDBUnavailable) && !errors.Is(e.Err, exactlyonce.ErrLeaseLost) && e.Attempt == 0:
		return "db_unavailable" // before the handler ran
	case errors.Is(e.Err, exactlyonce.ErrClaimFailed):
		return "claim_failed" // any other database error before the handler ran
	case errors.Is(e.Err, exactlyonce.ErrLeaseHeld):
		return "busy" // another worker holds the key's lease
	default:
		return "failed" // the handler, its completion or its outputs failed
	}
}

// observe is the middleware's OnEvent hook.
func (m *metrics) observe(e exactlyonce.Event) {
	label := outcome(e)
	m.events.WithLabelValues(e.Consumer, label).Inc()
	m.durations.WithLabelValues(e.Consumer, label).Observe(e.Duration.Seconds())
	switch label {
	case "duplicate":
		m.duplicates.WithLabelValues(e.Consumer).Inc()
	case "processed", "failed":
		if e.Attempt > 0 { // lease mode: the attempt claimed the key and ran the handler
			m.claims.WithLabelValues(e.Consumer).Inc()
		}
	}
	if e.Interrupted {
		m.takeovers.WithLabelValues(e.Consumer).Inc()
	}
}

func (s *Service) pending() (outbox.Pending, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return outbox.PendingStats(ctx, s.db)
}

// counterValue reads a counter's current value (for the demo's summary).
func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return 0
	}
	return m.GetCounter().GetValue()
}
