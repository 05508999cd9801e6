package metrics_test

import (
	"fmt"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/metrics"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// newMetrics returns Metrics on a registry of their own.
func newMetrics(t testing.TB, cfg metrics.Config) (*metrics.Metrics, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	cfg.Registerer = reg
	m, err := metrics.New(cfg)
	require.NoError(t, err)
	return m, reg
}

// scrape gathers reg into series -> value, with the series written as in
// the text format with sorted labels: `name{a="x",b="y"}`, and for a
// histogram its _count and _sum series (buckets are left out).
func scrape(t testing.TB, reg prometheus.Gatherer) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			sort.Strings(labels)
			suffix := ""
			if len(labels) > 0 {
				suffix = "{" + strings.Join(labels, ",") + "}"
			}
			name := mf.GetName()
			switch {
			case m.Counter != nil:
				out[name+suffix] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[name+suffix] = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[name+"_count"+suffix] = float64(m.GetHistogram().GetSampleCount())
				out[name+"_sum"+suffix] = m.GetHistogram().GetSampleSum()
			default:
				t.Fatalf("unexpected metric type of %s", name)
			}
		}
	}
	return out
}

// withPrefix keeps the series of s whose name starts with one of prefixes.
func withPrefix(s map[string]float64, prefixes ...string) map[string]float64 {
	out := map[string]float64{}
	for k, v := range s {
		for _, p := range prefixes {
			if strings.HasPrefix(k, p) {
				out[k] = v
			}
		}
	}
	return out
}
