package console

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The Redis lease store: its consumers' parked figures in the overview,
// its parked messages found, shown, replayed through the console's
// publisher and discarded, its records looked up and forgotten, with
// ?store=redis.
func TestRedisStore(t *testing.T) {
	t.Parallel()
	r := newRedis(t)
	pub := &recorder{}
	e := newEnv(t, func(c *Config) {
		c.Redis, c.RedisReplayPublisher, c.RedisConsumers = r.store, pub, []string{"send-sms"}
	})
	odd := `sms "4711" ✓/x`
	r.park(t, e.ctx, "send-sms", odd, pmsg{topic: "sms", payload: []byte(`<script>x</script>`), meta: map[string]string{"order_id": "A-1"}, reason: "provider refused"})
	r.park(t, e.ctx, "send-sms", "s2", pmsg{topic: "sms", meta: map[string]string{"order_id": "A-2"}})
	r.park(t, e.ctx, "send-sms", "s3", pmsg{topic: "sms", meta: map[string]string{"order_id": "A-2"}})
	r.done(t, e.ctx, "send-sms", "s0")

	var doc overviewJSON
	decode(t, e.get("/eo/api/v1/overview"), &doc)
	require.Len(t, doc.Consumers, 1)
	c := doc.Consumers[0]
	require.Equal(t, "redis", c.Store)
	require.EqualValues(t, 3, *c.Parked)
	require.EqualValues(t, 3, *c.ParkedMessages)
	require.Nil(t, c.Done, "not counted by the Redis store")
	body := page(t, e.get("/eo/"), http.StatusOK)
	require.Contains(t, body, `href="/eo/parked?consumer=send-sms&amp;store=redis"`)
	require.Contains(t, body, `data-field="done">not counted<`)

	var list struct {
		Store     string   `json:"store"`
		Consumers []string `json:"consumers"`
	}
	decode(t, e.get("/eo/api/v1/consumers?store=redis"), &list)
	require.Equal(t, []string{"send-sms"}, list.Consumers)
	m := ok(t, e.get("/eo/api/v1/consumers/send-sms?store=redis"))
	require.EqualValues(t, 3, m["parked"])

	apiErr(t, e.get("/eo/api/v1/parked?store=redis"), http.StatusBadRequest, codeBadFilter)
	var l struct {
		Messages []parkedJSON `json:"messages"`
	}
	decode(t, e.get("/eo/api/v1/parked?store=redis&consumer=send-sms&meta=order_id:A-2"), &l)
	require.Len(t, l.Messages, 2)
	require.Equal(t, "redis", l.Messages[0].Store)
	m = ok(t, e.get("/eo/api/v1/parked/count?store=redis&consumer=send-sms"))
	require.EqualValues(t, 3, m["count"])
	m = ok(t, e.get("/eo/api/v1/parked?store=redis&consumer=nobody"))
	require.Empty(t, m["messages"], "the Redis store keeps no list of consumers: an unknown one finds nothing")

	var pm parkedJSON
	decode(t, e.get("/eo/api/v1/parked/send-sms/"+seg(odd)+"?store=redis"), &pm)
	require.Equal(t, `<script>x</script>`, *pm.Payload.Text)
	require.Equal(t, "provider refused", pm.Reason)
	m = ok(t, e.get("/eo/api/v1/consumers/send-sms/keys/"+seg(odd)+"?store=redis"))
	require.Equal(t, "parked", m["status"])
	require.Equal(t, true, m["parked_message"])

	body = page(t, e.get(e.h.(*handler).messageURL("redis", "send-sms", odd)), http.StatusOK)
	require.Equal(t, `<script>x</script>`, text(t, body, "payload"))
	require.NotContains(t, body, "<script>x")
	action, v := form(t, body, "replay-form")
	require.Equal(t, "redis", v.Get("store"))

	// Replay through the pages: published with its UUID, payload and
	// metadata; the key released.
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "This replays 1 message.", text(t, body, "confirm-count"))
	require.Contains(t, body, "through the console")
	action, v = form(t, body, "confirm-form")
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, `Done: Replayed 1 message: published to "sms".`, text(t, body, "result"))
	got := pub.all()
	require.Len(t, got, 1)
	require.Equal(t, "sms", got[0].topic)
	require.Equal(t, "uuid-"+odd, got[0].msg.UUID)
	require.Equal(t, `<script>x</script>`, string(got[0].msg.Payload))
	require.Equal(t, "A-1", got[0].msg.Metadata.Get("order_id"))
	rec, err := r.store.Get(e.ctx, "send-sms", odd)
	require.NoError(t, err)
	require.Equal(t, "failed", rec.Status)
	apiErr(t, e.call("POST", "/eo/api/v1/parked/send-sms/"+seg(odd)+"/replay?store=redis", nil), http.StatusNotFound, codeNotFound)

	// Bulk: the confirmed count.
	m = ok(t, e.get("/eo/api/v1/parked/count?store=redis&consumer=send-sms&meta=order_id:A-2"))
	require.EqualValues(t, 2, m["count"])
	filter := map[string]any{"store": "redis", "consumer": "send-sms", "meta": map[string]string{"order_id": "A-2"}, "as_of": m["as_of"]}
	filter["expect"] = 1
	apiErr(t, e.call("POST", "/eo/api/v1/parked/replay", filter), http.StatusConflict, codeCountChanged)
	require.Len(t, pub.all(), 1)
	filter["expect"] = 2
	m = ok(t, e.call("POST", "/eo/api/v1/parked/replay", filter))
	require.EqualValues(t, 2, m["replayed"])
	require.Len(t, pub.all(), 3)

	// Discard and forget.
	r.park(t, e.ctx, "send-sms", "s4", pmsg{topic: "sms"})
	ok(t, e.call("POST", "/eo/api/v1/parked/send-sms/s4/discard?store=redis", nil))
	_, err = r.store.GetParked(e.ctx, "send-sms", "s4")
	require.Error(t, err)
	ok(t, e.call("DELETE", "/eo/api/v1/consumers/send-sms/keys/s4?store=redis", nil))
	apiErr(t, e.get("/eo/api/v1/consumers/send-sms/keys/s4?store=redis"), http.StatusNotFound, codeNotFound)

	lines := e.logs.lines(t, "exactlyonce console: action")
	require.Len(t, lines, 4)
	for _, l := range lines {
		require.Equal(t, "redis", l["store"])
		require.Equal(t, "token", l["user"])
	}
}

// A console of the Redis store only: it is the default store; the outbox
// is PostgreSQL's (503 unavailable); a replay without a publisher is
// refused, changing nothing.
func TestRedisOnly(t *testing.T) {
	t.Parallel()
	r := newRedis(t)
	e := envWith(t, Config{Redis: r.store, RedisConsumers: []string{"send-sms"}})
	r.park(t, e.ctx, "send-sms", "s1", pmsg{topic: "sms"})

	var doc overviewJSON
	decode(t, e.get("/eo/api/v1/overview"), &doc)
	require.Len(t, doc.Consumers, 1)
	require.Nil(t, doc.Outbox)
	require.Empty(t, doc.RelaysNote)
	for _, p := range []string{"/eo/api/v1/outbox", "/eo/api/v1/outbox/rows", "/eo/api/v1/outbox/rows/1", "/eo/api/v1/relays"} {
		apiErr(t, e.get(p), http.StatusServiceUnavailable, codeUnavailable)
	}
	apiErr(t, e.get("/eo/api/v1/parked"), http.StatusBadRequest, codeBadFilter)
	apiErr(t, e.get("/eo/api/v1/parked?store=postgres&consumer=send-sms"), http.StatusBadRequest, codeBadFilter)
	m := ok(t, e.get("/eo/api/v1/parked/count?consumer=send-sms"))
	require.EqualValues(t, 1, m["count"])

	apiErr(t, e.call("POST", "/eo/api/v1/parked/send-sms/s1/replay", nil), http.StatusServiceUnavailable, codeUnavailable)
	apiErr(t, e.call("POST", "/eo/api/v1/parked/replay", map[string]any{"consumer": "send-sms", "expect": 1, "as_of": m["as_of"]}), http.StatusServiceUnavailable, codeUnavailable)
	rec, err := r.store.Get(e.ctx, "send-sms", "s1")
	require.NoError(t, err)
	require.Equal(t, "parked", rec.Status, "nothing changed")

	body := page(t, e.get("/eo/parked"), http.StatusOK)
	require.Contains(t, body, "Name a consumer")
	body = page(t, e.get("/eo/parked?"+url.Values{"consumer": {"send-sms"}}.Encode()), http.StatusOK)
	require.Equal(t, 1, strings.Count(body, `<tr class="parked-row">`))
	require.Contains(t, body, `href="/eo/parked/send-sms/s1?store=redis"`)
	page(t, e.get("/eo/outbox"), http.StatusServiceUnavailable)
	body = page(t, e.get("/eo/"), http.StatusOK)
	require.NotContains(t, body, `id="outbox"`)
}
