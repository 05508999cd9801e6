package console

import (
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A bulk action on parked messages acts only on messages its count saw:
// the count answers the store's time (as_of), the action carries it and
// selects no message parked after it. The same number of other messages
// (one replayed, another parked since) is refused, nothing done; a
// relative time in the body (a window that slides) is refused.
func TestParkedBulkActsOnCountedMessagesOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, k := range []string{"k1", "k2", "k3"} {
		e.park("c", k, pmsg{topic: "t", reason: "X boom"})
	}
	c := ok(t, e.get("/eo/api/v1/parked/count?reason=X"))
	require.EqualValues(t, 3, c["count"])
	require.NotEmpty(t, c["as_of"], "the count says when it counted: %v", c)

	// Meanwhile k1 is replayed and k4 parked with the same reason: 3 match.
	ok(t, e.call("POST", "/eo/api/v1/parked/c/k1/replay", nil))
	e.park("c", "k4", pmsg{topic: "t", reason: "X boom"})

	// Without the count's time: refused (it would discard k4, never seen).
	w := e.call("POST", "/eo/api/v1/parked/discard", map[string]any{"reason": "X", "expect": 3, "forget": true})
	apiErr(t, w, http.StatusBadRequest, codeBadFilter)
	require.Equal(t, "parked", e.status("c", "k4"), "k4 is not discarded")

	// With it: 2 of the 3 counted still match; refused, nothing done.
	w = e.call("POST", "/eo/api/v1/parked/discard", map[string]any{"reason": "X", "expect": 3, "forget": true, "as_of": c["as_of"]})
	changed := apiErr(t, w, http.StatusConflict, codeCountChanged)
	require.Contains(t, changed.Message, "2 of the 3")
	require.EqualValues(t, 3, *changed.Count, "k2, k3, k4 match now")
	require.NotNil(t, changed.AsOf)
	require.Nil(t, changed.MaxID)
	for _, k := range []string{"k2", "k3", "k4"} {
		require.Equal(t, "parked", e.status("c", k))
	}

	// Confirming the new count acts on those three, not on a later one.
	e.park("c", "k5", pmsg{topic: "t", reason: "X boom"})
	w = e.call("POST", "/eo/api/v1/parked/discard", map[string]any{"reason": "X", "expect": 3, "forget": true, "as_of": changed.AsOf})
	require.EqualValues(t, 3, ok(t, w)["discarded"])
	for _, k := range []string{"k2", "k3", "k4"} {
		require.Equal(t, "", e.status("c", k), "forgotten")
	}
	require.Equal(t, "parked", e.status("c", "k5"), "parked after the count")

	// A relative time is resolved by the count, and the body takes it so.
	c = ok(t, e.get("/eo/api/v1/parked/count?reason=X&since=1h"))
	since, err := time.Parse(time.RFC3339Nano, c["since"].(string))
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(-time.Hour), since, time.Minute)
	for _, body := range []map[string]any{
		{"reason": "X", "expect": 1, "as_of": c["as_of"], "since": "1h"},
		{"reason": "X", "expect": 1, "as_of": c["as_of"], "before": "0d1m"},
		{"reason": "X", "expect": 1, "as_of": "1m"},
		{"reason": "X", "expect": 1, "as_of": time.Now().Add(time.Hour)},
		{"reason": "X", "expect": 1, "as_of": c["as_of"], "max_id": 3},
	} {
		apiErr(t, e.call("POST", "/eo/api/v1/parked/replay", body), http.StatusBadRequest, codeBadFilter)
	}
	w = e.call("POST", "/eo/api/v1/parked/replay", map[string]any{"reason": "X", "expect": 1, "as_of": c["as_of"], "since": c["since"]})
	require.EqualValues(t, 1, ok(t, w)["replayed"])
	require.Equal(t, "failed", e.status("c", "k5"), "released")
}

// The confirmation page carries the count's time: a message parked after
// the count is not acted on, and a count that shrank under it is refused.
func TestParkedBulkPageCarriesAsOf(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.park("c", "k1", pmsg{topic: "t", reason: "X boom"})
	e.park("c", "k2", pmsg{topic: "t", reason: "X boom"})
	body := page(t, e.call("POST", "/eo/parked/discard", url.Values{"reason": {"X"}}), http.StatusOK)
	require.Equal(t, "This discards 2 messages.", text(t, body, "confirm-count"))
	action, v := form(t, body, "confirm-form")
	require.NotEmpty(t, v.Get("as_of"))

	ok(t, e.call("POST", "/eo/api/v1/parked/c/k1/replay", nil))
	e.park("c", "k3", pmsg{topic: "t", reason: "X boom"})
	body = page(t, e.call("POST", action, v), http.StatusConflict)
	require.Equal(t, "Nothing was done: 1 of the 2 messages you confirmed still match; 2 messages match now. Confirm again with the new count.",
		text(t, body, "count-changed"))
	require.Equal(t, "parked", e.status("c", "k3"))
	_, err := e.store.GetParked(e.ctx, "c", "k3")
	require.NoError(t, err, "k3, parked after the count, is not discarded")

	action, v = form(t, body, "confirm-form")
	e.park("c", "k4", pmsg{topic: "t", reason: "X boom"})
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "Done: Discarded 2 messages.", text(t, body, "result"))
	_, err = e.store.GetParked(e.ctx, "c", "k4")
	require.NoError(t, err, "k4, parked after the second count, is not discarded")
	page(t, e.call("POST", action, url.Values{"reason": {"X"}, "confirmed": {"1"}, "expect": {"1"}}), http.StatusBadRequest)
}
