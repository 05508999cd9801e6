package rabbitmq_test

import (
	"math"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

func TestUnmarshalHeaderConversion(t *testing.T) {
	at := time.Date(2024, 5, 1, 12, 30, 0, 0, time.FixedZone("CEST", 2*3600))
	type point struct{ X, Y int }
	for _, tc := range []struct {
		name  string
		value any
		want  string
	}{
		{"string", "acme", "acme"},
		{"empty string", "", ""},
		{"byte array", []byte("raw bytes"), "raw bytes"},
		{"bool true", true, "true"},
		{"bool false", false, "false"},
		{"int8", int8(-8), "-8"},
		{"uint8", byte(200), "200"},
		{"int16", int16(-1600), "-1600"},
		{"uint16", uint16(1600), "1600"},
		{"int32", int32(3), "3"},
		{"uint32", uint32(4000000000), "4000000000"},
		{"int64", int64(-9007199254740993), "-9007199254740993"},
		{"int", 42, "42"},
		{"float32", float32(1.5), "1.5"},
		{"float64", 0.1, "0.1"},
		{"float64 NaN", math.NaN(), "NaN"},
		{"float64 +Inf", math.Inf(1), "+Inf"},
		{"timestamp in UTC", at, "2024-05-01T10:30:00Z"},
		{"decimal", amqp091.Decimal{Scale: 2, Value: -1234}, "-12.34"},
		{"decimal below one", amqp091.Decimal{Scale: 3, Value: 5}, "0.005"},
		{"decimal scale 0", amqp091.Decimal{Value: 7}, "7"},
		{"void", nil, ""},
		{"array", []any{"a", int32(1), true}, `["a",1,true]`},
		{
			"table with nested values, keys sorted",
			amqp091.Table{"z": []byte("b"), "a": at, "m": amqp091.Decimal{Scale: 1, Value: 15}, "n": math.Inf(-1), "t": amqp091.Table{"k": nil}},
			`{"a":"2024-05-01T10:30:00Z","m":1.5,"n":"-Inf","t":{"k":null},"z":"b"}`,
		},
		{
			"x-death as RabbitMQ sends it",
			[]any{amqp091.Table{
				"count":        int64(2),
				"reason":       "rejected",
				"queue":        "orders",
				"time":         time.Unix(1714559400, 0),
				"exchange":     "",
				"routing-keys": []any{"orders"},
			}},
			`[{"count":2,"exchange":"","queue":"orders","reason":"rejected","routing-keys":["orders"],"time":"2024-05-01T10:30:00Z"}]`,
		},
		{"type no AMQP client produces", point{1, 2}, "{1 2}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg, err := rabbitmq.Marshaler{}.Unmarshal(amqp091.Delivery{
				MessageId: "id-1",
				Headers:   amqp091.Table{"h": tc.value, "other": "x"},
			})
			require.NoError(t, err)
			require.Equal(t, message.Metadata{"h": tc.want, "other": "x"}, msg.Metadata)
		})
	}
}

func TestUnmarshalUUID(t *testing.T) {
	const h = wamqp.DefaultMessageUUIDHeaderKey
	for _, tc := range []struct {
		name      string
		marshaler rabbitmq.Marshaler
		headers   amqp091.Table
		messageID string
		want      string
	}{
		{"Watermill header wins over message_id", rabbitmq.Marshaler{}, amqp091.Table{h: "wm-uuid"}, "order-42", "wm-uuid"},
		{"message_id when no header", rabbitmq.Marshaler{}, amqp091.Table{"a": "b"}, "order-42", "order-42"},
		{"message_id when no headers at all", rabbitmq.Marshaler{}, nil, "order-42", "order-42"},
		{"message_id when header is empty", rabbitmq.Marshaler{}, amqp091.Table{h: ""}, "order-42", "order-42"},
		{"message_id when header is not text", rabbitmq.Marshaler{}, amqp091.Table{h: int32(7)}, "order-42", "order-42"},
		{"header as byte array", rabbitmq.Marshaler{}, amqp091.Table{h: []byte("wm-uuid")}, "", "wm-uuid"},
		{"neither: empty, never invented", rabbitmq.Marshaler{}, amqp091.Table{"a": "b"}, "", ""},
		{"custom UUIDHeader", rabbitmq.Marshaler{UUIDHeader: "x-id"}, amqp091.Table{"x-id": "custom", h: "ignored"}, "order-42", "custom"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg, err := tc.marshaler.Unmarshal(amqp091.Delivery{Headers: tc.headers, MessageId: tc.messageID, Body: []byte("body")})
			require.NoError(t, err)
			require.Equal(t, tc.want, msg.UUID)
			require.Equal(t, []byte("body"), []byte(msg.Payload))
			key := tc.marshaler.UUIDHeader
			if key == "" {
				key = h
			}
			require.NotContains(t, msg.Metadata, key, "the UUID header is not metadata")
		})
	}
}

// The Publisher's own stamp on every publishing is not the message's
// metadata.
func TestUnmarshalLeavesOutThePublishingHeader(t *testing.T) {
	msg, err := rabbitmq.Marshaler{}.Unmarshal(amqp091.Delivery{
		Headers: amqp091.Table{rabbitmq.PublishingHeader: "abc-1", "order_id": "42"}, MessageId: "m"})
	require.NoError(t, err)
	require.Equal(t, map[string]string{"order_id": "42"}, map[string]string(msg.Metadata))
}

func TestUnmarshalAMQPProperties(t *testing.T) {
	msg, err := rabbitmq.Marshaler{}.Unmarshal(amqp091.Delivery{
		ContentType:   "application/json",
		CorrelationId: "corr-7",
		ReplyTo:       "replies",
		Type:          "OrderPlaced",
		AppId:         "php-shop",
		MessageId:     "order-42",
		UserId:        "guest",
		Headers:       amqp091.Table{rabbitmq.MetadataAppID: "from-header"},
	})
	require.NoError(t, err)
	require.Equal(t, message.Metadata{
		rabbitmq.MetadataContentType:   "application/json",
		rabbitmq.MetadataCorrelationID: "corr-7",
		rabbitmq.MetadataReplyTo:       "replies",
		rabbitmq.MetadataType:          "OrderPlaced",
		rabbitmq.MetadataAppID:         "from-header", // a header wins over the property
	}, msg.Metadata)
	require.Equal(t, "amqp_content_type", rabbitmq.MetadataContentType)

	msg, err = rabbitmq.Marshaler{}.Unmarshal(amqp091.Delivery{MessageId: "x"})
	require.NoError(t, err)
	require.Empty(t, msg.Metadata, "unset properties add no metadata")
}

func TestMarshal(t *testing.T) {
	msg := message.NewMessage("uuid-1", []byte("payload"))
	msg.Metadata.Set("tenant", "acme")
	msg.Metadata.Set(rabbitmq.MetadataContentType, "text/plain")

	p, err := rabbitmq.Marshaler{}.Marshal(msg)
	require.NoError(t, err)
	require.Equal(t, amqp091.Table{
		"tenant":                          "acme",
		rabbitmq.MetadataContentType:      "text/plain", // written back as a header, as it is
		wamqp.DefaultMessageUUIDHeaderKey: "uuid-1",
	}, p.Headers)
	require.Equal(t, "uuid-1", p.MessageId)
	require.Equal(t, amqp091.Persistent, p.DeliveryMode)
	require.Empty(t, p.ContentType)
	require.Equal(t, []byte("payload"), p.Body)
	require.NoError(t, p.Headers.Validate())

	// Same publishing as watermill-amqp's DefaultMarshaler, plus message_id.
	def, err := wamqp.DefaultMarshaler{}.Marshal(msg)
	require.NoError(t, err)
	def.MessageId = msg.UUID
	require.Equal(t, def, p)

	// DefaultMarshaler reads it back, and so does Marshaler.
	d := amqp091.Delivery{Headers: p.Headers, MessageId: p.MessageId, DeliveryMode: p.DeliveryMode, Body: p.Body}
	for _, m := range []wamqp.Marshaler{wamqp.DefaultMarshaler{}, rabbitmq.Marshaler{}} {
		back, err := m.Unmarshal(d)
		require.NoError(t, err)
		require.True(t, back.Equals(msg), "%T: got %s %v", m, back.UUID, back.Metadata)
	}

	p, err = rabbitmq.Marshaler{NotPersistent: true, UUIDHeader: "x-id"}.Marshal(msg)
	require.NoError(t, err)
	require.Equal(t, uint8(0), p.DeliveryMode)
	require.Equal(t, "uuid-1", p.Headers["x-id"])
	require.NotContains(t, p.Headers, wamqp.DefaultMessageUUIDHeaderKey)

	_, err = rabbitmq.Marshaler{}.Marshal(nil)
	require.ErrorContains(t, err, "rabbitmq: ")
}
