package console

import (
	"context"
	"encoding/base64"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The overview: per consumer, records by status, duplicates and parked;
// the outbox's backlog; computed in the background and served from the
// last computation (as_of), quickly.
func TestOverview(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testOverview(t, newEngineEnv(t, b, func(c *Config) { c.StatsInterval = time.Hour }))
	})
}

func testOverview(t *testing.T, e *tenv) {
	e.done("charge-order", "o-1", 2)
	e.done("charge-order", "o-2", 1)
	e.park("charge-order", "o-3", pmsg{topic: "orders"})
	e.done("send-sms", "s-1", 0)
	e.row("invoices", "u1", "{}", nil, "quarantined")
	e.row("invoices", "u2", "{}", nil, "failing")
	e.row("invoices", "u3", "{}", nil, "")

	var doc overviewJSON
	decode(t, e.get("/eo/api/v1/overview"), &doc)
	require.NotNil(t, doc.AsOf, "the first request waits for the first figures")
	require.WithinDuration(t, time.Now(), *doc.AsOf, time.Minute)
	require.Equal(t, 3600.0, doc.StatsIntervalSeconds)
	require.Len(t, doc.Consumers, 2)
	c := doc.Consumers[0]
	require.Equal(t, "charge-order", c.Consumer)
	require.Equal(t, "postgres", c.Store)
	require.EqualValues(t, 2, *c.Done)
	require.EqualValues(t, 3, *c.Duplicates)
	require.EqualValues(t, 1, *c.Parked)
	require.EqualValues(t, 1, *c.ParkedMessages)
	require.EqualValues(t, 0, *c.Failed)
	require.EqualValues(t, 0, *c.Processing)
	require.EqualValues(t, 3, *c.Total)
	require.Equal(t, "send-sms", doc.Consumers[1].Consumer)
	require.NotNil(t, doc.Outbox)
	require.EqualValues(t, 3, doc.Outbox.Pending)
	require.EqualValues(t, 1, doc.Outbox.Failing)
	require.EqualValues(t, 1, doc.Outbox.Quarantined)
	require.NotNil(t, doc.Outbox.OldestPendingAgeSeconds)
	require.Greater(t, *doc.Outbox.OldestPendingAgeSeconds, 5.0)
	require.NotEmpty(t, doc.RelaysNote)
	require.Empty(t, doc.Errors)

	// Served from the computation: a new record shows after the interval
	// only, and the answers are fast.
	e.done("charge-order", "o-4", 0)
	took := make([]time.Duration, 40)
	for i := range took {
		start := time.Now()
		decode(t, e.get("/eo/api/v1/overview"), &doc)
		took[i] = time.Since(start)
		require.EqualValues(t, 2, *doc.Consumers[0].Done)
	}
	slices.Sort(took)
	require.Less(t, took[len(took)*95/100], 100*time.Millisecond, "p95 of the overview's answers")
	ok(t, e.get("/eo/api/v1/outbox"))

	// A short interval: the next request after it starts a computation,
	// which the one after sees.
	f := envWith(t, Config{DB: e.db}, func(c *Config) { c.StatsInterval = time.Millisecond })
	f.settle()
	time.Sleep(5 * time.Millisecond)
	f.settle()
	decode(t, f.get("/eo/api/v1/overview"), &doc)
	require.EqualValues(t, 3, *doc.Consumers[0].Done)

	// Config.Consumers: those only, even one without records.
	g := envWith(t, Config{DB: e.db, Consumers: []string{"send-sms", "idle"}})
	decode(t, g.get("/eo/api/v1/overview"), &doc)
	require.Len(t, doc.Consumers, 2)
	require.Equal(t, "send-sms", doc.Consumers[0].Consumer)
	require.Equal(t, "idle", doc.Consumers[1].Consumer)
	require.EqualValues(t, 0, *doc.Consumers[1].Total)

	apiErr(t, e.get("/eo/api/v1/overview?fresh=1"), http.StatusBadRequest, codeBadFilter)

	// An action makes the figures stale: the next request starts their
	// computation (the interval is an hour), the one after sees it.
	ok(t, e.call(http.MethodPost, "/eo/api/v1/parked/charge-order/o-3/discard", nil))
	e.get("/eo/api/v1/overview")
	e.settle()
	decode(t, e.get("/eo/api/v1/overview"), &doc)
	require.EqualValues(t, 0, *doc.Consumers[0].ParkedMessages, "the discarded message is gone from the figures")
	require.EqualValues(t, 3, *doc.Consumers[0].Done)
}

// A database that cannot be reached: 503 unavailable, never a 500; the
// overview lists the errors.
func TestUnavailable(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	defer pool.Close()
	e := envWith(t, Config{DB: sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool)}})
	for _, p := range []string{"/eo/api/v1/parked", "/eo/api/v1/parked/c/k", "/eo/api/v1/consumers", "/eo/api/v1/outbox/rows", "/eo/api/v1/relays", "/eo/api/v1/outbox"} {
		apiErr(t, e.get(p), http.StatusServiceUnavailable, codeUnavailable)
	}
	var doc overviewJSON
	decode(t, e.get("/eo/api/v1/overview"), &doc)
	require.NotEmpty(t, doc.Errors)
	w := e.get("/eo/")
	require.Equal(t, http.StatusOK, w.Code)
	require.Contains(t, w.Body.String(), `<p class="error">Error: `)
	w = e.get("/eo/parked/c/k")
	require.Equal(t, http.StatusServiceUnavailable, w.Code)
}

// The consumers and their figures; a key's record; forgetting a key.
func TestConsumersAndKeys(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testConsumersAndKeys(t, newEngineEnv(t, b))
	})
}

func testConsumersAndKeys(t *testing.T, e *tenv) {
	odd := `it's "quoted" / ünïcødé ✓ 100%`
	e.done("charge-order", odd, 3)
	e.done("charge-order", "acme:inv-1", 0)
	e.park("charge-order", "o-9", pmsg{topic: "orders"})

	var list struct {
		Store     string   `json:"store"`
		Consumers []string `json:"consumers"`
		More      bool     `json:"more"`
	}
	decode(t, e.get("/eo/api/v1/consumers"), &list)
	require.Equal(t, "postgres", list.Store)
	require.Equal(t, []string{"charge-order"}, list.Consumers)

	m := ok(t, e.get("/eo/api/v1/consumers/charge-order"))
	require.EqualValues(t, 2, m["done"])
	require.EqualValues(t, 1, m["parked"])
	require.EqualValues(t, 3, m["duplicates"])
	require.NotNil(t, m["as_of"])

	unknown := apiErr(t, e.get("/eo/api/v1/consumers/charge_order"), http.StatusNotFound, codeUnknownConsumer)
	require.Equal(t, []string{"charge-order"}, unknown.Consumers)
	require.Contains(t, unknown.Message, `unknown consumer "charge_order"`)

	path := "/eo/api/v1/consumers/charge-order/keys/" + seg(odd)
	m = ok(t, e.get(path))
	require.Equal(t, odd, m["key"])
	require.Equal(t, "done", m["status"])
	require.EqualValues(t, 3, m["duplicates"])
	require.Equal(t, false, m["parked_message"])
	m = ok(t, e.get("/eo/api/v1/consumers/charge-order/keys/o-9"))
	require.Equal(t, "parked", m["status"])
	require.Equal(t, true, m["parked_message"])
	m = ok(t, e.get("/eo/api/v1/consumers/charge-order/keys/inv-1?tenant=acme"))
	require.Equal(t, "acme:inv-1", m["key"])
	apiErr(t, e.get("/eo/api/v1/consumers/charge-order/keys/inv-1?tenant=a:b"), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.get("/eo/api/v1/consumers/charge-order/keys/nope"), http.StatusNotFound, codeNotFound)
	apiErr(t, e.get("/eo/api/v1/consumers/charge_order/keys/nope"), http.StatusNotFound, codeUnknownConsumer)
	apiErr(t, e.get("/eo/api/v1/consumers/charge-order/keys/%FF"), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.get("/eo/api/v1/consumers/charge-order/keys/a%00b"), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.get(path+"?store=redis"), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.get(path+"?store=mysql"), http.StatusBadRequest, codeBadFilter)

	// Forget: the record goes; the action is logged with its user.
	m = ok(t, e.call("DELETE", path, nil))
	require.Equal(t, true, m["forgotten"])
	require.Equal(t, "", e.status("charge-order", odd))
	apiErr(t, e.call("DELETE", path, nil), http.StatusNotFound, codeNotFound)
	apiErr(t, e.call("DELETE", "/eo/api/v1/consumers/charge_order/keys/x", nil), http.StatusNotFound, codeUnknownConsumer)
	lines := e.logs.lines(t, "exactlyonce console: action")
	require.Len(t, lines, 3, "the forget, and the two of nothing (count 0)")
	require.Equal(t, "token", lines[0]["user"])
	require.Equal(t, "inbox.forget", lines[0]["action"])
	require.Equal(t, odd, lines[0]["key"])
	require.EqualValues(t, 1, lines[0]["count"])
	require.EqualValues(t, 0, lines[1]["count"])
	require.Empty(t, e.logs.lines(t, "exactlyonce console: action failed"), "a forget of nothing is not a failure")
}

// Parked messages: search by every criterion, count, page, show (with
// the payload, text or base64), replay (written to the outbox for its
// topic, PostgreSQL) and discard, with the stores' refusals as 4xx.
func TestParked(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testParked(t, newEngineEnv(t, b))
	})
}

func testParked(t *testing.T, e *tenv) {
	odd := `key "with" quotes/and/slashes ✓`
	e.park("ship-order", odd, pmsg{topic: "orders", payload: []byte(`{"order":"A-1042"}`), meta: map[string]string{"order_id": "A-1042"}, reason: "invalid address"})
	e.park("ship-order", "acme:k2", pmsg{topic: "orders", payload: []byte{0xff, 0x00, 0x01}, meta: map[string]string{"order_id": "A-7"}})
	e.park("ship-order", "k3", pmsg{reason: "no topic known"})
	e.park("send-sms", "s1", pmsg{topic: "sms", uuid: "u-s1", meta: map[string]string{"order_id": "A-1042"}})

	type list struct {
		Messages []parkedJSON `json:"messages"`
		Next     string       `json:"next_after"`
	}
	keys := func(q string) []string {
		t.Helper()
		var l list
		decode(t, e.get("/eo/api/v1/parked"+q), &l)
		var out []string
		for _, m := range l.Messages {
			require.Nil(t, m.Payload, "lists carry no payload")
			out = append(out, m.Consumer+"/"+m.Key)
		}
		sort.Strings(out)
		return out
	}
	require.Len(t, keys(""), 4)
	require.Equal(t, []string{"send-sms/s1", "ship-order/" + odd}, keys("?meta=order_id:A-1042"))
	require.Equal(t, []string{"ship-order/" + odd}, keys("?meta=order_id:A-1042&consumer=ship-order"))
	require.Equal(t, []string{"ship-order/" + odd}, keys("?"+url.Values{"key": {odd}}.Encode()))
	require.Equal(t, []string{"send-sms/s1"}, keys("?uuid=u-s1"))
	require.Equal(t, []string{"ship-order/acme:k2"}, keys("?tenant=acme"))
	require.Equal(t, []string{"ship-order/" + odd}, keys("?reason=ADDRESS"))
	require.Len(t, keys("?since=1h&before="+url.QueryEscape(time.Now().Add(time.Minute).UTC().Format(time.RFC3339))), 4)
	require.Empty(t, keys("?before=1h"))
	require.Len(t, keys("?since=2025-01-01"), 4)
	require.Len(t, keys("?meta=order_id=A-7"), 1, "field=value too")

	var l list
	decode(t, e.get("/eo/api/v1/parked?limit=3"), &l)
	require.Len(t, l.Messages, 3)
	require.NotEmpty(t, l.Next)
	next := l.Next
	l = list{}
	decode(t, e.get("/eo/api/v1/parked?limit=3&after="+url.QueryEscape(next)), &l)
	require.Len(t, l.Messages, 1)
	require.Empty(t, l.Next)

	m := ok(t, e.get("/eo/api/v1/parked/count?meta=order_id:A-1042"))
	require.EqualValues(t, 2, m["count"])
	require.Contains(t, m["matching"], `metadata "order_id" = "A-1042"`)

	// Bad input: 4xx with the reason, never a 500.
	for q, code := range map[string]string{
		"?since=yesterday":                      codeBadFilter,
		"?before=2025-13-45":                    codeBadFilter,
		"?since=2h&before=3h":                   codeBadFilter,
		"?meta=order_id":                        codeBadFilter,
		"?meta=:x":                              codeBadFilter,
		"?meta=a:1&meta=a:2":                    codeBadFilter,
		"?limit=1001":                           codePageTooLarge,
		"?limit=0":                              codeBadFilter,
		"?limit=ten":                            codeBadFilter,
		"?after=not-a-cursor":                   codeBadFilter,
		"?consumr=ship-order":                   codeBadFilter,
		"?tenant=a:b":                           codeBadFilter,
		"?key=%FF":                              codeBadFilter,
		"?reason=a%00b":                         codeBadFilter,
		"?store=redis":                          codeBadFilter,
		"?consumer=" + strings.Repeat("c", 300): codeBadFilter,
	} {
		apiErr(t, e.get("/eo/api/v1/parked"+q), http.StatusBadRequest, code)
	}
	apiErr(t, e.get("/eo/api/v1/parked/count?since=nope"), http.StatusBadRequest, codeBadFilter)
	un := apiErr(t, e.get("/eo/api/v1/parked?consumer=ship_order"), http.StatusNotFound, codeUnknownConsumer)
	require.Equal(t, []string{"send-sms", "ship-order"}, un.Consumers)
	apiErr(t, e.get("/eo/api/v1/parked/count?consumer=ship_order"), http.StatusNotFound, codeUnknownConsumer)
	require.Empty(t, keys("?consumer=ship-order&reason=nothing-like-this"), "a known consumer: an empty list")

	// Show: the payload as text, or base64 when it is not UTF-8.
	msgPath := "/eo/api/v1/parked/ship-order/" + seg(odd)
	var pm parkedJSON
	decode(t, e.get(msgPath), &pm)
	require.Equal(t, odd, pm.Key)
	require.Equal(t, "orders", pm.Topic)
	require.Equal(t, "parked", pm.Status)
	require.Equal(t, "invalid address", pm.Reason)
	require.Equal(t, map[string]string{"order_id": "A-1042"}, pm.Metadata)
	require.NotNil(t, pm.Payload.Text)
	require.Equal(t, `{"order":"A-1042"}`, *pm.Payload.Text)
	pm = parkedJSON{}
	decode(t, e.get("/eo/api/v1/parked/ship-order/acme:k2"), &pm)
	require.Nil(t, pm.Payload.Text)
	require.Equal(t, base64.StdEncoding.EncodeToString([]byte{0xff, 0x00, 0x01}), *pm.Payload.Base64)
	apiErr(t, e.get("/eo/api/v1/parked/ship-order/nope"), http.StatusNotFound, codeNotFound)
	apiErr(t, e.get("/eo/api/v1/parked/ship_order/nope"), http.StatusNotFound, codeUnknownConsumer)

	// Replay: the key released, the message written to the outbox for its
	// topic with its UUID, in one transaction.
	m = ok(t, e.call("POST", msgPath+"/replay", nil))
	require.EqualValues(t, 1, m["replayed"])
	require.EqualValues(t, 1, e.outboxRows("orders", "uuid-"+odd))
	require.Equal(t, "failed", e.status("ship-order", odd), "released")
	apiErr(t, e.call("POST", msgPath+"/replay", nil), http.StatusNotFound, codeNotFound)
	// Refused as it is: no topic; then with one.
	nr := apiErr(t, e.call("POST", "/eo/api/v1/parked/ship-order/k3/replay", nil), http.StatusConflict, codeNotReplayable)
	require.Contains(t, nr.Message, "topic")
	apiErr(t, e.call("POST", "/eo/api/v1/parked/ship-order/k3/replay", `{"topic": "orders", "extra": 1}`), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.call("POST", "/eo/api/v1/parked/ship-order/k3/replay", `{"forget": true}`), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.call("POST", "/eo/api/v1/parked/ship-order/k3/replay", `{"topic": 5}`), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.call("POST", "/eo/api/v1/parked/ship-order/k3/replay", `{} {}`), http.StatusBadRequest, codeBadFilter)
	ok(t, e.call("POST", "/eo/api/v1/parked/ship-order/k3/replay", map[string]any{"topic": "orders.retry"}))
	require.EqualValues(t, 1, e.outboxRows("orders.retry", "uuid-k3"))

	// Discard: the message goes; the key is discarded (no longer
	// parked) unless forget.
	m = ok(t, e.call("POST", "/eo/api/v1/parked/ship-order/acme:k2/discard", nil))
	require.EqualValues(t, 1, m["discarded"])
	require.Equal(t, "discarded", e.status("ship-order", "acme:k2"))
	apiErr(t, e.call("POST", "/eo/api/v1/parked/ship-order/acme:k2/discard", nil), http.StatusNotFound, codeNotFound)
	apiErr(t, e.call("POST", "/eo/api/v1/parked/send-sms/s1/discard", `{"topic": "x"}`), http.StatusBadRequest, codeBadFilter)
	ok(t, e.call("POST", "/eo/api/v1/parked/send-sms/s1/discard", map[string]any{"forget": true}))
	require.Equal(t, "", e.status("send-sms", "s1"), "forgotten")
	apiErr(t, e.call("POST", "/eo/api/v1/parked/ship_order/x/discard", nil), http.StatusNotFound, codeUnknownConsumer)

	actions := e.logs.lines(t, "exactlyonce console: action")
	require.Len(t, actions, 4, "two replays, two discards")
	for _, a := range actions {
		require.Equal(t, "token", a["user"])
		require.EqualValues(t, 1, a["count"])
	}
	require.Len(t, e.logs.lines(t, "exactlyonce console: action failed"), 4, "the refusals of the stores (not those of bad input): logged as failed, with the user")
}

// Bulk actions on parked messages: the body states the filter and the
// count the operator confirmed; another count is refused (409
// count_changed, with the count now) and changes nothing.
func TestParkedBulk(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testParkedBulk(t, newEngineEnv(t, b))
	})
}

func testParkedBulk(t *testing.T, e *tenv) {
	for _, k := range []string{"a1", "a2", "a3"} {
		e.park("ship-order", k, pmsg{topic: "orders", meta: map[string]string{"customer_id": "C-77"}})
	}
	e.park("ship-order", "b1", pmsg{topic: "orders", meta: map[string]string{"customer_id": "C-1"}})
	e.park("bill", "c1", pmsg{topic: "bills", meta: map[string]string{"customer_id": "C-77"}})

	filter := map[string]any{"consumer": "ship-order", "meta": map[string]string{"customer_id": "C-77"}}
	with := func(extra map[string]any) map[string]any {
		out := map[string]any{}
		for k, v := range filter {
			out[k] = v
		}
		for k, v := range extra {
			out[k] = v
		}
		return out
	}
	m := ok(t, e.get("/eo/api/v1/parked/count?consumer=ship-order&meta=customer_id:C-77"))
	require.EqualValues(t, 3, m["count"])
	filter["as_of"] = m["as_of"]

	changed := apiErr(t, e.call("POST", "/eo/api/v1/parked/replay", with(map[string]any{"expect": 2})), http.StatusConflict, codeCountChanged)
	require.EqualValues(t, 3, *changed.Count)
	require.Zero(t, testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()), "nothing changed")
	require.Equal(t, "parked", e.status("ship-order", "a1"))
	apiErr(t, e.call("POST", "/eo/api/v1/parked/discard", with(map[string]any{"expect": 4})), http.StatusConflict, codeCountChanged)

	for _, body := range []any{
		with(nil), // no expect
		with(map[string]any{"expect": 3, "custmer": "x"}),
		with(map[string]any{"expect": 3, "state": "failing"}),
		with(map[string]any{"expect": 3, "forget": true}),
		with(map[string]any{"expect": "3"}),
		with(map[string]any{"expect": 3, "since": "last week"}),
		with(map[string]any{"expect": 3, "meta": map[string]string{"": "x"}}),
		map[string]any{"expect": 5, "as_of": m["as_of"]}, // the empty filter, without all
		"not json",
	} {
		apiErr(t, e.call("POST", "/eo/api/v1/parked/replay", body), http.StatusBadRequest, codeBadFilter)
	}
	apiErr(t, e.call("POST", "/eo/api/v1/parked/replay", map[string]any{"consumer": "shiporder", "expect": 0, "as_of": m["as_of"]}), http.StatusNotFound, codeUnknownConsumer)
	big := `{"reason": "` + strings.Repeat("x", 2<<20) + `", "expect": 1}`
	apiErr(t, e.call("POST", "/eo/api/v1/parked/replay", big), http.StatusRequestEntityTooLarge, codeTooLarge)

	m = ok(t, e.call("POST", "/eo/api/v1/parked/replay", with(map[string]any{"expect": 3})))
	require.EqualValues(t, 3, m["matched"])
	require.EqualValues(t, 3, m["replayed"])
	require.EqualValues(t, 0, m["skipped"])
	for _, k := range []string{"a1", "a2", "a3"} {
		require.EqualValues(t, 1, e.outboxRows("orders", "uuid-"+k))
		require.Equal(t, "failed", e.status("ship-order", k))
	}
	require.Equal(t, "parked", e.status("bill", "c1"), "another consumer's")

	m = ok(t, e.get("/eo/api/v1/parked/count"))
	m = ok(t, e.call("POST", "/eo/api/v1/parked/discard", map[string]any{"all": true, "expect": 2, "forget": true, "as_of": m["as_of"]}))
	require.EqualValues(t, 2, m["discarded"])
	require.Equal(t, "", e.status("bill", "c1"))
	m = ok(t, e.get("/eo/api/v1/parked/count"))
	require.EqualValues(t, 0, m["count"])

	require.Len(t, e.logs.lines(t, "exactlyonce console: action failed"), 3, "the two counts changed and the unknown consumer")
	bulk := e.logs.lines(t, "exactlyonce console: action")
	require.Len(t, bulk, 2)
	require.Equal(t, "parked.replay.bulk", bulk[0]["action"])
	require.EqualValues(t, 3, bulk[0]["count"])
	require.Equal(t, "token", bulk[0]["user"])
	require.Contains(t, bulk[0]["matching"], `consumer "ship-order"`)
	require.Equal(t, "parked.discard.bulk", bulk[1]["action"])
}

// Quarantined outbox rows: figures, search, show, requeue and discard,
// one or in bulk with the confirmed count.
func TestOutboxRows(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testOutboxRows(t, newEngineEnv(t, b))
	})
}

func testOutboxRows(t *testing.T, e *tenv) {
	q1 := e.row("invoices", "inv-1", `{"n":1}`, map[string]string{"order_id": "A-1"}, "quarantined")
	q2 := e.row("invoices", "inv-2", "{}", map[string]string{"order_id": "A-2"}, "quarantined")
	q3 := e.row("receipts", "rec-1", "{}", nil, "quarantined")
	f1 := e.row("invoices", "inv-3", "{}", nil, "failing")
	p1 := e.row("invoices", "inv-4", "{}", nil, "")

	m := ok(t, e.get("/eo/api/v1/outbox"))
	require.EqualValues(t, 5, m["pending"])
	require.EqualValues(t, 3, m["quarantined"])
	require.EqualValues(t, 1, m["failing"])
	require.NotNil(t, m["as_of"])

	type rows struct {
		Rows []rowJSON `json:"rows"`
		Next int64     `json:"next_after"`
	}
	ids := func(q string) []int64 {
		t.Helper()
		var r rows
		decode(t, e.get("/eo/api/v1/outbox/rows"+q), &r)
		var out []int64
		for _, row := range r.Rows {
			require.Nil(t, row.Payload)
			out = append(out, row.ID)
		}
		return out
	}
	require.Equal(t, []int64{q1, q2, q3}, ids(""))
	require.Equal(t, []int64{f1}, ids("?state=failing"))
	require.Equal(t, []int64{q1, q2, q3, f1}, ids("?state=all"))
	require.Equal(t, []int64{q1, q2}, ids("?topic=invoices"))
	require.Equal(t, []int64{q2}, ids("?meta=order_id:A-2"))
	require.Equal(t, []int64{q1}, ids("?uuid=inv-1"))
	require.Equal(t, []int64{q1, q2, q3}, ids("?reason=precondition&since=1h"))
	require.Empty(t, ids("?before=1h"))
	var r rows
	decode(t, e.get("/eo/api/v1/outbox/rows?limit=2"), &r)
	require.Equal(t, q2, r.Next)
	require.Equal(t, []int64{q3}, ids("?limit=2&after="+itoa(q2)))
	m = ok(t, e.get("/eo/api/v1/outbox/rows/count?topic=invoices"))
	require.EqualValues(t, 2, m["count"])

	for q, code := range map[string]string{
		"?state=parked":           codeBadFilter,
		"?state=failing&since=1h": codeBadFilter,
		"?since=2h&before=3h":     codeBadFilter,
		"?limit=5000":             codePageTooLarge,
		"?after=-1":               codeBadFilter,
		"?after=x":                codeBadFilter,
		"?meta=novalue":           codeBadFilter,
		"?topic=%FF":              codeBadFilter,
		"?consumer=x":             codeBadFilter,
	} {
		apiErr(t, e.get("/eo/api/v1/outbox/rows"+q), http.StatusBadRequest, code)
	}

	var row rowJSON
	decode(t, e.get("/eo/api/v1/outbox/rows/"+itoa(q1)), &row)
	require.Equal(t, "quarantined", row.State)
	require.Equal(t, `{"n":1}`, *row.Payload.Text)
	require.Equal(t, map[string]string{"order_id": "A-1"}, row.Metadata)
	apiErr(t, e.get("/eo/api/v1/outbox/rows/0"), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.get("/eo/api/v1/outbox/rows/abc"), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.get("/eo/api/v1/outbox/rows/999999"), http.StatusNotFound, codeNotFound)

	// One row.
	m = ok(t, e.call("POST", "/eo/api/v1/outbox/rows/"+itoa(q1)+"/requeue", nil))
	require.EqualValues(t, 1, m["requeued"])
	decode(t, e.get("/eo/api/v1/outbox/rows/"+itoa(q1)), &row)
	require.Equal(t, "ready", row.State)
	apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/"+itoa(q1)+"/requeue", nil), http.StatusConflict, codeNotQuarantined)
	apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/"+itoa(f1)+"/discard", nil), http.StatusConflict, codeNotQuarantined)
	apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/"+itoa(p1)+"/discard", nil), http.StatusConflict, codeNotQuarantined)
	apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/999999/discard", nil), http.StatusNotFound, codeNotFound)
	ok(t, e.call("POST", "/eo/api/v1/outbox/rows/"+itoa(q3)+"/discard", nil))
	apiErr(t, e.get("/eo/api/v1/outbox/rows/"+itoa(q3)), http.StatusNotFound, codeNotFound)

	// Bulk: the confirmed count (with the count's bounds), or nothing.
	q4 := e.row("invoices", "inv-5", "{}", nil, "quarantined")
	bounded := func(q string, body map[string]any) map[string]any {
		t.Helper()
		c := ok(t, e.get("/eo/api/v1/outbox/rows/count"+q))
		body["as_of"], body["max_id"] = c["as_of"], c["max_id"]
		return body
	}
	changed := apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/discard", bounded("?topic=invoices", map[string]any{"topic": "invoices", "expect": 1})),
		http.StatusConflict, codeCountChanged)
	require.EqualValues(t, 2, *changed.Count)
	require.Equal(t, []int64{q2, q4}, ids(""), "nothing changed")
	apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/discard", bounded("", map[string]any{"expect": 2})), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/discard", bounded("?state=failing", map[string]any{"state": "failing", "all": true, "expect": 1})), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/requeue", bounded("?topic=invoices", map[string]any{"topic": "invoices"})), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/requeue", bounded("", map[string]any{"consumer": "x", "expect": 1})), http.StatusBadRequest, codeBadFilter)
	m = ok(t, e.call("POST", "/eo/api/v1/outbox/rows/requeue", bounded("?meta=order_id:A-2", map[string]any{"meta": map[string]string{"order_id": "A-2"}, "expect": 1})))
	require.EqualValues(t, 1, m["requeued"])
	m = ok(t, e.call("POST", "/eo/api/v1/outbox/rows/discard", bounded("", map[string]any{"all": true, "expect": 1})))
	require.EqualValues(t, 1, m["discarded"])
	require.Empty(t, ids(""))
	m = ok(t, e.call("POST", "/eo/api/v1/outbox/rows/requeue", bounded("?state=failing", map[string]any{"state": "failing", "all": true, "expect": 1})))
	require.EqualValues(t, 1, m["requeued"])
	require.Empty(t, ids("?state=all"))

	actions := e.logs.lines(t, "exactlyonce console: action")
	var names []string
	for _, a := range actions {
		require.Equal(t, "token", a["user"])
		names = append(names, a["action"].(string))
	}
	require.Equal(t, []string{"outbox.requeue", "outbox.discard", "outbox.requeue.bulk", "outbox.discard.bulk", "outbox.requeue.bulk"}, names)
}

// The relays the database can tell about: a running relay's LISTEN on
// the outbox's channel (which also checks the channel's name against the
// outbox package's).
func TestRelays(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var doc struct {
		Available bool        `json:"available"`
		Channel   string      `json:"channel"`
		Relays    []relayInfo `json:"relays"`
		Note      string      `json:"note"`
	}
	decode(t, e.get("/eo/api/v1/relays"), &doc)
	require.True(t, doc.Available)
	require.Empty(t, doc.Relays)
	require.Equal(t, "exactlyonce."+e.db.Schema+".watermill_outbox", doc.Channel)
	require.NotEmpty(t, doc.Note)

	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: e.db, Publisher: &recorder{}, PollInterval: time.Second, ListenConnString: testenv.ListenConnString(), Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = relay.Run(ctx)
	}()
	defer func() {
		cancel()
		wg.Wait()
	}()
	require.Eventually(t, func() bool {
		decode(t, e.get("/eo/api/v1/relays"), &doc)
		return len(doc.Relays) == 1 && slices.Contains(doc.Relays[0].BasedOn, basisListen)
	}, 20*time.Second, 50*time.Millisecond, "the relay's LISTEN is seen: %+v", doc)
	require.NotZero(t, doc.Relays[0].PID)

	// A long table name: the channel is a hash, as the outbox's.
	long := strings.Repeat("o", 60)
	require.Equal(t, "exactlyonce.", notifyChannel(e.db.WithDefaults())[:12])
	db := e.db
	db.OutboxTable = long
	require.Len(t, notifyChannel(db), len("exactlyonce.")+32)
}

// Unknown endpoints and methods are JSON errors too.
func TestAPIRouting(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testAPIRouting(t, newEngineEnv(t, b))
	})
}

func testAPIRouting(t *testing.T, e *tenv) {
	apiErr(t, e.get("/eo/api/v1/nope"), http.StatusNotFound, codeNotFound)
	apiErr(t, e.get("/eo/api/v2/overview"), http.StatusNotFound, codeNotFound)
	w := e.call("PUT", "/eo/api/v1/overview", nil)
	apiErr(t, w, http.StatusMethodNotAllowed, codeMethodNotAllowed)
	require.Equal(t, "GET", w.Header().Get("Allow"))
	w = e.call("GET", "/eo/api/v1/parked/replay", nil)
	apiErr(t, w, http.StatusMethodNotAllowed, codeMethodNotAllowed)
	require.Equal(t, "POST", w.Header().Get("Allow"))
	w = e.call("DELETE", "/eo/api/v1/parked/c/k", nil)
	apiErr(t, w, http.StatusMethodNotAllowed, codeMethodNotAllowed)
	require.Equal(t, "GET", w.Header().Get("Allow"))
	w = e.call("GET", "/eo/api/v1/outbox/rows/requeue", nil)
	apiErr(t, w, http.StatusBadRequest, codeBadFilter)

	// Headers of every answer.
	w = e.get("/eo/api/v1/relays")
	require.Equal(t, "nosniff", w.Header().Get("X-Content-Type-Options"))
	require.Equal(t, "no-store", w.Header().Get("Cache-Control"))
	require.Contains(t, w.Header().Get("Content-Security-Policy"), "default-src 'none'")

	// Without the prefix: the root.
	f := envWith(t, Config{DB: e.db}, func(c *Config) { c.Prefix = "" })
	ok(t, f.get("/api/v1/relays"))
	require.Equal(t, http.StatusOK, f.get("/").Code)
	// Mounted on a mux at its prefix; the prefix without its slash
	// redirects.
	mux := http.NewServeMux()
	mux.Handle("/eo/", e.h)
	mux.HandleFunc("/other", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusTeapot) })
	r := httptest.NewRequest("GET", "/eo/api/v1/relays", nil)
	r.Header.Set("Authorization", "Bearer "+testToken)
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, r)
	ok(t, rec)
	rec = httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest("GET", "/other", nil))
	require.Equal(t, http.StatusTeapot, rec.Code, "the service's own routes stay its own")
	w = e.get("/eo")
	require.Equal(t, http.StatusMovedPermanently, w.Code)
	require.Equal(t, "/eo/", w.Header().Get("Location"))
}

// Bad input at every endpoint: a 4xx with its code and reason, never a
// 500.
func TestBadInputEveryEndpoint(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		testBadInputEveryEndpoint(t, newEngineEnv(t, b))
	})
}

func testBadInputEveryEndpoint(t *testing.T, e *tenv) {
	e.park("ship-order", "k1", pmsg{topic: "orders"})
	for _, c := range []struct {
		method, path string
		body         any
		status       int
		code         string
	}{
		{"GET", "/eo/api/v1/overview?x=1", nil, 400, codeBadFilter},
		{"GET", "/eo/api/v1/consumers?store=mysql", nil, 400, codeBadFilter},
		{"GET", "/eo/api/v1/consumers/ship%00order", nil, 400, codeBadFilter},
		{"GET", "/eo/api/v1/consumers/nobody", nil, 404, codeUnknownConsumer},
		{"GET", "/eo/api/v1/consumers/ship-order/keys/nope", nil, 404, codeNotFound},
		{"GET", "/eo/api/v1/consumers/ship-order/keys/k1?tenant=a:b", nil, 400, codeBadFilter},
		{"DELETE", "/eo/api/v1/consumers/ship-order/keys/%FF", nil, 400, codeBadFilter},
		{"GET", "/eo/api/v1/parked?limit=1001", nil, 400, codePageTooLarge},
		{"GET", "/eo/api/v1/parked/count?meta=nocolon", nil, 400, codeBadFilter},
		{"POST", "/eo/api/v1/parked/replay", map[string]any{"consumer": "ship-order"}, 400, codeBadFilter},
		{"POST", "/eo/api/v1/parked/discard", map[string]any{"consumer": "ship-order", "expect": 0, "as_of": time.Now()}, 409, codeCountChanged},
		{"GET", "/eo/api/v1/parked/ship-order/k1?store=redis", nil, 400, codeBadFilter},
		{"POST", "/eo/api/v1/parked/ship-order/k1/replay", `{"topic": "a\u0000b"}`, 400, codeBadFilter},
		{"POST", "/eo/api/v1/parked/ship-order/k1/discard", `[]`, 400, codeBadFilter},
		{"GET", "/eo/api/v1/outbox?state=failing", nil, 400, codeBadFilter},
		{"GET", "/eo/api/v1/outbox/rows?since=soon", nil, 400, codeBadFilter},
		{"GET", "/eo/api/v1/outbox/rows/count?state=none", nil, 400, codeBadFilter},
		{"POST", "/eo/api/v1/outbox/rows/requeue", map[string]any{"expect": -1, "all": true}, 400, codeBadFilter},
		{"POST", "/eo/api/v1/outbox/rows/discard", map[string]any{"expect": 1, "since": "2h", "before": "3h"}, 400, codeBadFilter},
		{"GET", "/eo/api/v1/outbox/rows/-4", nil, 400, codeBadFilter},
		{"POST", "/eo/api/v1/outbox/rows/1x/requeue", nil, 400, codeBadFilter},
		{"POST", "/eo/api/v1/outbox/rows/1/discard", `{"x": 1}`, 400, codeBadFilter},
		{"GET", "/eo/api/v1/relays?verbose=1", nil, 400, codeBadFilter},
	} {
		apiErr(t, e.call(c.method, c.path, c.body), c.status, c.code)
	}
	require.Equal(t, "parked", e.status("ship-order", "k1"), "nothing changed")
}

// Blocked ordering keys: the outbox's figures count the keys with a failing
// or quarantined row and the rows waiting behind them; rows carry their
// ordering key and, when they failed, the rows waiting behind them; a
// filter selects a key's rows, to list, count or discard them, which
// unblocks the key.
func TestOutboxBlockedKeys(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.StatsInterval = time.Hour })
	a1 := e.row("invoices", "A-1", "{}", nil, "quarantined")
	a2 := e.row("invoices", "A-2", "{}", nil, "")
	a3 := e.row("invoices", "A-3", "{}", nil, "")
	b1 := e.row("invoices", "B-1", "{}", nil, "failing")
	b2 := e.row("invoices", "B-2", "{}", nil, "")
	free := e.row("invoices", "free", "{}", nil, "quarantined")
	for key, ids := range map[string][]int64{"order-A": {a1, a2, a3}, "order-B": {b1, b2}} {
		_, err := e.db.Conn.ExecContext(e.ctx, `UPDATE `+e.db.Outbox()+` SET ordering_key = $1 WHERE id = ANY($2)`, key, ids)
		require.NoError(t, err)
	}

	m := ok(t, e.get("/eo/api/v1/outbox"))
	require.EqualValues(t, 2, m["blocked_keys"])
	require.EqualValues(t, 3, m["blocked_rows"], "A-2 and A-3 behind A-1, B-2 behind B-1")
	var doc overviewJSON
	decode(t, e.get("/eo/api/v1/overview"), &doc)
	require.EqualValues(t, 2, doc.Outbox.BlockedKeys)
	require.EqualValues(t, 3, doc.Outbox.BlockedRows)

	type keyed struct {
		ID      int64
		Key     string
		Waiting int64
	}
	list := func(q string) []keyed {
		t.Helper()
		var r struct {
			Rows []rowJSON `json:"rows"`
		}
		decode(t, e.get("/eo/api/v1/outbox/rows"+q), &r)
		out := []keyed{}
		for _, row := range r.Rows {
			out = append(out, keyed{row.ID, row.OrderingKey, row.Waiting})
		}
		return out
	}
	require.Equal(t, []keyed{{a1, "order-A", 2}, {b1, "order-B", 1}, {free, "", 0}}, list("?state=all"))
	require.Equal(t, []keyed{{a1, "order-A", 2}}, list("?ordering_key=order-A"))
	require.Equal(t, []keyed{}, list("?ordering_key=order-B"), "B's failed row is failing, not quarantined")
	require.Equal(t, []keyed{{b1, "order-B", 1}}, list("?ordering_key=order-B&state=failing"))
	require.Equal(t, []keyed{}, list("?ordering_key=order-C&state=all"))
	apiErr(t, e.get("/eo/api/v1/outbox/rows?ordering_key=%FF"), http.StatusBadRequest, codeBadFilter)
	c := ok(t, e.get("/eo/api/v1/outbox/rows/count?ordering_key=order-A"))
	require.EqualValues(t, 1, c["count"])
	require.Equal(t, `quarantined outbox rows with ordering key "order-A"`, c["matching"])

	var row rowJSON
	decode(t, e.get("/eo/api/v1/outbox/rows/"+itoa(a1)), &row)
	require.Equal(t, "order-A", row.OrderingKey)
	require.EqualValues(t, 2, row.Waiting)
	decode(t, e.get("/eo/api/v1/outbox/rows/"+itoa(a2)), &row)
	require.Equal(t, "order-A", row.OrderingKey)
	require.Zero(t, row.Waiting, "a row that never failed holds nothing back")

	// The key is a criterion of a bulk action on outbox rows, not of
	// parked messages.
	apiErr(t, e.call("POST", "/eo/api/v1/parked/discard", map[string]any{"ordering_key": "order-A", "all": true, "expect": 0, "as_of": c["as_of"]}),
		http.StatusBadRequest, codeBadFilter)
	m = ok(t, e.call("POST", "/eo/api/v1/outbox/rows/discard", map[string]any{"ordering_key": "order-A", "expect": 1, "as_of": c["as_of"], "max_id": c["max_id"]}))
	require.EqualValues(t, 1, m["discarded"])
	require.Equal(t, []keyed{{free, "", 0}}, list(""), "the quarantined row without a key is left")
	e.get("/eo/api/v1/overview")
	e.settle()
	m = ok(t, e.get("/eo/api/v1/outbox"))
	require.EqualValues(t, 1, m["blocked_keys"], "order-B is still blocked by its failing row")
	require.EqualValues(t, 1, m["blocked_rows"])
}
