package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// idemKey is the idempotency key the notifier passes to the provider for a
// message published with this message_id (lease mode: "<consumer>:<key>").
func idemKey(messageID string) string { return sendConsumer + ":" + messageID }

// TestNotifierEndToEnd runs the built binary against real RabbitMQ and
// each database engine (PostgreSQL, MariaDB): 50 notifications, 15 of them
// published 2 or 3 times in a random order by a plain AMQP producer
// (message_id), go out exactly once each (the provider sees each idempotency
// key once), are logged once and announced once on the sent queue; the
// extra copies are counted as duplicates; SIGTERM stops the process cleanly.
func TestNotifierEndToEnd(t *testing.T) {
	t.Parallel()
	forEachEngine(t, testNotifierEndToEnd)
}

func testNotifierEndToEnd(t *testing.T, engine string) {
	n := startNotifier(t, notifierOptions{engine: engine})

	type note struct {
		msgID  string
		req    SendRequest
		copies int
	}
	const total = 50
	notes := map[string]note{} // by notification_id
	var pubs []amqp.Publishing
	extra, withCopies := 0, 0
	for i := range total {
		r := SendRequest{NotificationID: fmt.Sprintf("n-%02d", i), Text: fmt.Sprintf("message number %d", i)}
		if i%2 == 0 {
			r.Channel, r.To = "sms", fmt.Sprintf("+3805000%05d", i)
		} else {
			r.Channel, r.To = "email", fmt.Sprintf("user%02d@example.com", i)
		}
		copies := 1
		if i%10 < 3 { // 15 notifications, published 2 or 3 times
			copies = 2 + i%2
			withCopies++
		}
		nt := note{msgID: fmt.Sprintf("msg-%02d", i), req: r, copies: copies}
		notes[r.NotificationID] = nt
		extra += copies - 1
		for range copies {
			pubs = append(pubs, request(nt.msgID, r))
		}
	}
	require.Equal(t, 15, withCopies)
	require.Equal(t, 20, extra)
	// Copies both far apart and side by side (then two workers hold the
	// same key at once: one waits on the lease, then sees it done).
	rand.Shuffle(len(pubs), func(i, j int) { pubs[i], pubs[j] = pubs[j], pubs[i] })
	n.publish(pubs...)

	n.waitFor(60*time.Second, "every notification sent, logged and relayed, and every extra copy blocked", func() (bool, string) {
		sms, email := n.providerCalls()
		rows := len(n.logRows())
		dups := n.metric(seriesDuplicates)
		pending := n.pending()
		return len(sms)+len(email) == total && rows == total && dups == float64(extra) && pending == 0,
			fmt.Sprintf("provider keys %d+%d, log rows %d, duplicates blocked %v of %d, outbox pending %d",
				len(sms), len(email), rows, dups, extra, pending)
	})

	// The provider saw each idempotency key exactly once, on the right channel.
	sms, email := n.providerCalls()
	require.Len(t, sms, total/2)
	require.Len(t, email, total/2)
	for _, nt := range notes {
		calls := email
		if nt.req.Channel == "sms" {
			calls = sms
		}
		require.Equal(t, 1, calls[idemKey(nt.msgID)], "provider calls for %s (%d copies published)", nt.msgID, nt.copies)
	}

	// One notification_log row per notification.
	rows := n.logRows()
	require.Len(t, rows, total)
	for id, nt := range notes {
		require.Equal(t, logRow{NotificationID: id, Channel: nt.req.Channel, Recipient: nt.req.To, Status: "sent",
			MessageKey: nt.msgID, Attempts: 1}, rows[id])
	}

	// Metrics: every extra copy blocked as a duplicate, each notification
	// claimed and processed once, no lease takeover.
	m := n.metrics()
	require.Equal(t, float64(extra), m[seriesDuplicates])
	require.Equal(t, float64(total), m[seriesProcessed])
	require.Equal(t, float64(total), m[`exactlyonce_delivery_duration_seconds_count{consumer="notifier-send",outcome="processed"}`])
	require.Zero(t, m[seriesTakeovers])
	require.Zero(t, n.depth(n.send), "the send queue is empty")

	// One notification.sent event per notification: pending is 0, so every
	// event was relayed (and confirmed) before this drain.
	events := n.drain(n.sent)
	uuids, ids := map[string]bool{}, map[string]bool{}
	for _, d := range events {
		uuid, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		require.NotEmpty(t, uuid, "event without a Watermill UUID: %v", d.Headers)
		uuids[uuid] = true
		var ev SentEvent
		require.NoError(t, json.Unmarshal(d.Body, &ev), "%s", d.Body)
		ids[ev.NotificationID] = true
		nt, ok := notes[ev.NotificationID]
		require.True(t, ok, "event for an unknown notification: %s", d.Body)
		require.Equal(t, nt.req.Channel, ev.Channel)
		require.Equal(t, nt.req.To, ev.To)
		require.Equal(t, 1, ev.Attempt)
		require.Equal(t, idemKey(nt.msgID), ev.IdempotencyKey)
		require.WithinDuration(t, time.Now(), ev.SentAt, time.Minute)
		require.Equal(t, ev.NotificationID, d.Headers["notification_id"], "the event's notification_id metadata")
	}
	require.Len(t, uuids, total, "distinct event UUIDs")
	require.Len(t, ids, total, "distinct notification_ids in events")
	// No relay re-send happened (no relay failure here), so no event repeats.
	require.Len(t, events, total, "notification.sent events")

	t.Logf("copies held back by a live lease (nacked, redelivered): %v", m[seriesBusy])
	// Copies held back while another worker had the key's lease are
	// expected nacks: never logged as errors.
	require.NotContains(t, n.out.String(), exactlyonce.ErrLeaseHeld.Error(), "a held lease logged above debug level")

	// Graceful shutdown; nothing more was sent or announced meanwhile.
	n.stop(30 * time.Second)
	require.Zero(t, n.depth(n.sent), "no event after the drain")
	require.Zero(t, n.depth(n.send))
	sms2, email2 := n.providerCalls()
	require.Equal(t, sms, sms2)
	require.Equal(t, email, email2)
}

// TestNotifierDeadLetters: requests that can never succeed (malformed JSON,
// unknown channel, missing recipient, no identity, a message_id PostgreSQL
// text cannot store) go to the dead-letter queue once each with the reason,
// are never claimed nor sent, and do not block the valid requests behind
// them (one identified by message_id, one by the Watermill UUID header only).
func TestNotifierDeadLetters(t *testing.T) {
	t.Parallel()
	n := startNotifier(t, notifierOptions{})

	body := func(r SendRequest) []byte {
		b, err := json.Marshal(r)
		require.NoError(t, err)
		return b
	}
	type deadCase struct {
		name       string
		pub        amqp.Publishing
		reason     string // in reason_poisoned
		uuidHeader string // the dead message's Watermill UUID: the request's identity
	}
	cases := []deadCase{
		{"malformed JSON", amqp.Publishing{MessageId: "dl-malformed", Body: []byte(`{"notification_id": "n-1", "channel": `)},
			"invalid send request: body is not the expected JSON object", "dl-malformed"},
		{"unknown channel", request("dl-channel", SendRequest{NotificationID: "n-2", Channel: "pigeon", To: "coop 7", Text: "hi"}),
			`invalid send request: channel "pigeon" is not sms or email`, "dl-channel"},
		{"missing to", request("dl-to", SendRequest{NotificationID: "n-3", Channel: "email", Text: "hi"}),
			"invalid send request: to is missing", "dl-to"},
		{"no identity", amqp.Publishing{Body: body(SendRequest{NotificationID: "n-4", Channel: "sms", To: "+380500000004", Text: "hi"})},
			"neither the Watermill UUID header nor the AMQP message_id property", ""},
		{"message_id not UTF-8", request("dl-\xff\xfe", SendRequest{NotificationID: "n-5", Channel: "sms", To: "+380500000005", Text: "hi"}),
			"invalid message key", "dl-\xff\xfe"},
	}
	for _, c := range cases {
		n.publish(c.pub)
	}
	okByID := SendRequest{NotificationID: "n-ok-1", Channel: "sms", To: "+380500000010", Text: "after the bad ones"}
	okByHeader := SendRequest{NotificationID: "n-ok-2", Channel: "email", To: "grace@example.com", Text: "also after"}
	n.publish(
		request("dl-ok", okByID),
		amqp.Publishing{Headers: amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: "wm-ok"}, Body: body(okByHeader)},
	)

	n.waitFor(30*time.Second, "the bad requests dead-lettered and the valid ones sent", func() (bool, string) {
		dead, rows, pending := n.depth(n.dead), len(n.logRows()), n.pending()
		return dead == len(cases) && rows == 2 && pending == 0,
			fmt.Sprintf("dead-lettered %d of %d, log rows %d of 2, outbox pending %d", dead, len(cases), rows, pending)
	})

	// Exactly one dead copy of each, with its reason and identity.
	dead := n.drain(n.dead)
	require.Len(t, dead, len(cases), "one dead copy per bad request, no retry loop")
	byBody := map[string]amqp.Delivery{}
	for _, d := range dead {
		byBody[string(d.Body)] = d
	}
	require.Len(t, byBody, len(cases))
	for _, c := range cases {
		d, ok := byBody[string(c.pub.Body)]
		require.True(t, ok, "%s: not in the dead-letter queue", c.name)
		reason, _ := d.Headers[wmw.ReasonForPoisonedKey].(string)
		require.Contains(t, reason, c.reason, "%s: reason_poisoned", c.name)
		require.Equal(t, n.send, d.Headers[wmw.PoisonedTopicKey], "%s: topic_poisoned", c.name)
		require.Equal(t, sendHandler, d.Headers[wmw.PoisonedHandlerKey], "%s: handler_poisoned", c.name)
		require.Equal(t, c.uuidHeader, d.Headers[wamqp.DefaultMessageUUIDHeaderKey], "%s: identity kept", c.name)
	}

	// Nothing left behind, nothing claimed or sent for the bad ones.
	require.Zero(t, n.depth(n.send), "the send queue is empty")
	require.Zero(t, n.depth(n.dead))
	sms, email := n.providerCalls()
	require.Equal(t, map[string]int{idemKey("dl-ok"): 1}, sms)
	require.Equal(t, map[string]int{idemKey("wm-ok"): 1}, email)
	require.Equal(t, 2, n.inboxRows(sendConsumer), "only the valid requests reached the inbox")
	rows := n.logRows()
	require.Equal(t, "dl-ok", rows["n-ok-1"].MessageKey)
	require.Equal(t, "wm-ok", rows["n-ok-2"].MessageKey, "identity from the Watermill UUID header")
	require.Len(t, n.drain(n.sent), 2)
	m := n.metrics()
	require.Equal(t, float64(2), m[seriesProcessed])
	require.Zero(t, m[seriesDuplicates])

	n.stop(30 * time.Second)
}

type receiptAnswer struct {
	Result string `json:"result"`
}

// TestNotifierReceiptsWebhook: a delivery receipt is applied once per body
// (the SHA-256 of the body is the inbox key, claimed in the transaction of
// the status update), also when copies arrive at the same moment; a receipt
// that overtakes the notification is refused with 404 and not recorded, so
// the provider's retry is applied; malformed receipts get 400. On each
// database engine.
func TestNotifierReceiptsWebhook(t *testing.T) {
	t.Parallel()
	forEachEngine(t, testNotifierReceiptsWebhook)
}

func testNotifierReceiptsWebhook(t *testing.T, engine string) {
	n := startNotifier(t, notifierOptions{engine: engine})
	const path = "/webhooks/receipts"
	postReceipt := func(body string) (int, string) {
		t.Helper()
		code, b := n.post(path, body)
		if code != http.StatusOK {
			return code, string(b)
		}
		var a receiptAnswer
		require.NoError(t, json.Unmarshal(b, &a), "%s", b)
		return code, a.Result
	}
	delivered := `{"notification_id": "n-r1", "status": "delivered"}`

	// Before the notification exists: 404, nothing recorded.
	code, res := postReceipt(delivered)
	require.Equal(t, http.StatusNotFound, code, res)
	require.Contains(t, res, "unknown notification_id")
	require.Zero(t, n.inboxRows(receiptsConsumer), "a receipt for an unknown notification is not recorded")

	n.publish(request("msg-r1", SendRequest{NotificationID: "n-r1", Channel: "email", To: "ada@example.com", Text: "Welcome aboard"}))
	n.waitFor(30*time.Second, "n-r1 logged as sent", func() (bool, string) {
		r := n.logRows()["n-r1"]
		return r.Status == "sent", fmt.Sprintf("%+v", r)
	})

	// The provider's retry of the refused receipt is applied, its repeat is not.
	code, res = postReceipt(delivered)
	require.Equal(t, http.StatusOK, code, res)
	require.Equal(t, "applied", res)
	code, res = postReceipt(delivered)
	require.Equal(t, http.StatusOK, code, res)
	require.Equal(t, "duplicate", res)
	require.Equal(t, "delivered", n.logRows()["n-r1"].Status)
	require.Equal(t, 1, n.inboxRows(receiptsConsumer))

	// A different receipt (another body) is another key: applied.
	code, res = postReceipt(`{"notification_id": "n-r1", "status": "READ"}`)
	require.Equal(t, http.StatusOK, code, res)
	require.Equal(t, "applied", res)
	require.Equal(t, "read", n.logRows()["n-r1"].Status)

	// Copies of one receipt at the same moment: exactly one is applied.
	const copies = 8
	concurrent := `{"notification_id": "n-r1", "status": "clicked"}`
	results := make([]string, copies)
	var wg sync.WaitGroup
	for i := range copies {
		wg.Go(func() {
			resp, err := n.client.Post(n.base+path, "application/json", bytes.NewBufferString(concurrent))
			if err != nil {
				results[i] = "error: " + err.Error()
				return
			}
			defer func() { _ = resp.Body.Close() }()
			var a receiptAnswer
			if err := json.NewDecoder(resp.Body).Decode(&a); err != nil || resp.StatusCode != http.StatusOK {
				results[i] = fmt.Sprintf("status %d, decode error %v", resp.StatusCode, err)
				return
			}
			results[i] = a.Result
		})
	}
	wg.Wait()
	counts := map[string]int{}
	for _, r := range results {
		counts[r]++
	}
	require.Equal(t, map[string]int{"applied": 1, "duplicate": copies - 1}, counts)
	require.Equal(t, "clicked", n.logRows()["n-r1"].Status)
	require.Equal(t, 3, n.inboxRows(receiptsConsumer))

	// Malformed receipts: 400, nothing recorded.
	malformed := []string{`{"notification_id": `, `not json`, ``, `{"notification_id": "n-r1"}`, `{"status": "delivered"}`, `[1, 2]`}
	for _, b := range malformed {
		code, res := postReceipt(b)
		require.Equal(t, http.StatusBadRequest, code, "body %q: %s", b, res)
	}
	code, _ = n.get(path)
	require.Equal(t, http.StatusMethodNotAllowed, code)
	require.Equal(t, 3, n.inboxRows(receiptsConsumer))
	require.Equal(t, "clicked", n.logRows()["n-r1"].Status)

	m := n.metrics()
	require.Equal(t, float64(3), m[`notifier_receipts_total{result="applied"}`])
	require.Equal(t, float64(1+copies-1), m[`notifier_receipts_total{result="duplicate"}`])
	require.Equal(t, float64(1), m[`notifier_receipts_total{result="unknown_notification"}`])
	require.Equal(t, float64(len(malformed)), m[`notifier_receipts_total{result="invalid"}`])

	n.stop(30 * time.Second)
}

// adminRecord is inbox.Record as the admin API encodes it.
type adminRecord struct {
	Consumer, Key, Status string
	Attempts              int
	Duplicates            int64
	LeaseUntil            *time.Time
	FirstSeenAt           time.Time
	ProcessedAt           *time.Time
	LastError             string
}

// TestNotifierAdminAPI: the read-only admin API reports what happened:
// inbox stats (done, parked, duplicates), one record, the parked keys (a
// request the provider rejected with 400: parked after one call, acked, not
// retried) and the outbox relay. On each database engine.
func TestNotifierAdminAPI(t *testing.T) {
	t.Parallel()
	forEachEngine(t, testNotifierAdminAPI)
}

func testNotifierAdminAPI(t *testing.T, engine string) {
	sms := testenv.NewProvider(t)
	sms.OnRequest = func(_ *http.Request, key string, _ int) int {
		if key == idemKey("adm-rejected") {
			return http.StatusBadRequest
		}
		return http.StatusOK
	}
	n := startNotifier(t, notifierOptions{sms: sms, engine: engine})
	first := request("adm-1", SendRequest{NotificationID: "n-a1", Channel: "sms", To: "+380501112233", Text: "Your code is 4821"})
	n.publish(
		first,
		request("adm-2", SendRequest{NotificationID: "n-a2", Channel: "email", To: "ada@example.com", Text: "Invoice"}),
		request("adm-rejected", SendRequest{NotificationID: "n-a3", Channel: "sms", To: "not-a-number", Text: "Hi"}),
		first,
	)
	n.waitFor(30*time.Second, "two sent, one parked, one duplicate, all relayed", func() (bool, string) {
		m := n.metrics()
		rows, pending := len(n.logRows()), n.pending()
		parked, dups := m[seriesParked], m[seriesDuplicates]
		return rows == 2 && parked == 1 && dups == 1 && pending == 0,
			fmt.Sprintf("log rows %d, parked %v, duplicates %v, outbox pending %d", rows, parked, dups, pending)
	})

	type stats struct {
		Rows            map[string]int64
		Total           int64
		Duplicates      int64
		OldestFirstSeen *time.Time
	}
	var st stats
	n.getJSON("/admin/inbox/stats", &st)
	require.Equal(t, map[string]int64{"done": 2, "parked": 1}, st.Rows)
	require.Equal(t, int64(3), st.Total)
	require.Equal(t, int64(1), st.Duplicates)
	require.NotNil(t, st.OldestFirstSeen)
	require.WithinDuration(t, time.Now(), *st.OldestFirstSeen, time.Minute)
	var own stats
	n.getJSON("/admin/inbox/stats?consumer="+sendConsumer, &own)
	require.Equal(t, st, own)
	var none stats
	n.getJSON("/admin/inbox/stats?consumer=nobody", &none)
	require.Zero(t, none.Total)
	require.Nil(t, none.OldestFirstSeen)

	var rec adminRecord
	n.getJSON("/admin/inbox/record?key=adm-1", &rec)
	require.Equal(t, sendConsumer, rec.Consumer)
	require.Equal(t, "adm-1", rec.Key)
	require.Equal(t, "done", rec.Status)
	require.Equal(t, 1, rec.Attempts)
	require.Equal(t, int64(1), rec.Duplicates)
	require.NotNil(t, rec.ProcessedAt)
	require.WithinDuration(t, time.Now(), *rec.ProcessedAt, time.Minute)
	require.False(t, rec.ProcessedAt.Before(rec.FirstSeenAt))
	require.Empty(t, rec.LastError)
	var rec2 adminRecord
	n.getJSON("/admin/inbox/record?key=adm-2&consumer="+sendConsumer, &rec2)
	require.Equal(t, "done", rec2.Status)
	require.Equal(t, 1, rec2.Attempts)
	require.Zero(t, rec2.Duplicates)
	for _, q := range []string{"key=no-such-key", "key=adm-1&consumer=" + receiptsConsumer} {
		code, body := n.get("/admin/inbox/record?" + q)
		require.Equal(t, http.StatusNotFound, code, "%s: %s", q, body)
		var e map[string]string
		require.NoError(t, json.Unmarshal(body, &e))
		require.NotEmpty(t, e["error"])
	}

	var parked []adminRecord
	n.getJSON("/admin/inbox/parked", &parked)
	require.Len(t, parked, 1)
	require.Equal(t, "adm-rejected", parked[0].Key)
	require.Equal(t, "parked", parked[0].Status)
	require.Equal(t, 1, parked[0].Attempts)
	require.Contains(t, parked[0].LastError, "400")
	require.Equal(t, 1, sms.Calls(idemKey("adm-rejected")), "a rejected request is not retried")
	_, logged := n.logRows()["n-a3"]
	require.False(t, logged)
	var noneParked []adminRecord
	n.getJSON("/admin/inbox/parked?consumer=nobody", &noneParked)
	require.NotNil(t, noneParked, "an empty list, not null")
	require.Empty(t, noneParked)

	var ob struct {
		Pending        int64   `json:"pending"`
		OldestAge      float64 `json:"oldest_pending_age_seconds"`
		RelayInProcess bool    `json:"relay_in_process"`
		Relayed        *int64  `json:"relayed"`
		RelayFailures  *int64  `json:"relay_failures"`
	}
	n.getJSON("/admin/outbox/stats", &ob)
	require.Zero(t, ob.Pending)
	require.Zero(t, ob.OldestAge)
	require.True(t, ob.RelayInProcess)
	require.NotNil(t, ob.Relayed)
	require.Equal(t, int64(2), *ob.Relayed)
	require.NotNil(t, ob.RelayFailures)
	require.Zero(t, *ob.RelayFailures)
	require.Len(t, n.drain(n.sent), 2)

	m := n.metrics()
	require.Equal(t, float64(1), m[seriesParked])
	require.Contains(t, m, "exactlyonce_outbox_pending_rows")
	require.Zero(t, m["exactlyonce_outbox_pending_rows"])
	require.Equal(t, float64(2), m["exactlyonce_relay_relayed_total"])
	require.Equal(t, float64(1), m[`exactlyonce_deliveries_total{consumer="notifier-send",outcome="parked"}`])

	// Read-only: other methods are refused.
	code, _ := n.post("/admin/inbox/stats", "{}")
	require.Equal(t, http.StatusMethodNotAllowed, code)

	n.stop(30 * time.Second)
}

func TestParseRequest(t *testing.T) {
	t.Parallel()
	ok, err := parseRequest([]byte(`{"notification_id": "n-1", "channel": " SMS ", "to": "+380501112233", "text": "hi"}`))
	require.NoError(t, err)
	require.Equal(t, SendRequest{NotificationID: "n-1", Channel: "sms", To: "+380501112233", Text: "hi"}, ok)
	ok, err = parseRequest([]byte(`{"notification_id": "n-2", "channel": "email", "to": "a@b.c", "text": "x", "extra": 1}`))
	require.NoError(t, err, "unknown fields are ignored")
	require.Equal(t, "email", ok.Channel)

	for _, c := range []struct{ name, body, want string }{
		{"not UTF-8", "{\"notification_id\": \"\xff\"}", "not UTF-8"},
		{"malformed", `{"notification_id": `, "not the expected JSON object"},
		{"array", `[]`, "not the expected JSON object"},
		{"empty", ``, "not the expected JSON object"},
		{"no id", `{"channel": "sms", "to": "x", "text": "t"}`, "notification_id is missing"},
		{"blank id", `{"notification_id": "  ", "channel": "sms", "to": "x", "text": "t"}`, "notification_id is missing"},
		{"long id", `{"notification_id": "` + strings.Repeat("x", 201) + `", "channel": "sms", "to": "x", "text": "t"}`, "longer than 200 bytes"},
		{"unknown channel", `{"notification_id": "n", "channel": "pigeon", "to": "x", "text": "t"}`, `channel "pigeon" is not sms or email`},
		{"no channel", `{"notification_id": "n", "to": "x", "text": "t"}`, `channel "" is not sms or email`},
		{"no to", `{"notification_id": "n", "channel": "sms", "to": " ", "text": "t"}`, "to is missing"},
		{"no text", `{"notification_id": "n", "channel": "email", "to": "x"}`, "text is missing"},
	} {
		_, err := parseRequest([]byte(c.body))
		require.ErrorIs(t, err, ErrInvalidRequest, c.name)
		require.ErrorContains(t, err, c.want, c.name)
	}
	_, err = parseRequest([]byte(`{"notification_id": "` + strings.Repeat("x", 200) + `", "channel": "sms", "to": "x", "text": "t"}`))
	require.NoError(t, err, "200 bytes is the limit, inclusive")
}

// TestNotifierMarshaler: the notifier's watermill-amqp configuration reads
// messages from any producer: the identity is the Watermill UUID header when
// a Watermill producer sent it, else the AMQP message_id property; with
// neither it stays empty (the message is dead-lettered, never processed
// under a shared key); header values that are not strings (RabbitMQ's
// x-death, numbers, tables) become text instead of failing the delivery;
// and what it publishes keeps the identity.
func TestNotifierMarshaler(t *testing.T) {
	t.Parallel()
	m := amqpConfig(testenv.AMQPURL()).Marshaler
	require.IsType(t, rabbitmq.Marshaler{}, m, "the notifier uses the library's marshaler")
	uuidKey := wamqp.DefaultMessageUUIDHeaderKey

	for _, c := range []struct {
		name string
		d    amqp.Delivery
		want string
	}{
		{"watermill header wins", amqp.Delivery{MessageId: "mid-1", Headers: amqp.Table{uuidKey: "wm-1"}}, "wm-1"},
		{"message_id", amqp.Delivery{MessageId: "mid-2"}, "mid-2"},
		{"empty watermill header falls back to message_id", amqp.Delivery{MessageId: "mid-3", Headers: amqp.Table{uuidKey: ""}}, "mid-3"},
		{"neither", amqp.Delivery{}, ""},
		{"neither, other headers", amqp.Delivery{Headers: amqp.Table{"a": "b"}}, ""},
	} {
		msg, err := m.Unmarshal(c.d)
		require.NoError(t, err, c.name)
		require.Equal(t, c.want, msg.UUID, c.name)
		_, leaked := msg.Metadata[uuidKey]
		require.False(t, leaked, "%s: the UUID header is not metadata", c.name)
	}

	// RabbitMQ's x-death (after dead-lettering) and other non-string header
	// values become text instead of failing the delivery.
	when := time.Date(2024, 5, 1, 12, 0, 0, 0, time.FixedZone("x", 3600))
	d := amqp.Delivery{
		MessageId: "mid-4",
		Body:      []byte(`{"k": 1}`),
		Headers: amqp.Table{
			"x-death": []interface{}{amqp.Table{
				"count": int64(2), "reason": "rejected", "queue": "notifications.send",
				"routing-keys": []interface{}{"notifications.send"},
			}},
			"x-first-death-reason": "rejected",
			"retries":              int32(3),
			"flag":                 true,
			"raw":                  []byte("bytes"),
			"when":                 when,
			"nothing":              nil,
		},
	}
	_, err := wamqp.DefaultMarshaler{}.Unmarshal(d)
	require.Error(t, err, "watermill-amqp's DefaultMarshaler fails on x-death: the reason the notifier uses rabbitmq.Marshaler")
	msg, err := m.Unmarshal(d)
	require.NoError(t, err)
	require.Equal(t, "mid-4", msg.UUID)
	require.Equal(t, []byte(`{"k": 1}`), []byte(msg.Payload))
	var xdeath []map[string]any
	require.NoError(t, json.Unmarshal([]byte(msg.Metadata.Get("x-death")), &xdeath), "x-death is JSON text: %q", msg.Metadata.Get("x-death"))
	require.Len(t, xdeath, 1)
	require.Equal(t, float64(2), xdeath[0]["count"])
	require.Equal(t, "rejected", xdeath[0]["reason"])
	require.Equal(t, "notifications.send", xdeath[0]["queue"])
	require.Equal(t, []any{"notifications.send"}, xdeath[0]["routing-keys"])
	require.Equal(t, "rejected", msg.Metadata.Get("x-first-death-reason"))
	require.Equal(t, "3", msg.Metadata.Get("retries"))
	require.Equal(t, "true", msg.Metadata.Get("flag"))
	require.Equal(t, "bytes", msg.Metadata.Get("raw"))
	require.Equal(t, "2024-05-01T11:00:00Z", msg.Metadata.Get("when"))
	v, present := msg.Metadata["nothing"]
	require.True(t, present)
	require.Empty(t, v)

	// Publishing keeps the identity in the Watermill header (and in
	// message_id), so a message the notifier republishes (dead letter,
	// event) keeps its UUID downstream.
	p, err := m.Marshal(msg)
	require.NoError(t, err)
	require.Equal(t, "mid-4", p.Headers[uuidKey])
	require.Equal(t, "mid-4", p.MessageId)
	back, err := m.Unmarshal(amqp.Delivery{Headers: p.Headers, Body: p.Body})
	require.NoError(t, err)
	require.Equal(t, "mid-4", back.UUID)
	require.Equal(t, msg.Metadata.Get("x-death"), back.Metadata.Get("x-death"))
}
