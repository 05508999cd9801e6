package console

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// A search or count by a condition no index serves (a reason, a tenant or
// a key without the consumer; the Redis store) is refused, 422 too_broad
// with what narrows it, when the other conditions select more than
// Config.MaxScan messages or rows; within the bound it answers. A count
// over Config.MaxCount is refused too; the list pages then show the page,
// "more than N", and no bulk action. Nothing else is affected.
func TestSearchesOverTheirBoundAreRefused(t *testing.T) {
	t.Parallel()
	r := newRedis(t)
	e := newEnv(t, func(c *Config) { c.MaxScan, c.MaxCount, c.Redis = 3, 4, r.store })
	for _, k := range []string{"acme:1", "acme:2", "acme:3", "acme:4"} {
		e.park("big", k, pmsg{topic: "t", reason: "card declined", meta: map[string]string{"order_id": "O-" + k}})
	}
	e.park("small", "acme:9", pmsg{topic: "t", reason: "card declined"})
	e.park("small", "other:1", pmsg{topic: "t", reason: "address"})
	for _, k := range []string{"r1", "r2", "r3", "r4"} {
		r.park(t, e.ctx, "big", k, pmsg{topic: "t", reason: "card declined"})
	}
	r.park(t, e.ctx, "small", "r1", pmsg{topic: "t", reason: "card declined"})
	for i := range 5 {
		e.row("invoices", "q"+itoa(int64(i)), "{}", map[string]string{"order_id": "O-" + itoa(int64(i))}, "quarantined")
	}

	tooBroad := func(path, want string) {
		t.Helper()
		got := apiErr(t, e.get(path), http.StatusUnprocessableEntity, codeTooBroad)
		require.Contains(t, got.Message, want, path)
		if !strings.Contains(path, "redis") {
			require.Regexp(t, `\(Max(Scan|Count)\)`, got.Message, path)
		}
	}
	// Over MaxScan: 6 parked messages (PostgreSQL), 4 in big (Redis), 5 quarantined rows.
	tooBroad("/eo/api/v1/parked?reason=card", "the reason's text, which no index serves, would be checked on more than 3 parked messages")
	tooBroad("/eo/api/v1/parked/count?reason=card", "more than 3")
	tooBroad("/eo/api/v1/parked?tenant=acme", "a tenant without the consumer")
	tooBroad("/eo/api/v1/parked?key=acme:1", "a key without the consumer")
	tooBroad("/eo/api/v1/parked?consumer=big&reason=card", "more than 3")
	tooBroad("/eo/api/v1/parked?store=redis&consumer=big", `consumer "big" has more than 3 parked messages (MaxScan)`)
	tooBroad("/eo/api/v1/parked/count?store=redis&consumer=big&reason=card", `consumer "big" has more than 3`)
	tooBroad("/eo/api/v1/outbox/rows?reason=precondition", "would be checked on more than 3 rows")
	tooBroad("/eo/api/v1/outbox/rows/count?reason=precondition", "more than 3 rows")
	// Over MaxCount: 6 parked messages, 5 quarantined rows.
	tooBroad("/eo/api/v1/parked/count", "more than 4 parked messages match")
	tooBroad("/eo/api/v1/outbox/rows/count", "more than 4 rows match")
	body := page(t, e.get("/eo/parked?reason=card"), http.StatusUnprocessableEntity)
	require.Contains(t, text(t, body, "search-error"), "more than 3 parked messages")

	// Within the bounds: the indexed conditions select 3 at most.
	var list struct{ Messages []parkedJSON }
	decode(t, e.get("/eo/api/v1/parked?consumer=small&reason=CARD"), &list)
	require.Len(t, list.Messages, 1)
	require.Equal(t, "acme:9", list.Messages[0].Key)
	decode(t, e.get("/eo/api/v1/parked?reason=card&meta=order_id:O-acme:2"), &list)
	require.Len(t, list.Messages, 1)
	decode(t, e.get("/eo/api/v1/parked?consumer=small&tenant=acme"), &list)
	require.Len(t, list.Messages, 1)
	require.EqualValues(t, 1, ok(t, e.get("/eo/api/v1/parked/count?consumer=small&reason=card"))["count"])
	require.EqualValues(t, 4, ok(t, e.get("/eo/api/v1/parked/count?consumer=big"))["count"], "a count of MaxCount")
	decode(t, e.get("/eo/api/v1/parked?store=redis&consumer=small&reason=card"), &list)
	require.Len(t, list.Messages, 1)
	var rows struct{ Rows []rowJSON }
	decode(t, e.get("/eo/api/v1/outbox/rows?reason=precondition&meta=order_id:O-1"), &rows)
	require.Len(t, rows.Rows, 1)
	// Indexed searches are not bounded by MaxScan.
	decode(t, e.get("/eo/api/v1/parked?consumer=big"), &list)
	require.Len(t, list.Messages, 4)
	decode(t, e.get("/eo/api/v1/outbox/rows"), &rows)
	require.Len(t, rows.Rows, 5)

	// The list pages: the page, "more than 4", no bulk action.
	body = page(t, e.get("/eo/parked"), http.StatusOK)
	require.Equal(t, 6, strings.Count(body, `<tr class="parked-row">`))
	require.Contains(t, text(t, body, "parked-count"), "More than 4 messages match")
	require.NotContains(t, body, `id="bulk-replay"`)
	body = page(t, e.get("/eo/outbox"), http.StatusOK)
	require.Equal(t, 5, strings.Count(body, `<tr class="outbox-row">`))
	require.Contains(t, text(t, body, "outbox-count"), "More than 4 rows match")
	require.NotContains(t, body, `id="bulk-requeue"`)
	body = page(t, e.get("/eo/parked?consumer=big"), http.StatusOK)
	require.Equal(t, "4 messages match: parked messages in the PostgreSQL inbox with consumer \"big\".", text(t, body, "parked-count"))
	require.Contains(t, body, `id="bulk-replay"`)

	// A bulk action's count is bounded as the count it confirms.
	w := e.call("POST", "/eo/api/v1/parked/discard", map[string]any{"reason": "card", "expect": 5, "as_of": ok(t, e.get("/eo/api/v1/parked/count?consumer=big"))["as_of"]})
	apiErr(t, w, http.StatusUnprocessableEntity, codeTooBroad)
	require.Equal(t, "parked", e.status("big", "acme:1"), "nothing discarded")
}

// Config.MaxConcurrentScans searches by text run at once; one more is
// answered 429 busy with Retry-After, on the API as on the pages, while
// searches an index serves go on; once one ends, the next runs.
func TestConcurrentScansAreBounded(t *testing.T) {
	t.Parallel()
	entered, proceed := make(chan struct{}), make(chan struct{})
	var once sync.Once
	e := newEnv(t, func(c *Config) { c.MaxConcurrentScans = 1 })
	h := e.h.(*handler)
	h.scanning = func() {
		once.Do(func() { // the first search holds its token until the test lets it go
			close(entered)
			<-proceed
		})
	}
	e.park("c", "k1", pmsg{topic: "t", reason: "card declined", meta: map[string]string{"order_id": "A-1"}})
	e.row("invoices", "q1", "{}", nil, "quarantined")

	first := make(chan *httptest.ResponseRecorder)
	go func() { first <- e.get("/eo/api/v1/parked?reason=card") }()
	<-entered

	for _, path := range []string{"/eo/api/v1/parked?reason=card", "/eo/api/v1/parked/count?tenant=acme", "/eo/api/v1/outbox/rows?reason=x",
		"/eo/api/v1/outbox/rows/count?reason=x"} {
		w := e.get(path)
		busy := apiErr(t, w, http.StatusTooManyRequests, codeBusy)
		require.Equal(t, "1", w.Header().Get("Retry-After"), path)
		require.Contains(t, busy.Message, "Config.MaxConcurrentScans", path)
	}
	w := e.get("/eo/parked?" + url.Values{"reason": {"card"}}.Encode())
	page(t, w, http.StatusTooManyRequests)
	require.Equal(t, "1", w.Header().Get("Retry-After"))
	// Searches an index serves take no token.
	var list struct{ Messages []parkedJSON }
	decode(t, e.get("/eo/api/v1/parked?meta=order_id:A-1"), &list)
	require.Len(t, list.Messages, 1)
	require.EqualValues(t, 1, ok(t, e.get("/eo/api/v1/parked/count?consumer=c"))["count"])

	close(proceed)
	decode(t, <-first, &list)
	require.Len(t, list.Messages, 1)
	decode(t, e.get("/eo/api/v1/parked?reason=card"), &list)
	require.Len(t, list.Messages, 1, "the token is back")
}

// Config's bounds: defaults, and negative values refused.
func TestScanBoundsConfig(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	h := e.h.(*handler)
	require.Equal(t, defaultMaxScan, h.cfg.MaxScan)
	require.Equal(t, defaultMaxCount, h.cfg.MaxCount)
	require.Equal(t, defaultMaxConcurrentScans, cap(h.scans))
	for _, c := range []Config{{MaxScan: -1}, {MaxCount: -1}, {MaxConcurrentScans: -1}} {
		c.DB, c.Auth = e.db, BearerToken(testToken)
		_, err := New(c)
		require.ErrorContains(t, err, "must not be negative")
	}
}
