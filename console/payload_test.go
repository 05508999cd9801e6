package console

import (
	"net/http"
	"runtime"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// bigPayload is a payload of n bytes of UTF-8 text whose last character
// (a 3-byte one) starts at byte maxShownPayload-1: a prefix of
// maxShownPayload bytes splits it.
func bigPayload(n int) string {
	head := strings.Repeat("a", maxShownPayload-1) + "€"
	return head + strings.Repeat("b", n-len(head))
}

// What one request allocates stays a small multiple of what it shows,
// whatever the payloads' size: lists of rows and messages whose payloads
// are 4 MiB each read no payload, and a single view, its confirmation
// and a key's look-up read a bounded prefix. Measured as the bytes the
// process allocated during the request (the least of three requests:
// another goroutine can only add to it); not parallel, so that the other
// tests do not.
func TestConsoleAllocatesWhatItShows(t *testing.T) {
	const (
		size  = 4 << 20
		n     = 6
		bound = 1 << 20 // what a request may allocate: 64 KiB shown, escaped, encoded, buffered
	)
	r := newRedis(t)
	e := newEnv(t, func(c *Config) { c.Redis = r.store })
	payload := bigPayload(size)
	var first int64
	for i := range n {
		id := e.row("invoices", "inv-"+itoa(int64(i)), payload, map[string]string{"order_id": "A-1"}, "quarantined")
		if i == 0 {
			first = id
		}
		e.park("c", "k"+itoa(int64(i)), pmsg{topic: "t", payload: []byte(payload)})
	}
	r.park(t, e.ctx, "c", "k0", pmsg{topic: "t", payload: []byte(payload)})

	allocated := func(method, path string) uint64 {
		t.Helper()
		least := uint64(1 << 63)
		for range 3 {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			w := e.call(method, path, nil)
			runtime.ReadMemStats(&after)
			require.Equal(t, http.StatusOK, w.Code, "%s %s: %.300s", method, path, w.Body)
			least = min(least, after.TotalAlloc-before.TotalAlloc)
		}
		return least
	}
	row := "/outbox/rows/" + itoa(first)
	for _, c := range []struct{ method, path string }{
		{"GET", "/eo/api/v1/outbox/rows"},
		{"GET", "/eo/outbox"},
		{"GET", "/eo/api/v1/parked?consumer=c"},
		{"GET", "/eo/parked?consumer=c"},
		{"GET", "/eo/api/v1" + row},
		{"GET", "/eo" + row},
		{"POST", "/eo" + row + "/requeue"}, // its confirmation
		{"GET", "/eo/api/v1/parked/c/k0"},
		{"GET", "/eo/parked/c/k0"},
		{"POST", "/eo/parked/c/k0/discard"}, // its confirmation
		{"GET", "/eo/api/v1/consumers/c/keys/k0"},
		{"GET", "/eo/inbox?consumer=c&key=k0"},
		{"GET", "/eo/api/v1/parked/c/k0?store=redis"},
		{"GET", "/eo/parked/c/k0?store=redis"},
		{"GET", "/eo/api/v1/consumers/c/keys/k0?store=redis"},
	} {
		got := allocated(c.method, c.path)
		t.Logf("%s %s: %d bytes allocated", c.method, c.path, got)
		require.Less(t, got, uint64(bound), "%s %s allocated %d bytes (payloads of %d bytes)", c.method, c.path, got, size)
	}
}

// A single view shows the payload's first maxShownPayload bytes at most
// and says so: the API with payload_truncated and the whole size, the
// page with a note "showing the first N of M bytes"; a prefix that splits
// a character ends before it (the text stays text). A payload within the
// bound is shown whole (payload_truncated false); lists show sizes only.
func TestPayloadShownBounded(t *testing.T) {
	t.Parallel()
	r := newRedis(t)
	e := newEnv(t, func(c *Config) { c.Redis = r.store })
	payload := bigPayload(maxShownPayload + 1000)
	id := e.row("invoices", "inv-1", payload, nil, "quarantined")
	small := e.row("invoices", "inv-2", `{"n":1}`, nil, "quarantined")
	e.park("c", "k", pmsg{topic: "t", payload: []byte(payload)})
	r.park(t, e.ctx, "c", "k", pmsg{topic: "t", payload: []byte(payload)})
	shown := payload[:maxShownPayload-1]
	require.False(t, utf8.ValidString(payload[:maxShownPayload]), "the bound splits a character")

	var row rowJSON
	decode(t, e.get("/eo/api/v1/outbox/rows/"+itoa(id)), &row)
	require.Equal(t, shown, *row.Payload.Text)
	require.Equal(t, len(payload), row.PayloadBytes)
	require.True(t, *row.PayloadTruncated)
	decode(t, e.get("/eo/api/v1/outbox/rows/"+itoa(small)), &row)
	require.Equal(t, `{"n":1}`, *row.Payload.Text)
	require.False(t, *row.PayloadTruncated)

	var rows struct{ Rows []map[string]any }
	decode(t, e.get("/eo/api/v1/outbox/rows"), &rows)
	require.Len(t, rows.Rows, 2)
	require.EqualValues(t, len(payload), rows.Rows[0]["payload_bytes"])
	require.NotContains(t, rows.Rows[0], "payload")
	require.NotContains(t, rows.Rows[0], "payload_truncated")

	for _, store := range []string{"", "?store=redis"} {
		var m parkedJSON
		decode(t, e.get("/eo/api/v1/parked/c/k"+store), &m)
		require.Equal(t, shown, *m.Payload.Text, store)
		require.Equal(t, len(payload), m.PayloadBytes, store)
		require.True(t, *m.PayloadTruncated, store)

		body := page(t, e.get("/eo/parked/c/k"+store), http.StatusOK)
		require.Equal(t, "Showing the first 65535 of 66536 bytes (UTF-8 text).", text(t, body, "payload-note"), store)
		require.Equal(t, shown, text(t, body, "payload"), store)
		require.Contains(t, text(t, body, "payload-truncated"), "1001 more bytes not shown", store)
		require.Contains(t, text(t, body, "payload-truncated"), "show --full-payload c k", store)
	}
	var list struct{ Messages []map[string]any }
	decode(t, e.get("/eo/api/v1/parked?consumer=c"), &list)
	require.Len(t, list.Messages, 1)
	require.NotContains(t, list.Messages[0], "payload")

	body := page(t, e.get("/eo/outbox/rows/"+itoa(id)), http.StatusOK)
	require.Equal(t, "Showing the first 65535 of 66536 bytes (UTF-8 text).", text(t, body, "payload-note"))
	require.Equal(t, shown, text(t, body, "payload"))
	require.Contains(t, text(t, body, "payload-truncated"), "exactlyonce outbox show --full-payload "+itoa(id))
	body = page(t, e.get("/eo/outbox/rows/"+itoa(small)), http.StatusOK)
	require.Equal(t, "7 bytes, UTF-8 text.", text(t, body, "payload-note"))
	require.NotContains(t, body, `id="payload-truncated"`)
}
