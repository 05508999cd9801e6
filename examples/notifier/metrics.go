package main

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	eometrics "github.com/exactlyonce/watermill-exactlyonce/metrics"
)

// metrics are the notifier's Prometheus metrics, on their own registry
// (served at /metrics): the library's (the metrics package: deliveries,
// errors by reason, latency, takeovers, the relay, the outbox backlog, the
// inbox by status; names in docs/operations.md) and the notifier's own
// receipts counter.
type metrics struct {
	reg      *prometheus.Registry
	lib      *eometrics.Metrics
	receipts *prometheus.CounterVec
}

// newMetrics registers the library's collectors and the notifier's. The
// outbox backlog is queried at each scrape, the inbox (both consumers) at
// most once per cfg.MetricsInboxInterval; the relay is watched once it
// exists (watchRelay).
func newMetrics(s *Service) (*metrics, error) {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		receipts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "notifier_receipts_total",
			Help: "Delivery-receipt webhooks, by result (applied, duplicate, unknown_notification, invalid).",
		}, []string{"result"}),
	}
	var err error
	m.lib, err = eometrics.New(eometrics.Config{
		Registerer:    m.reg,
		ScrapeTimeout: 2 * time.Second,
		InboxInterval: s.cfg.MetricsInboxInterval,
		Logger:        s.logger,
	})
	if err != nil {
		return nil, err
	}
	if err := m.reg.Register(m.receipts); err != nil {
		return nil, err
	}
	if err := m.lib.WatchOutbox(s.db); err != nil {
		return nil, err
	}
	if err := m.lib.WatchInbox(s.store, sendConsumer, receiptsConsumer); err != nil {
		return nil, err
	}
	return m, nil
}

// counter reads the current value of the counter series name{labels} from
// the registry (for the demo's progress and summary); 0 when absent.
func (m *metrics) counter(name string, labels map[string]string) (float64, error) {
	mfs, err := m.reg.Gather()
	if err != nil {
		return 0, fmt.Errorf("gathering metrics: %w", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, s := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range s.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue series
				}
			}
			return s.GetCounter().GetValue(), nil
		}
	}
	return 0, nil
}
