package metrics_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/metrics"
)

func TestReason(t *testing.T) {
	t.Parallel()
	wrap := func(err error) error { return fmt.Errorf("exactlyonce: claim of %q for %q: %w", "k", "c", err) }
	for err, want := range map[error]string{
		wrap(exactlyonce.ErrInvalidKey):    "invalid_key",
		wrap(exactlyonce.ErrDBUnavailable): "db_unavailable",
		wrap(exactlyonce.ErrClaimFailed):   "claim_failed",
		wrap(exactlyonce.ErrLeaseHeld):     "lease_held",
		wrap(exactlyonce.ErrLeaseLost):     "lease_lost",
		wrap(exactlyonce.ErrNoDestination): "no_destination",
		fmt.Errorf("exactlyonce: handler panicked: %w", middleware.RecoveredPanicError{V: "boom"}): "panic",
		errors.New("provider said no"): "handler_error",
		// A lost lease found while the database failed too is a lost lease.
		fmt.Errorf("%w (completion: %w)", exactlyonce.ErrLeaseLost, exactlyonce.ErrDBUnavailable): "lease_lost",
	} {
		require.Equal(t, want, metrics.Reason(err), "%v", err)
	}
	require.Empty(t, metrics.Reason(nil))
}

// TestOnEvent feeds one event of each kind and checks every series it
// touched, and that nothing else moved.
func TestOnEvent(t *testing.T) {
	t.Parallel()
	m, reg := newMetrics(t, metrics.Config{})
	ms := time.Millisecond
	for _, e := range []exactlyonce.Event{
		{Outcome: exactlyonce.Processed, Consumer: "a", Key: "k1", MessageUUID: "u1", Duration: 30 * ms, ClaimDuration: 2 * ms},
		{Outcome: exactlyonce.Processed, Consumer: "a", Key: "k2", Duration: 10 * ms, ClaimDuration: 4 * ms, Attempt: 2, Interrupted: true},
		{Outcome: exactlyonce.Duplicate, Consumer: "a", Key: "k1", Duration: 3 * ms, ClaimDuration: ms},
		{Outcome: exactlyonce.Parked, Consumer: "a", Key: "k3", Duration: 5 * ms, ClaimDuration: ms, Err: exactlyonce.Permanent(errors.New("bad number"))},
		{Outcome: exactlyonce.Parked, Consumer: "a", Key: "k3", Duration: 2 * ms, ClaimDuration: ms}, // parked earlier
		{Outcome: exactlyonce.Nacked, Consumer: "a", Key: "k4", Duration: 9 * ms, ClaimDuration: ms, Err: errors.New("provider timeout")},
		{Outcome: exactlyonce.Nacked, Consumer: "a", Key: "", Duration: ms, Err: fmt.Errorf("x: %w", exactlyonce.ErrInvalidKey)},
		{Outcome: exactlyonce.Nacked, Consumer: "b", Key: "k5", Duration: ms, Err: fmt.Errorf("x: %w", exactlyonce.ErrDBUnavailable)},
		{Outcome: exactlyonce.FailOpen, Consumer: "b", Key: "k6", Duration: 4 * ms},
		{Outcome: exactlyonce.FailOpen, Consumer: "b", Key: "k7", Duration: 4 * ms, Err: errors.New("handler failed")},
	} {
		m.OnEvent(e)
	}
	s := scrape(t, reg)
	require.Equal(t, map[string]float64{
		`exactlyonce_deliveries_total{consumer="a",outcome="processed"}`: 2,
		`exactlyonce_deliveries_total{consumer="a",outcome="duplicate"}`: 1,
		`exactlyonce_deliveries_total{consumer="a",outcome="parked"}`:    2,
		`exactlyonce_deliveries_total{consumer="a",outcome="nacked"}`:    2,
		`exactlyonce_deliveries_total{consumer="b",outcome="nacked"}`:    1,
		`exactlyonce_deliveries_total{consumer="b",outcome="fail_open"}`: 2,
	}, withPrefix(s, "exactlyonce_deliveries_total"))
	require.Equal(t, map[string]float64{
		`exactlyonce_delivery_errors_total{consumer="a",reason="handler_error"}`:  1,
		`exactlyonce_delivery_errors_total{consumer="a",reason="invalid_key"}`:    1,
		`exactlyonce_delivery_errors_total{consumer="b",reason="db_unavailable"}`: 1,
		`exactlyonce_delivery_errors_total{consumer="b",reason="handler_error"}`:  1, // the failed fail-open run
	}, withPrefix(s, "exactlyonce_delivery_errors_total"), "a parked event's Err is not an error returned to the router")
	require.Equal(t, map[string]float64{
		`exactlyonce_claim_duration_seconds_count{consumer="a"}`: 6,
	}, withPrefix(s, "exactlyonce_claim_duration_seconds_count"), "only events that ran a claim")
	require.InDelta(t, 0.010, s[`exactlyonce_claim_duration_seconds_sum{consumer="a"}`], 1e-9)
	require.Equal(t, float64(2), s[`exactlyonce_delivery_duration_seconds_count{consumer="a",outcome="processed"}`])
	require.InDelta(t, 0.040, s[`exactlyonce_delivery_duration_seconds_sum{consumer="a",outcome="processed"}`], 1e-9)
	require.Equal(t, map[string]float64{`exactlyonce_lease_takeovers_total{consumer="a"}`: 1}, withPrefix(s, "exactlyonce_lease_takeovers_total"))
	require.Equal(t, map[string]float64{`exactlyonce_keys_parked_total{consumer="a"}`: 1}, withPrefix(s, "exactlyonce_keys_parked_total"),
		"a key parked now counts, a delivery of a key parked earlier does not")
	require.Equal(t, map[string]float64{`exactlyonce_inbox_purged_rows_total`: 0}, withPrefix(s, "exactlyonce_inbox_"),
		"nothing watched: no inbox gauges, and no purge time before a purge")
	require.Empty(t, withPrefix(s, "exactlyonce_outbox_"))
	require.Empty(t, withPrefix(s, "exactlyonce_relay_"))
}

func TestObservePurge(t *testing.T) {
	t.Parallel()
	m, reg := newMetrics(t, metrics.Config{})
	before := float64(time.Now().UnixNano()) / 1e9
	m.ObservePurge(1000)
	m.ObservePurge(1000)
	m.ObservePurge(17)
	s := scrape(t, reg)
	require.Equal(t, float64(2017), s["exactlyonce_inbox_purged_rows_total"])
	at := s["exactlyonce_inbox_last_purge_timestamp_seconds"]
	require.GreaterOrEqual(t, at, before)
	require.LessOrEqual(t, at, float64(time.Now().UnixNano())/1e9)

	time.Sleep(10 * time.Millisecond)
	m.ObservePurge(0) // a purge that found nothing still ran
	s = scrape(t, reg)
	require.Equal(t, float64(2017), s["exactlyonce_inbox_purged_rows_total"])
	require.Greater(t, s["exactlyonce_inbox_last_purge_timestamp_seconds"], at)
}

func TestNewConfig(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	m, err := metrics.New(metrics.Config{Registerer: reg, Namespace: "shop"})
	require.NoError(t, err)
	m.OnEvent(exactlyonce.Event{Outcome: exactlyonce.Processed, Consumer: "c"})
	require.Contains(t, scrape(t, reg), `shop_deliveries_total{consumer="c",outcome="processed"}`)

	// A second set on the same registry collides: an error, not a panic,
	// and the first set is left as it was.
	_, err = metrics.New(metrics.Config{Registerer: reg, Namespace: "shop"})
	require.Error(t, err)
	require.ErrorContains(t, err, "metrics: registering")
	require.Equal(t, float64(1), scrape(t, reg)[`shop_deliveries_total{consumer="c",outcome="processed"}`])
	// Another namespace fits next to it.
	_, err = metrics.New(metrics.Config{Registerer: reg})
	require.NoError(t, err)

	d := metrics.Config{}.WithDefaults()
	require.Equal(t, prometheus.DefaultRegisterer, d.Registerer)
	require.Equal(t, "exactlyonce", d.Namespace)
	require.Equal(t, 5*time.Second, d.ScrapeTimeout)
	require.Equal(t, time.Minute, d.InboxInterval)
	require.NotNil(t, d.Logger)
}

func TestWatchRejectsNil(t *testing.T) {
	t.Parallel()
	m, _ := newMetrics(t, metrics.Config{})
	require.Error(t, m.WatchRelay(nil))
	require.Error(t, m.WatchInbox(nil))
}
