package metrics_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/metrics"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// opsDir holds the dashboard, the alert rules and their unit tests.
const opsDir = "../docs/operations"

var opsFiles = []string{"grafana-dashboard.json", "alerts.yml", "alerts_test.yml"}

// promtool returns the path of promtool. Without it the test is skipped
// with the install hint, except in CI (CI=true), where it fails: CI must
// check the rules.
func promtool(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("promtool")
	if err == nil {
		return path
	}
	const hint = "promtool is not installed: `make services` installs it on Debian/Ubuntu " +
		"(apt-get install --no-install-recommends prometheus), or get it from https://prometheus.io/download/"
	if os.Getenv("CI") == "true" {
		t.Fatal("CI=true: the alert rules must be checked, but " + hint)
	}
	t.Skip(hint)
	return ""
}

func runPromtool(t *testing.T, args ...string) {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	cmd.Dir = opsDir
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	t.Logf("promtool %s:\n%s", strings.Join(args, " "), out)
}

func TestPromtoolCheckRules(t *testing.T) {
	t.Parallel()
	runPromtool(t, "check", "rules", "alerts.yml")
}

func TestPromtoolTestRules(t *testing.T) {
	t.Parallel()
	runPromtool(t, "test", "rules", "alerts_test.yml")
}

// TestDashboardParses checks that the dashboard is JSON with panels, a
// Prometheus data source variable that every panel and query uses, and a
// query in every panel.
func TestDashboardParses(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(filepath.Join(opsDir, "grafana-dashboard.json"))
	require.NoError(t, err)
	type ds struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	}
	var dash struct {
		Title      string `json:"title"`
		UID        string `json:"uid"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
		Panels []struct {
			Type       string `json:"type"`
			Title      string `json:"title"`
			Datasource *ds    `json:"datasource"`
			Targets    []struct {
				Expr       string `json:"expr"`
				Datasource *ds    `json:"datasource"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(raw, &dash))
	require.NotEmpty(t, dash.Title)
	require.NotEmpty(t, dash.UID)
	var hasVar bool
	for _, v := range dash.Templating.List {
		if v.Name == "datasource" && v.Type == "datasource" && v.Query == "prometheus" {
			hasVar = true
		}
	}
	require.True(t, hasVar, "a Prometheus data source variable named datasource")
	queries := 0
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		require.NotNil(t, p.Datasource, "panel %q", p.Title)
		require.Equal(t, ds{Type: "prometheus", UID: "${datasource}"}, *p.Datasource, "panel %q", p.Title)
		require.NotEmpty(t, p.Targets, "panel %q has no query", p.Title)
		for _, q := range p.Targets {
			require.NotEmpty(t, q.Expr, "panel %q", p.Title)
			require.NotNil(t, q.Datasource, "panel %q", p.Title)
			require.Equal(t, "${datasource}", q.Datasource.UID, "panel %q", p.Title)
			queries++
		}
	}
	require.Greater(t, queries, 10)
}

// exported is what a registry fed with every kind of event and every
// source exports: metric name -> label name -> values.
type exported map[string]map[string]map[string]bool

// everything returns the series of Metrics that saw one event of each
// outcome and reason, a relay, an outbox, an inbox and a purge.
func everything(t *testing.T) exported {
	t.Helper()
	db := testenv.Schema(t)
	m, reg := newMetrics(t, metrics.Config{})

	reasons := []error{
		exactlyonce.ErrInvalidKey, exactlyonce.ErrDBUnavailable, exactlyonce.ErrClaimFailed, exactlyonce.ErrLeaseHeld,
		exactlyonce.ErrLeaseLost, exactlyonce.ErrNoDestination, middleware.RecoveredPanicError{V: "boom"}, errors.New("handler"),
	}
	for _, err := range reasons {
		m.OnEvent(exactlyonce.Event{Outcome: exactlyonce.Nacked, Consumer: "c", Err: fmt.Errorf("exactlyonce: %w", err), ClaimDuration: time.Millisecond})
	}
	for _, o := range []exactlyonce.Outcome{exactlyonce.Processed, exactlyonce.Duplicate, exactlyonce.FailOpen} {
		m.OnEvent(exactlyonce.Event{Outcome: o, Consumer: "c", Duration: time.Millisecond, ClaimDuration: time.Millisecond})
	}
	m.OnEvent(exactlyonce.Event{Outcome: exactlyonce.Parked, Consumer: "c", Err: errors.New("permanent")})
	m.OnEvent(exactlyonce.Event{Outcome: exactlyonce.Processed, Consumer: "c", Attempt: 2, Interrupted: true})
	m.OnEvent(exactlyonce.Event{Outcome: exactlyonce.Processed, Consumer: "c", BatchSize: 8, BatchFirst: true})

	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: &flaky{}, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	require.NoError(t, m.WatchRelay(relay))
	require.NoError(t, m.WatchOutbox(db))
	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	require.NoError(t, m.WatchInbox(store, "c"))
	rdb := testenv.Redis(t)
	rstore, err := redisstore.New(redisstore.Config{Client: rdb, Prefix: testenv.RedisPrefix(t, rdb)})
	require.NoError(t, err)
	require.NoError(t, m.WatchRedisStore(rstore, "c"))
	m.ObservePurge(3)

	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := exported{}
	add := func(name string, labels map[string]string) {
		if out[name] == nil {
			out[name] = map[string]map[string]bool{}
		}
		for k, v := range labels {
			if out[name][k] == nil {
				out[name][k] = map[string]bool{}
			}
			out[name][k][v] = true
		}
	}
	for _, mf := range mfs {
		for _, mm := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range mm.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			add(mf.GetName(), labels)
			if mm.Histogram != nil {
				add(mf.GetName()+"_count", labels)
				add(mf.GetName()+"_sum", labels)
				add(mf.GetName()+"_bucket", merge(labels, map[string]string{"le": "+Inf"}))
			}
		}
	}
	return out
}

func merge(a, b map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}

var (
	metricRef = regexp.MustCompile(`\bexactlyonce_[a-z0-9_]+`)
	selector  = regexp.MustCompile(`\b(exactlyonce_[a-z0-9_]+)\{([^}]*)\}`)
	matcher   = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"`)
)

// labelsOfScrape are added by Prometheus, not by the package.
var labelsOfScrape = map[string]bool{"job": true, "instance": true, "le": true}

// TestOperationsFilesUseExportedMetrics fails when the dashboard, the alert
// rules or their tests name a metric the package does not export, a label
// it does not set, or an outcome, reason or status value it never reports:
// a renamed metric cannot leave them silently empty.
func TestOperationsFilesUseExportedMetrics(t *testing.T) {
	t.Parallel()
	have := everything(t)
	var all []string
	for name := range have {
		all = append(all, name)
	}
	sort.Strings(all)
	t.Logf("exported: %s", strings.Join(all, " "))
	// The families exported are the ones documented, in the package doc
	// and in docs/operations.md.
	var families []string
	for _, name := range all {
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_count"), "_sum")
		if _, hist := have[base+"_bucket"]; hist && base != name {
			continue
		}
		families = append(families, name)
	}
	for file, pattern := range map[string]*regexp.Regexp{
		"doc.go":                regexp.MustCompile(`(?m)^//\s+(exactlyonce_[a-z0-9_]+)`),
		"../docs/operations.md": regexp.MustCompile("(?m)^\\| `(exactlyonce_[a-z0-9_]+)"),
	} {
		raw, err := os.ReadFile(file)
		require.NoError(t, err)
		var documented []string
		for _, m := range pattern.FindAllStringSubmatch(string(raw), -1) {
			documented = append(documented, m[1])
		}
		sort.Strings(documented)
		require.Equal(t, families, documented, "the metrics documented in %s", file)
	}

	used := map[string]bool{}
	for _, f := range opsFiles {
		raw, err := os.ReadFile(filepath.Join(opsDir, f))
		require.NoError(t, err)
		text := string(raw)
		for _, name := range metricRef.FindAllString(text, -1) {
			require.Contains(t, have, name, "%s names %s, which the metrics package does not export", f, name)
			used[name] = true
		}
		for _, sel := range selector.FindAllStringSubmatch(text, -1) {
			name, matchers := sel[1], sel[2]
			for _, mt := range matcher.FindAllStringSubmatch(matchers, -1) {
				label, op, value := mt[1], mt[2], mt[3]
				if labelsOfScrape[label] {
					continue
				}
				values, ok := have[name][label]
				require.True(t, ok, "%s: %s has no label %q", f, name, label)
				if strings.Contains(value, "$") || op == "!=" || op == "!~" || value == ".*" {
					continue // a dashboard variable, or a negative match
				}
				for _, v := range strings.Split(value, "|") {
					if label == "consumer" {
						continue // the user's names
					}
					require.True(t, values[v], "%s: %s{%s%s%q}: the package never reports %s=%q (it does: %v)", f, name, label, op, value, label, v, values)
				}
			}
		}
	}
	// And the other way: the operations files cover every family.
	for _, name := range all {
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_count"), "_sum")
		if used[name] || used[base+"_bucket"] || used[base+"_count"] {
			continue
		}
		if _, hist := have[base+"_bucket"]; hist {
			continue
		}
		require.Fail(t, "not on the dashboard", "%s is exported but neither the dashboard nor the alerts use it", name)
	}
}

// TestCorePackagesDoNotImportPrometheus: a service that does not use this
// package must not pull Prometheus in through the library's core.
func TestCorePackagesDoNotImportPrometheus(t *testing.T) {
	t.Parallel()
	goTool, err := exec.LookPath("go")
	require.NoError(t, err, "the go command, to list the core packages' dependencies")
	core := []string{"./exactlyonce", "./inbox", "./outbox", "./sqlschema", "./rabbitmq"}
	cmd := exec.Command(goTool, append([]string{"list", "-deps"}, core...)...)
	cmd.Dir = ".."
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go list: %s", out)
	for _, dep := range strings.Fields(string(out)) {
		require.False(t, strings.HasPrefix(dep, "github.com/prometheus/"), "a core package depends on %s", dep)
		require.NotEqual(t, "github.com/exactlyonce/watermill-exactlyonce/metrics", dep, "a core package imports metrics")
	}
}
