package main

// Fuzz targets of the notifier's input parsers (issue 5): parseRequest (the
// body of a send request) and the Unmarshal of the notifier's AMQP
// configuration (rabbitmq.Marshaler: any AMQP delivery), plus hostile-input
// tests through RabbitMQ: a really dead-lettered message (x-death) read
// through that configuration, and send requests the parser accepts but the
// notifier cannot store.
//
// Run a target: go test -run '^$' -fuzz FuzzParseRequest -fuzztime 25s ./examples/notifier/

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// FuzzParseRequest: parseRequest never panics; every error wraps
// ErrInvalidRequest (so the dead-letter filter catches it); an accepted
// request satisfies the contract (UTF-8 body, sms or email, non-blank id of
// at most 200 bytes, non-blank recipient, text) and can be stored: its
// notification_id and recipient go to notification_log's text columns
// after the provider was called, so they must be valid text without NUL
// bytes; and it survives a JSON round trip unchanged.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		`{"notification_id": "n-1", "channel": " SMS ", "to": "+380501112233", "text": "hi"}`,
		`{"notification_id": "n-2", "channel": "email", "to": "a@b.c", "text": "x", "extra": 1}`,
		"{\"notification_id\": \"\xff\"}",
		`{"notification_id": `,
		`[]`, ``, `null`, `"string"`, `1e400`,
		`{"notification_id": "  ", "channel": "sms", "to": "x", "text": "t"}`,
		`{"notification_id": "` + strings.Repeat("x", 201) + `", "channel": "sms", "to": "x", "text": "t"}`,
		`{"notification_id": "n", "channel": "pigeon", "to": "x", "text": "t"}`,
		`{"notification_id": "n", "channel": "sms", "to": "x", "text": "t", "notification_id": "dup"}`,
		`{"notification_id": "n\ud800", "channel": "sms", "to": "x", "text": "t"}`,
		`{"notification_id": "n\u00e9", "channel": "sms", "to": "\u0031\u0032", "text": "\u0020"}`,
		`{"NOTIFICATION_ID": "n", "Channel": "SmS", "TO": "x", "Text": "t"}`,
		`{"notification_id": 5, "channel": "sms", "to": "x", "text": "t"}`,
		strings.Repeat("[", 64),
		`{"notification_id": "'; DROP TABLE notification_log; --", "channel": "email", "to": "$$", "text": "\\"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		r, err := parseRequest(payload)
		if err != nil {
			require.ErrorIs(t, err, ErrInvalidRequest)
			return
		}
		require.True(t, utf8.Valid(payload))
		require.Contains(t, []string{"sms", "email"}, r.Channel)
		require.NotEmpty(t, strings.TrimSpace(r.NotificationID))
		require.LessOrEqual(t, len(r.NotificationID), 200)
		require.NotEmpty(t, strings.TrimSpace(r.To))
		require.NotEmpty(t, r.Text)
		for field, v := range map[string]string{"notification_id": r.NotificationID, "to": r.To} {
			require.True(t, utf8.ValidString(v), "accepted %s %q is not valid UTF-8", field, v)
			require.NotContains(t, v, "\x00",
				"accepted %s %q holds a NUL byte: PostgreSQL text cannot store it, so the notification is sent and then never recorded", field, v)
		}
		again, err := json.Marshal(r)
		require.NoError(t, err)
		back, err := parseRequest(again)
		require.NoError(t, err)
		require.Equal(t, r, back)
	})
}

// fuzzValue decodes one AMQP field value of any type amqp091 supports from
// data (nested tables and arrays up to depth 3) and returns the rest.
func fuzzValue(data []byte, depth int) (any, []byte) {
	if len(data) == 0 {
		return nil, nil
	}
	kind, data := data[0]%17, data[1:]
	take := func(n int) []byte {
		b := make([]byte, n)
		copy(b, data)
		if n > len(data) {
			n = len(data)
		}
		data = data[n:]
		return b
	}
	str := func() string {
		if len(data) == 0 {
			return ""
		}
		n := int(data[0])
		data = data[1:]
		return string(take(min(n, len(data))))
	}
	switch kind {
	case 0:
		return str(), data
	case 1:
		return []byte(str()), data
	case 2:
		return int8(take(1)[0]), data
	case 3:
		return int16(binary.BigEndian.Uint16(take(2))), data
	case 4:
		return int32(binary.BigEndian.Uint32(take(4))), data
	case 5:
		return int64(binary.BigEndian.Uint64(take(8))), data
	case 6:
		return math.Float32frombits(binary.BigEndian.Uint32(take(4))), data
	case 7:
		return math.Float64frombits(binary.BigEndian.Uint64(take(8))), data
	case 8:
		return take(1)[0]%2 == 1, data
	case 9:
		return nil, data
	case 10:
		return time.Unix(int64(binary.BigEndian.Uint64(take(8))), 0), data
	case 11:
		b := take(5)
		return amqp.Decimal{Scale: b[0], Value: int32(binary.BigEndian.Uint32(b[1:]))}, data
	case 12:
		return take(1)[0], data
	case 13:
		return binary.BigEndian.Uint16(take(2)), data
	case 14:
		return binary.BigEndian.Uint32(take(4)), data
	case 15:
		if depth >= 3 {
			return str(), data
		}
		var tbl amqp.Table
		tbl, data = fuzzTable(data, depth+1, 4)
		return tbl, data
	default:
		if depth >= 3 {
			return str(), data
		}
		var arr []any
		n := 0
		if len(data) > 0 {
			n, data = int(data[0]%4), data[1:]
		}
		for range n {
			var v any
			v, data = fuzzValue(data, depth+1)
			arr = append(arr, v)
		}
		return arr, data
	}
}

// fuzzTable decodes up to max entries (key: a length-prefixed string of at
// most 255 bytes, as AMQP allows; value: fuzzValue).
func fuzzTable(data []byte, depth, max int) (amqp.Table, []byte) {
	tbl := amqp.Table{}
	for i := 0; i < max && len(data) > 0; i++ {
		n := int(data[0])
		data = data[1:]
		n = min(n, len(data))
		key := string(data[:n])
		data = data[n:]
		var v any
		v, data = fuzzValue(data, depth)
		tbl[key] = v
	}
	return tbl, data
}

// FuzzNotifierMarshaler: the notifier's marshaler (rabbitmq.Marshaler, from
// amqpConfig) takes any delivery without panicking or failing (a failing
// Unmarshal is a nack-and-requeue loop in watermill-amqp). Its identity is
// the Watermill UUID header when it is non-empty text (a string or bytes),
// else message_id; every other header becomes metadata under the same name,
// strings and bytes unchanged, nil as "", other values as JSON text when
// they have a JSON form; the body is kept; and Marshal then Unmarshal keeps
// the identity and the metadata.
func FuzzNotifierMarshaler(f *testing.F) {
	f.Add("mid-1", []byte{}, []byte(`{"k":1}`))
	f.Add("", []byte{0, 23, '_', 'w', 'a', 't', 'e', 'r', 'm', 'i', 'l', 'l', '_', 'm', 'e', 's', 's', 'a', 'g', 'e', '_', 'u', 'u', 'i', 'd', 0, 4, 'w', 'm', '-', '1'}, []byte{})
	f.Add("mid", []byte{7, 'x', '-', 'd', 'e', 'a', 't', 'h', 16, 1, 15, 5, 'c', 'o', 'u', 'n', 't', 5, 0, 0, 0, 0, 0, 0, 0, 2}, []byte("\x00\xff"))
	f.Add("m", []byte{1, 'n', 7, 0x7f, 0xf8, 0, 0, 0, 0, 0, 1, 1, 't', 10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, []byte(nil))
	f.Add("\xff\x00", []byte{23, '_', 'w', 'a', 't', 'e', 'r', 'm', 'i', 'l', 'l', '_', 'm', 'e', 's', 's', 'a', 'g', 'e', '_', 'u', 'u', 'i', 'd', 4, 0, 0, 0, 42}, []byte("x"))
	m := amqpConfig(testenv.AMQPURL()).Marshaler
	f.Fuzz(func(t *testing.T, messageID string, headers, body []byte) {
		tbl, _ := fuzzTable(headers, 0, 8)
		d := amqp.Delivery{MessageId: messageID, Headers: tbl, Body: body}
		msg, err := m.Unmarshal(d)
		require.NoError(t, err)
		require.NotNil(t, msg)
		require.Equal(t, string(body), string(msg.Payload))

		wantUUID := ""
		switch v := tbl[wamqp.DefaultMessageUUIDHeaderKey].(type) {
		case string:
			wantUUID = v
		case []byte:
			wantUUID = string(v)
		}
		if wantUUID == "" {
			wantUUID = messageID
		}
		require.Equal(t, wantUUID, msg.UUID)

		_, leaked := msg.Metadata[wamqp.DefaultMessageUUIDHeaderKey]
		require.False(t, leaked, "the UUID header is not metadata")
		want := len(tbl)
		if _, ok := tbl[wamqp.DefaultMessageUUIDHeaderKey]; ok {
			want--
		}
		require.Len(t, msg.Metadata, want)
		for k, v := range tbl {
			if k == wamqp.DefaultMessageUUIDHeaderKey {
				continue
			}
			got, ok := msg.Metadata[k]
			require.True(t, ok, "header %q is missing from the metadata", k)
			switch tv := v.(type) {
			case string:
				require.Equal(t, tv, got)
			case []byte:
				require.Equal(t, string(tv), got)
			case nil:
				require.Empty(t, got)
			case time.Time:
				require.Equal(t, tv.UTC().Format(time.RFC3339Nano), got)
			default:
				if _, err := json.Marshal(v); err == nil {
					require.True(t, json.Valid([]byte(got)), "header %q: %q is not JSON", k, got)
				}
			}
		}

		p, err := m.Marshal(msg)
		require.NoError(t, err)
		require.NoError(t, p.Headers.Validate(), "Marshal writes headers AMQP can encode")
		back, err := m.Unmarshal(amqp.Delivery{Headers: p.Headers, Body: p.Body})
		require.NoError(t, err)
		require.Equal(t, msg.UUID, back.UUID)
		require.Equal(t, msg.Metadata, back.Metadata)
	})
}

// A message RabbitMQ really dead-lettered (its x-death header is an array
// of tables, added by the broker), a message with number and nested-table
// headers, and a message identified only by message_id all go through a
// router whose watermill-amqp subscriber uses the notifier's configuration
// (rabbitmq.Marshaler), and the exactly-once middleware: each is processed
// once under its own identity, x-death arrives as JSON text, and nothing is
// left in the queue. (With
// watermill-amqp's DefaultMarshaler the same deliveries never reach the
// router: tests/untrusted_input_test.go, TestNonStringHeadersWithDefaultMarshaler.)
func TestNotifierMarshalerRealDeadLetter(t *testing.T) {
	t.Parallel()
	in := testenv.Queue(t, "ntdl_in_")
	conn := testenv.AMQPConn(t)
	ch, err := conn.Channel()
	require.NoError(t, err)
	t.Cleanup(func() { _ = ch.Close() })
	require.NoError(t, ch.Confirm(false))
	publish := func(queue string, p amqp.Publishing) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, p)
		require.NoError(t, err)
		ok, err := dc.WaitContext(ctx)
		require.NoError(t, err)
		require.True(t, ok)
	}
	depth := func() int {
		q, err := ch.QueueDeclarePassive(in, true, false, false, false, nil)
		require.NoError(t, err)
		return q.Messages
	}

	// Dead-lettering for real: a queue whose messages expire at once into in.
	src := testenv.Unique(t, "ntdl_src_")
	_, err = ch.QueueDeclare(src, true, false, false, false, amqp.Table{
		"x-message-ttl": int32(0), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": in,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		if c, err := amqp.Dial(testenv.AMQPURL()); err == nil {
			if ch, err := c.Channel(); err == nil {
				_, _ = ch.QueueDelete(src, false, false, false)
			}
			_ = c.Close()
		}
	})
	publish(src, amqp.Publishing{MessageId: "dead-1", Body: []byte(`{"case":"x-death"}`), DeliveryMode: amqp.Persistent})
	require.Eventually(t, func() bool { return depth() == 1 }, 30*time.Second, 20*time.Millisecond, "not dead-lettered")
	publish(in, amqp.Publishing{MessageId: "numbers-1", DeliveryMode: amqp.Persistent, Body: []byte(`{"case":"numbers"}`),
		Headers: amqp.Table{"retries": int32(3), "ratio": 0.5, "nested": amqp.Table{"a": amqp.Table{"b": int64(1)}, "l": []any{"x", int16(2)}}}})
	publish(in, amqp.Publishing{Headers: amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: "wm-1", "x-death": []any{amqp.Table{"count": int64(1)}}},
		DeliveryMode: amqp.Persistent, Body: []byte(`{"case":"watermill header"}`)})

	eo, err := exactlyonce.New(exactlyonce.Config{DB: testenv.Schema(t), Lease: &exactlyonce.LeaseConfig{}, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	sub, err := wamqp.NewSubscriber(amqpConfig(testenv.AMQPURL()), watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	var mu sync.Mutex
	seen := map[string]message.Metadata{}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(eo.Middleware)
	r.AddConsumerHandler("notifier-dlq-reader", in, sub, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if _, dup := seen[msg.UUID]; dup {
			return errors.New("handler ran twice for " + msg.UUID)
		}
		seen[msg.UUID] = msg.Metadata
		return nil
	})
	testenv.StartRouter(t, r)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == 3
	}, 30*time.Second, 20*time.Millisecond, "not every message was processed")
	require.NoError(t, r.Close())
	// An ack still on its way when the router closed sends the delivery
	// back to the queue: allowed only for a message already processed (its
	// redelivery would be a duplicate), never for one that was not.
	mu.Lock()
	defer mu.Unlock()
	for {
		d, ok, err := ch.Get(in, true)
		require.NoError(t, err)
		if !ok {
			break
		}
		id := d.MessageId
		if h, isString := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string); isString && h != "" {
			id = h
		}
		require.Contains(t, seen, id, "a message left in the queue was never processed")
		t.Logf("%s was requeued by the router's close after being processed (its ack was in flight)", id)
	}
	require.Contains(t, seen, "dead-1")
	require.Contains(t, seen, "numbers-1")
	require.Contains(t, seen, "wm-1")
	var xdeath []map[string]any
	require.NoError(t, json.Unmarshal([]byte(seen["dead-1"].Get("x-death")), &xdeath), "x-death: %q", seen["dead-1"].Get("x-death"))
	require.Len(t, xdeath, 1)
	require.Equal(t, "expired", xdeath[0]["reason"])
	require.Equal(t, src, xdeath[0]["queue"])
	require.Equal(t, "expired", seen["dead-1"].Get("x-first-death-reason"))
	require.Equal(t, "3", seen["numbers-1"].Get("retries"))
	require.JSONEq(t, `{"a":{"b":1},"l":["x",2]}`, seen["numbers-1"].Get("nested"))
}

// A send request that parseRequest accepts but whose notification_id or
// recipient holds a NUL byte (valid JSON: "\u0000") cannot be recorded in
// notification_log (PostgreSQL text). Expected, as for any request that can
// never be processed: dead-lettered with the reason, provider not called;
// the good request behind it is sent once.
func TestNotifierUnstorableRequestIsDeadLettered(t *testing.T) {
	t.Parallel()
	n := startNotifier(t, notifierOptions{})
	bad := []string{"nul-id", "nul-to"}
	n.publish(
		request("nul-id", SendRequest{NotificationID: "n-nul\x00", Channel: "sms", To: "+380500000001", Text: "hi"}),
		request("nul-to", SendRequest{NotificationID: "n-nul-to", Channel: "sms", To: "+38050\x000000002", Text: "hi"}),
		request("good-1", SendRequest{NotificationID: "n-good", Channel: "sms", To: "+380500000003", Text: "hi"}),
	)
	n.waitFor(30*time.Second, "the good request sent", func() (bool, string) {
		_, ok := n.logRows()["n-good"]
		return ok, "not yet"
	})
	sms, _ := n.providerCalls()
	require.Equal(t, 1, sms[idemKey("good-1")], "the good request is sent once")
	n.waitFor(15*time.Second, "the unstorable requests dead-lettered", func() (bool, string) {
		sms, _ := n.providerCalls()
		dead := n.depth(n.dead)
		return dead == len(bad), "dead-lettered " + strconv.Itoa(dead) + " of " + strconv.Itoa(len(bad)) +
			"; provider calls: nul-id " + strconv.Itoa(sms[idemKey("nul-id")]) + ", nul-to " + strconv.Itoa(sms[idemKey("nul-to")])
	})
	sms, _ = n.providerCalls()
	for _, b := range bad {
		require.Zero(t, sms[idemKey(b)], "%s: the provider was called for a request that can never be recorded", b)
	}
	n.stop(30 * time.Second)
}

// FuzzParseReceipt: the webhook's parser never panics, and whatever it
// accepts can be stored and applied (required fields present, no NUL,
// bounded, valid UTF-8); everything else is errInvalidReceipt.
func FuzzParseReceipt(f *testing.F) {
	for _, seed := range []string{
		`{"notification_id": "n-1", "status": "delivered"}`,
		`{"notification_id": "n-1"}`,
		`{"notification_id": "n\u0000", "status": "delivered"}`,
		`{"notification_id": 7, "status": "delivered"}`,
		`not json`, ``, "\xff\xfe",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		rc, err := parseReceipt(body)
		if err != nil {
			require.ErrorIs(t, err, errInvalidReceipt)
			return
		}
		require.NotEmpty(t, strings.TrimSpace(rc.NotificationID))
		require.NotEmpty(t, strings.TrimSpace(rc.Status))
		require.LessOrEqual(t, len(rc.Status), 32)
		require.LessOrEqual(t, len(rc.NotificationID), 200)
		require.True(t, utf8.ValidString(rc.NotificationID+rc.Status))
		require.NotContains(t, rc.NotificationID+rc.Status, "\x00")
	})
}
