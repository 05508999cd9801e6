package console

import (
	"html"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// page asserts status and an HTML answer, and returns its body.
func page(t *testing.T, w *httptest.ResponseRecorder, status int) string {
	t.Helper()
	require.Equal(t, status, w.Code, "%s", w.Body)
	require.Equal(t, "text/html; charset=utf-8", w.Header().Get("Content-Type"))
	return w.Body.String()
}

// form returns the action and the hidden fields of the form with id.
func form(t *testing.T, body, id string) (string, url.Values) {
	t.Helper()
	m := regexp.MustCompile(`(?s)<form id="` + id + `" method="post" action="([^"]*)"[^>]*>(.*?)</form>`).FindStringSubmatch(body)
	require.NotNil(t, m, "form#%s in\n%s", id, body)
	v := url.Values{}
	for _, in := range regexp.MustCompile(`<input type="hidden" name="([^"]*)" value="([^"]*)">`).FindAllStringSubmatch(m[2], -1) {
		v.Add(html.UnescapeString(in[1]), html.UnescapeString(in[2]))
	}
	return html.UnescapeString(m[1]), v
}

// text returns the text of the element with id (tags dropped,
// unescaped).
func text(t *testing.T, body, id string) string {
	t.Helper()
	m := regexp.MustCompile(`(?s)<(\w+)[^>]* id="` + id + `"[^>]*>(.*?)</(\w+)>`).FindStringSubmatch(body)
	require.NotNil(t, m, "#%s in\n%s", id, body)
	return strings.TrimSpace(html.UnescapeString(regexp.MustCompile(`<[^>]+>`).ReplaceAllString(m[2], "")))
}

// The overview page: the consumers' table, the outbox's figures, when
// they were computed, the script that refreshes them; the parked count
// links to the parked list.
func TestOverviewPage(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testOverviewPage(t, newEngineEnv(t, b))
	})
}

func testOverviewPage(t *testing.T, e *tenv) {
	e.done("charge-order", "o-1", 4)
	e.park("charge-order", "o-2", pmsg{topic: "orders"})
	e.row("invoices", "u1", "{}", nil, "quarantined")
	body := page(t, e.get("/eo/"), http.StatusOK)
	require.Contains(t, body, `<table id="consumers"`)
	require.Contains(t, body, `<th scope="row">charge-order</th>`)
	require.Contains(t, body, `<td class="n" data-field="done">1</td>`)
	require.Contains(t, body, `<td class="n" data-field="duplicates">4</td>`)
	require.Contains(t, body, `<a class="parked-link" href="/eo/parked?consumer=charge-order">1`)
	require.Contains(t, body, `<dl id="outbox"`)
	require.Regexp(t, `data-field="quarantined"><a href="/eo/outbox">1<`, body)
	require.Contains(t, body, `<time id="as-of" datetime="`)
	require.Contains(t, body, `<script src="/eo/static/console.js" defer></script>`)
	require.Contains(t, body, `<a class="skip" href="#main">Skip to content</a>`)
	require.Contains(t, body, `<main id="main"`)

	w := e.get("/eo/static/console.js", "Authorization", "")
	require.Equal(t, http.StatusOK, w.Code)
	require.Equal(t, "text/javascript; charset=utf-8", w.Header().Get("Content-Type"))
	require.Contains(t, w.Body.String(), `"/api/v1/overview"`)
	require.NotContains(t, w.Body.String(), "innerHTML", "the script writes text, never markup")
}

// The parked list: the search form, the results, the count, the bulk
// forms; bad input is said on the page (400), an unknown consumer lists
// the known ones (404).
func TestParkedPage(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testParkedPage(t, newEngineEnv(t, b))
	})
}

func testParkedPage(t *testing.T, e *tenv) {
	e.park("ship-order", "k1", pmsg{topic: "orders", meta: map[string]string{"order_id": "A-1042"}, reason: "invalid <address>"})
	e.park("ship-order", "k2", pmsg{topic: "orders", meta: map[string]string{"order_id": "A-7"}})
	e.park("ship-order", "k3", pmsg{topic: "orders"})

	body := page(t, e.get("/eo/parked"), http.StatusOK)
	for _, s := range []string{`<form id="parked-search" method="get" action="/eo/parked"`, `name="consumer"`, `name="key"`, `name="uuid"`,
		`name="meta"`, `name="tenant"`, `name="reason"`, `name="since"`, `name="before"`, `name="store"`, `<button type="submit" id="search">`} {
		require.Contains(t, body, s)
	}
	require.Equal(t, 3, strings.Count(body, `<tr class="parked-row">`))
	require.Equal(t, "3 messages match: every parked message in the PostgreSQL inbox.", text(t, body, "parked-count"))
	// Every input has its label.
	for _, in := range regexp.MustCompile(`<input id="([^"]+)"`).FindAllStringSubmatch(body, -1) {
		require.Contains(t, body, `<label for="`+in[1]+`"`, "a label for #%s", in[1])
	}

	body = page(t, e.get("/eo/parked?"+url.Values{"consumer": {"ship-order"}, "meta": {"order_id:A-1042"}, "since": {""}}.Encode()), http.StatusOK)
	require.Equal(t, 1, strings.Count(body, `<tr class="parked-row">`))
	require.Contains(t, body, `<a class="show" href="/eo/parked/ship-order/k1">k1</a>`)
	require.Contains(t, body, `invalid &lt;address&gt;`)
	require.Contains(t, body, `value="order_id:A-1042"`)
	require.Equal(t, `1 message matches: parked messages in the PostgreSQL inbox with consumer "ship-order", metadata "order_id" = "A-1042".`, text(t, body, "parked-count"))
	_, hidden := form(t, body, "bulk-replay")
	require.Equal(t, url.Values{"store": {"postgres"}, "consumer": {"ship-order"}, "meta": {"order_id:A-1042"}}, hidden)
	form(t, body, "bulk-discard")

	body = page(t, e.get("/eo/parked?since=yesterday"), http.StatusBadRequest)
	require.Contains(t, text(t, body, "search-error"), `since is "yesterday"`)
	require.Contains(t, body, `value="yesterday"`, "the form keeps what was typed")
	body = page(t, e.get("/eo/parked?limit=5000"), http.StatusBadRequest)
	require.Contains(t, text(t, body, "search-error"), "at most 1000")
	body = page(t, e.get("/eo/parked?consumer=ship_order"), http.StatusNotFound)
	require.Contains(t, text(t, body, "search-error"), "consumers with records: ship-order")

	// Paging.
	body = page(t, e.get("/eo/parked?limit=2"), http.StatusOK)
	require.Equal(t, 2, strings.Count(body, `<tr class="parked-row">`))
	next := regexp.MustCompile(`<a href="([^"]+)" id="next-page">`).FindStringSubmatch(body)
	require.NotNil(t, next)
	body = page(t, e.get(html.UnescapeString(next[1])), http.StatusOK)
	require.Equal(t, 1, strings.Count(body, `<tr class="parked-row">`))
}

// The message page shows the payload and the metadata escaped (a
// payload holding a script is text), for keys with quotes and unicode;
// a binary payload as base64 with a note.
func TestMessagePage(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testMessagePage(t, newEngineEnv(t, b))
	})
}

func testMessagePage(t *testing.T, e *tenv) {
	odd := `it's "quoted" <b>/ünïcødé ✓ 100%`
	e.park("ship-order", odd, pmsg{topic: "orders", payload: []byte(`<script>alert("payload")</script>`),
		meta: map[string]string{"order_id": `"><img src=x onerror=alert(1)>`, "<script>": "x"}, reason: `<script>alert("reason")</script>`})
	e.park("ship-order", ".", pmsg{topic: "orders", payload: []byte{0xff, 0xfe, 0x00}})
	e.park("ship-order", "big", pmsg{topic: "orders", notKept: true})

	body := page(t, e.get("/eo/parked?consumer=ship-order"), http.StatusOK)
	var links []string
	for _, m := range regexp.MustCompile(`<a class="show" href="([^"]+)">`).FindAllStringSubmatch(body, -1) {
		links = append(links, html.UnescapeString(m[1]))
	}
	require.Len(t, links, 3)
	require.NotContains(t, body, "<script>alert")
	require.NotContains(t, body, "<b>/")

	for _, link := range links {
		body := page(t, e.get(link), http.StatusOK)
		require.NotContains(t, body, "<script>alert", link)
		require.NotContains(t, body, "<img", link)
		switch {
		case strings.Contains(body, "ünïcødé"):
			require.Equal(t, odd, text(t, body, "key"))
			require.Equal(t, `<script>alert("payload")</script>`, text(t, body, "payload"))
			require.Contains(t, body, `&lt;script&gt;alert(&#34;payload&#34;)&lt;/script&gt;`)
			require.Equal(t, `<script>alert("reason")</script>`, text(t, body, "reason"))
			require.Contains(t, body, `<table id="metadata"`)
			require.Contains(t, body, `&#34;&gt;&lt;img src=x onerror=alert(1)&gt;`)
			require.Equal(t, "1", text(t, body, "attempts"))
			require.NotEmpty(t, text(t, body, "parked-at"))
			require.NotEmpty(t, text(t, body, "first-seen"))
			require.Contains(t, text(t, body, "payload-note"), "UTF-8 text")
			action, hidden := form(t, body, "replay-form")
			require.Equal(t, "/eo/parked/ship-order/"+seg(odd)+"/replay", action)
			require.Equal(t, url.Values{"store": {"postgres"}, "version": {hidden.Get("version")}, "uuid": {"uuid-" + odd}}, hidden,
				"the form carries the message it shows")
			require.NotEmpty(t, hidden.Get("version"))
			form(t, body, "discard-form")
		case strings.Contains(body, "not UTF-8"):
			require.Equal(t, ".", text(t, body, "key"))
			require.Equal(t, "//4A", text(t, body, "payload"))
			require.Contains(t, text(t, body, "payload-note"), "shown as base64")
		default:
			require.Contains(t, text(t, body, "payload-note"), "was not kept")
		}
	}
	page(t, e.get("/eo/parked/ship-order/nope"), http.StatusNotFound)
	body = page(t, e.get("/eo/parked/ship_order/nope"), http.StatusNotFound)
	require.Contains(t, body, "Unknown consumer")
	page(t, e.get("/eo/parked/ship-order/k?store=nosuch"), http.StatusBadRequest)
}

// Replay and discard from the pages: the form leads to a confirmation
// that states how many messages the action touches; confirming acts and
// says what was done; a count that changed meanwhile is confirmed again,
// nothing done.
func TestConfirmFlows(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.Auth = BasicAuth("dana", "dana-long-passphrase") })
	auth := func() string {
		r := httptest.NewRequest("GET", "/", nil)
		r.SetBasicAuth("dana", "dana-long-passphrase")
		return r.Header.Get("Authorization")
	}()
	post := func(action string, v url.Values) *httptest.ResponseRecorder {
		return e.call("POST", action, v, "Authorization", auth, "Sec-Fetch-Site", "same-origin")
	}
	get := func(p string) *httptest.ResponseRecorder { return e.get(p, "Authorization", auth) }
	odd := `q"uote/d ✓`
	e.park("ship-order", odd, pmsg{topic: "orders", payload: []byte("{}")})

	// One message: replay.
	body := page(t, get(e.h.(*handler).messageURL("postgres", "ship-order", odd)), http.StatusOK)
	action, v := form(t, body, "replay-form")
	body = page(t, post(action, v), http.StatusOK)
	require.Equal(t, "This replays 1 message.", text(t, body, "confirm-count"))
	require.Contains(t, body, `<button type="submit" id="confirm">Replay 1 message</button>`)
	require.Contains(t, body, `id="cancel"`)
	require.EqualValues(t, 0, e.outboxRows("orders", "uuid-"+odd), "nothing yet")
	action, v = form(t, body, "confirm-form")
	body = page(t, post(action, v), http.StatusOK)
	require.Contains(t, text(t, body, "result"), "Replayed 1 message")
	require.EqualValues(t, 1, e.outboxRows("orders", "uuid-"+odd))
	body = page(t, post(action, v), http.StatusNotFound)
	require.Contains(t, text(t, body, "result"), "Not replayed")
	lines := e.logs.lines(t, "exactlyonce console: action")
	require.Len(t, lines, 1)
	require.Equal(t, "dana", lines[0]["user"])
	require.Equal(t, "parked.replay", lines[0]["action"])

	// One message: discard with forget.
	e.park("ship-order", "k2", pmsg{topic: "orders"})
	body = page(t, get("/eo/parked/ship-order/k2"), http.StatusOK)
	action, v = form(t, body, "discard-form")
	v.Set("forget", "1")
	body = page(t, post(action, v), http.StatusOK)
	require.Equal(t, "This discards 1 message.", text(t, body, "confirm-count"))
	action, v = form(t, body, "confirm-form")
	require.Equal(t, "1", v.Get("forget"))
	body = page(t, post(action, v), http.StatusOK)
	require.Contains(t, text(t, body, "result"), "Discarded 1 message and forgot its key")
	require.Equal(t, "", e.status("ship-order", "k2"))

	// Bulk: the count, then a count that changed, then done.
	for _, k := range []string{"b1", "b2"} {
		e.park("ship-order", k, pmsg{topic: "orders", meta: map[string]string{"batch": "7"}})
	}
	body = page(t, get("/eo/parked?consumer=ship-order&meta=batch:7"), http.StatusOK)
	action, v = form(t, body, "bulk-discard")
	body = page(t, post(action, v), http.StatusOK)
	require.Equal(t, "This discards 2 messages.", text(t, body, "confirm-count"))
	require.Contains(t, text(t, body, "matching"), `metadata "batch" = "7"`)
	action, v = form(t, body, "confirm-form")
	require.Equal(t, "2", v.Get("expect"))
	require.NotEmpty(t, v.Get("as_of"), "the count's time")
	e.park("ship-order", "b3", pmsg{topic: "orders", meta: map[string]string{"batch": "7"}})
	require.NoError(t, e.store.DiscardParked(e.ctx, "ship-order", "b1", inbox.DiscardOptions{}))
	body = page(t, post(action, v), http.StatusConflict)
	require.Contains(t, text(t, body, "count-changed"), "Nothing was done: 1 of the 2 messages you confirmed still match; 2 messages match now.")
	require.Equal(t, "This discards 2 messages.", text(t, body, "confirm-count"))
	n := testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.inner.ParkedTable()+` WHERE metadata @> '{"batch":"7"}'`)
	require.EqualValues(t, 2, n, "nothing discarded")
	action, v = form(t, body, "confirm-form")
	body = page(t, post(action, v), http.StatusOK)
	require.Equal(t, "Done: Discarded 2 messages.", text(t, body, "result"))
	require.Equal(t, "discarded", e.status("ship-order", "b2"), "the keys are discarded, no longer parked")

	// Bulk replay with a relative time: the confirmation carries the
	// absolute time, so its count holds.
	e.park("ship-order", "r1", pmsg{topic: "orders"})
	body = page(t, post("/eo/parked/replay", url.Values{"consumer": {"ship-order"}, "since": {"1h"}, "key": {"r1"}}), http.StatusOK)
	require.Equal(t, "This replays 1 message.", text(t, body, "confirm-count"))
	action, v = form(t, body, "confirm-form")
	require.NotEqual(t, "1h", v.Get("since"))
	require.Contains(t, v.Get("since"), "T")
	body = page(t, post(action, v), http.StatusOK)
	require.Equal(t, "Done: Replayed 1 message.", text(t, body, "result"))
	require.EqualValues(t, 1, e.outboxRows("orders", "uuid-r1"))

	// Nothing matches: nothing to confirm.
	body = page(t, post("/eo/parked/replay", url.Values{"consumer": {"ship-order"}, "key": {"none"}}), http.StatusOK)
	require.Equal(t, "This replays 0 messages.", text(t, body, "confirm-count"))
	require.NotContains(t, body, `id="confirm"`)
	page(t, post("/eo/parked/replay", url.Values{"since": {"soon"}}), http.StatusBadRequest)
	page(t, post("/eo/parked/replay", url.Values{"consumer": {"ship-order"}, "confirmed": {"1"}, "expect": {"many"}}), http.StatusBadRequest)
}

// The outbox pages: figures, search, a row with its payload escaped, and
// requeue and discard through a confirmation.
func TestOutboxPages(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testOutboxPages(t, newEngineEnv(t, b))
	})
}

func testOutboxPages(t *testing.T, e *tenv) {
	id := e.row("invoices", "inv-1", `<script>alert(1)</script>`, map[string]string{"order_id": "A-1"}, "quarantined")
	e.row("invoices", "inv-2", "{}", nil, "quarantined")
	failing := e.row("invoices", "inv-3", "{}", nil, "failing")

	body := page(t, e.get("/eo/outbox"), http.StatusOK)
	require.Contains(t, body, `<form id="outbox-search" method="get" action="/eo/outbox"`)
	require.Contains(t, body, `<table id="outbox-results">`)
	require.Equal(t, 2, strings.Count(body, `<tr class="outbox-row">`))
	require.Contains(t, body, `<a class="show" href="/eo/outbox/rows/`+itoa(id)+`">`)
	require.Contains(t, text(t, body, "outbox-count"), "2 rows match")
	body = page(t, e.get("/eo/outbox?meta=order_id:A-1"), http.StatusOK)
	require.Equal(t, 1, strings.Count(body, `<tr class="outbox-row">`))
	body = page(t, e.get("/eo/outbox?state=failing&since=1h"), http.StatusBadRequest)
	require.Contains(t, text(t, body, "search-error"), "failing rows are not quarantined")

	body = page(t, e.get("/eo/outbox/rows/"+itoa(id)), http.StatusOK)
	require.Equal(t, `<script>alert(1)</script>`, text(t, body, "payload"))
	require.NotContains(t, body, "<script>alert")
	action, v := form(t, body, "requeue-form")
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "This requeues 1 row.", text(t, body, "confirm-count"))
	action, v = form(t, body, "confirm-form")
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "Done: Requeued 1 row.", text(t, body, "result"))
	body = page(t, e.call("POST", action, v), http.StatusConflict)
	require.Contains(t, text(t, body, "result"), "not quarantined")

	body = page(t, e.get("/eo/outbox/rows/"+itoa(failing)), http.StatusOK)
	require.NotContains(t, body, `id="requeue-form"`)
	body = page(t, e.call("POST", "/eo/outbox/rows/"+itoa(failing)+"/discard", nil), http.StatusOK)
	require.Equal(t, "This discards 0 rows.", text(t, body, "confirm-count"))
	require.NotContains(t, body, `id="confirm"`)
	page(t, e.get("/eo/outbox/rows/123456789"), http.StatusNotFound)

	body = page(t, e.get("/eo/outbox"), http.StatusOK)
	action, v = form(t, body, "bulk-discard")
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "This discards 1 row.", text(t, body, "confirm-count"))
	action, v = form(t, body, "confirm-form")
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "Done: Discarded 1 row.", text(t, body, "result"))
	require.EqualValues(t, 0, testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()+` WHERE quarantined_at IS NOT NULL`))
}

// A blocked ordering key on the pages: the overview's and the outbox page's
// figures, the rows' ordering key and the rows waiting behind them, the
// search by key, and a discard by key through a confirmation.
func TestOutboxPagesBlockedKeys(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a1 := e.row("invoices", "A-1", "{}", nil, "quarantined")
	a2 := e.row("invoices", "A-2", "{}", nil, "")
	a3 := e.row("invoices", "A-3", "{}", nil, "")
	e.row("invoices", "free", "{}", nil, "quarantined")
	_, err := e.db.Conn.ExecContext(e.ctx, `UPDATE `+e.db.Outbox()+` SET ordering_key = 'order A&B' WHERE id = ANY($1)`, []int64{a1, a2, a3})
	require.NoError(t, err)
	keyURL := "/eo/outbox?ordering_key=order&#43;A%26B&amp;state=all" // html/template escapes the + too

	body := page(t, e.get("/eo/"), http.StatusOK)
	require.Regexp(t, `data-field="blocked_keys"><a href="/eo/outbox\?state=all">1<`, body)
	require.Contains(t, body, `<dd data-field="blocked_rows">2</dd>`)

	body = page(t, e.get("/eo/outbox"), http.StatusOK)
	require.Equal(t, "1", text(t, body, "blocked-keys"))
	require.Equal(t, "2", text(t, body, "blocked-rows"))
	require.Contains(t, body, `<input id="ordering-key" name="ordering_key" value="">`)
	require.Contains(t, body, `<td class="mono ordering-key"><a href="`+keyURL+`">order A&amp;B</a></td>
<td class="n waiting">2</td>`)
	require.Contains(t, body, `<td class="mono ordering-key">none</td>`)

	body = page(t, e.get("/eo/outbox?ordering_key=order+A%26B"), http.StatusOK)
	require.Equal(t, 1, strings.Count(body, `<tr class="outbox-row">`))
	require.Contains(t, body, `<input id="ordering-key" name="ordering_key" value="order A&amp;B">`)
	require.Contains(t, text(t, body, "outbox-count"), `1 row matches: quarantined outbox rows with ordering key "order A&B"`)

	body = page(t, e.get("/eo/outbox/rows/"+itoa(a1)), http.StatusOK)
	require.Equal(t, "order A&B", text(t, body, "ordering-key"))
	require.Contains(t, body, `<a href="`+keyURL+`">`)
	require.True(t, strings.HasPrefix(text(t, body, "waiting"), "2 (the relay holds them back"), text(t, body, "waiting"))
	body = page(t, e.get("/eo/outbox/rows/"+itoa(a2)), http.StatusOK)
	require.NotContains(t, body, `id="waiting"`, "a row that never failed holds nothing back")

	body = page(t, e.get("/eo/outbox?ordering_key=order+A%26B"), http.StatusOK)
	action, v := form(t, body, "bulk-discard")
	require.Equal(t, "order A&B", v.Get("ordering_key"))
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "This discards 1 row.", text(t, body, "confirm-count"))
	action, v = form(t, body, "confirm-form")
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "Done: Discarded 1 row.", text(t, body, "result"))
	require.EqualValues(t, 1, testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()+` WHERE quarantined_at IS NOT NULL`), "the row without a key is left")
}

// The inbox lookup: a key's record, by consumer and key (or within a
// tenant), and forgetting it through a confirmation.
func TestInboxPage(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testInboxPage(t, newEngineEnv(t, b))
	})
}

func testInboxPage(t *testing.T, e *tenv) {
	e.done("charge-order", "acme:inv-1", 2)
	e.park("charge-order", "o-9", pmsg{topic: "orders"})

	body := page(t, e.get("/eo/inbox"), http.StatusOK)
	require.Contains(t, body, `<form id="inbox-lookup" method="get" action="/eo/inbox"`)
	require.Contains(t, body, `<div id="record">`)
	body = page(t, e.get("/eo/inbox?consumer=charge-order&key=inv-1&tenant=acme"), http.StatusOK)
	require.Equal(t, "done", text(t, body, "record-status"))
	body = page(t, e.get("/eo/inbox?consumer=charge-order&key=o-9"), http.StatusOK)
	require.Contains(t, body, `<a href="/eo/parked/charge-order/o-9" id="parked-message-link">`)
	body = page(t, e.get("/eo/inbox?consumer=charge-order&key=nope"), http.StatusNotFound)
	require.Contains(t, text(t, body, "lookup-error"), "no record for this consumer and key")
	body = page(t, e.get("/eo/inbox?consumer=charge_order&key=nope"), http.StatusNotFound)
	require.Contains(t, text(t, body, "lookup-error"), "unknown consumer")
	page(t, e.get("/eo/inbox?consumer=charge-order"), http.StatusBadRequest)

	body = page(t, e.get("/eo/inbox?consumer=charge-order&key=inv-1&tenant=acme"), http.StatusOK)
	action, v := form(t, body, "forget-form")
	require.Equal(t, "acme:inv-1", v.Get("key"))
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "This forgets 1 key.", text(t, body, "confirm-count"))
	action, v = form(t, body, "confirm-form")
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Contains(t, text(t, body, "result"), "Forgot 1 key")
	require.Equal(t, "", e.status("charge-order", "acme:inv-1"))
	page(t, e.call("POST", action, v), http.StatusNotFound)
}
