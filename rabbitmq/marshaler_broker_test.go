package rabbitmq_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// A PHP/Python/Node-style producer sets message_id and non-string headers;
// the message is then dead-lettered once, so RabbitMQ adds a real x-death
// table. A watermill-amqp subscriber with Marshaler gets UUID "order-42" and
// every header as text; DefaultMarshaler fails on the same delivery, and
// even with PreprocessDelivery dropping the bad headers its UUID is empty.
func TestForeignProducerMessageIDBecomesUUID(t *testing.T) {
	url := amqpURL(t)
	ctx := testContext(t)
	ch := rawChannel(t, url)
	src := uniqueQueue(t, url, "src")
	dst := uniqueQueue(t, url, "dst")

	require.NoError(t, rabbitmq.DeclareQueues(ctx, url, dst))
	_, err := ch.QueueDeclare(src, true, false, false, false, amqp091.Table{
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": dst,
	})
	require.NoError(t, err)

	require.NoError(t, ch.PublishWithContext(ctx, "", src, false, false, amqp091.Publishing{
		MessageId:     "order-42",
		ContentType:   "application/json",
		CorrelationId: "corr-7",
		ReplyTo:       "replies",
		Type:          "OrderPlaced",
		AppId:         "php-shop",
		DeliveryMode:  amqp091.Persistent,
		Headers: amqp091.Table{
			"tenant":  "acme",
			"attempt": int32(3),
			"urgent":  true,
			"origin":  amqp091.Table{"system": "php", "version": int64(8)},
		},
		Body: []byte(`{"order":42}`),
	}))
	// Reject it once: RabbitMQ dead-letters it to dst with an x-death header.
	require.NoError(t, getOne(t, ch, src).Nack(false, false))

	raw := getOne(t, ch, dst)
	require.IsType(t, []any{}, raw.Headers["x-death"], "RabbitMQ added x-death")
	require.NotContains(t, raw.Headers, wamqp.DefaultMessageUUIDHeaderKey)

	t.Run("DefaultMarshaler fails or loses the identity", func(t *testing.T) {
		_, err := wamqp.DefaultMarshaler{}.Unmarshal(raw)
		require.ErrorContains(t, err, "is not a string", "DefaultMarshaler fails the delivery on non-string headers")

		dropNonStrings := wamqp.DefaultMarshaler{PreprocessDelivery: func(d amqp091.Delivery) amqp091.Delivery {
			kept := amqp091.Table{}
			for k, v := range d.Headers {
				if s, ok := v.(string); ok {
					kept[k] = s
				}
			}
			d.Headers = kept
			return d
		}}
		msg, err := dropNonStrings.Unmarshal(raw)
		require.NoError(t, err)
		require.Empty(t, msg.UUID, "PreprocessDelivery runs after the UUID is read: message_id is ignored")
	})
	require.NoError(t, raw.Nack(false, true)) // back in dst for the subscriber

	msg := receive(t, ctx, newSubscriber(t, url, rabbitmq.Marshaler{}), dst)
	require.Equal(t, "order-42", msg.UUID)
	require.JSONEq(t, `{"order":42}`, string(msg.Payload))
	require.Equal(t, "acme", msg.Metadata.Get("tenant"))
	require.Equal(t, "3", msg.Metadata.Get("attempt"))
	require.Equal(t, "true", msg.Metadata.Get("urgent"))
	require.Equal(t, `{"system":"php","version":8}`, msg.Metadata.Get("origin"))
	require.Equal(t, "application/json", msg.Metadata.Get(rabbitmq.MetadataContentType))
	require.Equal(t, "corr-7", msg.Metadata.Get(rabbitmq.MetadataCorrelationID))
	require.Equal(t, "replies", msg.Metadata.Get(rabbitmq.MetadataReplyTo))
	require.Equal(t, "OrderPlaced", msg.Metadata.Get(rabbitmq.MetadataType))
	require.Equal(t, "php-shop", msg.Metadata.Get(rabbitmq.MetadataAppID))

	var deaths []struct {
		Count       int      `json:"count"`
		Reason      string   `json:"reason"`
		Queue       string   `json:"queue"`
		Time        string   `json:"time"`
		RoutingKeys []string `json:"routing-keys"`
	}
	require.NoError(t, json.Unmarshal([]byte(msg.Metadata.Get("x-death")), &deaths), "x-death: %s", msg.Metadata.Get("x-death"))
	require.Len(t, deaths, 1)
	require.Equal(t, 1, deaths[0].Count)
	require.Equal(t, "rejected", deaths[0].Reason)
	require.Equal(t, src, deaths[0].Queue)
	require.Equal(t, []string{src}, deaths[0].RoutingKeys)
	died, err := time.Parse(time.RFC3339, deaths[0].Time)
	require.NoError(t, err)
	require.WithinDuration(t, time.Now(), died, time.Minute)
}

// A message published through watermill-amqp with Marshaler comes back whole
// to a Watermill subscriber, and a plain AMQP consumer sees its UUID as
// message_id.
func TestWatermillRoundTripAndMessageID(t *testing.T) {
	url := amqpURL(t)
	ctx := testContext(t)
	toWatermill := uniqueQueue(t, url, "wm")
	toPlain := uniqueQueue(t, url, "plain")
	require.NoError(t, rabbitmq.DeclareQueues(ctx, url, toWatermill, toPlain))

	cfg := wamqp.NewDurableQueueConfig(url)
	cfg.Marshaler = rabbitmq.Marshaler{}
	cfg.Publish.ConfirmDelivery = true
	pub, err := wamqp.NewPublisher(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	sent := message.NewMessage(watermill.NewUUID(), []byte("payload"))
	sent.Metadata.Set("tenant", "acme")
	sent.Metadata.Set("trace", "t-1")
	require.NoError(t, pub.Publish(toWatermill, sent))
	require.NoError(t, pub.Publish(toPlain, sent))

	got := receive(t, ctx, newSubscriber(t, url, rabbitmq.Marshaler{}), toWatermill)
	require.Equal(t, sent.UUID, got.UUID)
	require.Equal(t, sent.Payload, got.Payload)
	require.Equal(t, sent.Metadata, got.Metadata)

	d := getOne(t, rawChannel(t, url), toPlain)
	require.NoError(t, d.Ack(false))
	require.Equal(t, sent.UUID, d.MessageId)
	require.Equal(t, sent.UUID, d.Headers[wamqp.DefaultMessageUUIDHeaderKey])
	require.Equal(t, amqp091.Persistent, d.DeliveryMode)
	require.Equal(t, "acme", d.Headers["tenant"])
	require.Equal(t, []byte("payload"), d.Body)
}
