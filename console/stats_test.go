package console

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A stream of actions does not defeat Config.StatsInterval: an action
// makes the figures stale, but they are computed again at most every
// min(StatsInterval, 5s) for actions (the first action after a quiet
// time shows at once, as TestOverview asserts).
func TestActionsDoNotDefeatStatsInterval(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.StatsInterval = time.Hour })
	keys := []string{"k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8", "k9"}
	for _, k := range keys {
		e.park("c", k, pmsg{topic: "t"})
	}
	var doc overviewJSON
	decode(t, e.get("/eo/api/v1/overview"), &doc)
	e.settle()

	start := time.Now()
	seen := map[time.Time]bool{}
	for _, k := range keys {
		ok(t, e.call(http.MethodPost, "/eo/api/v1/parked/c/"+k+"/discard", nil))
		decode(t, e.get("/eo/api/v1/overview"), &doc)
		e.settle()
		decode(t, e.get("/eo/api/v1/overview"), &doc)
		seen[*doc.AsOf] = true
	}
	allowed := 1 + int(time.Since(start)/(5*time.Second)) + 1
	require.LessOrEqual(t, len(seen), allowed, "computations for %d actions in %s", len(keys), time.Since(start))
}

// After the gap, the next request computes the figures again: no action
// stays unseen.
func TestStaleFiguresAfterTheGap(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.StatsInterval = time.Hour })
	e.h.(*handler).stats.gap = 300 * time.Millisecond
	for _, k := range []string{"k0", "k1", "k2"} {
		e.park("c", k, pmsg{topic: "t"})
	}
	var doc overviewJSON
	parked := func() int64 {
		t.Helper()
		e.get("/eo/api/v1/overview")
		e.settle()
		decode(t, e.get("/eo/api/v1/overview"), &doc)
		return *doc.Consumers[0].ParkedMessages
	}
	require.EqualValues(t, 3, parked())
	start := time.Now()
	ok(t, e.call(http.MethodPost, "/eo/api/v1/parked/c/k0/discard", nil))
	require.EqualValues(t, 2, parked(), "the first action shows at once")
	ok(t, e.call(http.MethodPost, "/eo/api/v1/parked/c/k1/discard", nil))
	if got := parked(); time.Since(start) < 300*time.Millisecond {
		require.EqualValues(t, 2, got, "within the gap: not computed again")
	}
	time.Sleep(300 * time.Millisecond)
	require.EqualValues(t, 1, parked(), "after the gap")
	require.EqualValues(t, 1, parked())
}
