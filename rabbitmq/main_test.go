package rabbitmq_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// Marshaler must stay usable as watermill-amqp's Config.Marshaler.
var _ wamqp.Marshaler = rabbitmq.Marshaler{}

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const defaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

// amqpURL returns the broker URL (AMQP_URL, else the local default), skipping
// the test when RabbitMQ is unreachable, or failing it when CI=true.
func amqpURL(t testing.TB) string {
	t.Helper()
	url := os.Getenv("AMQP_URL")
	if url == "" {
		url = defaultAMQPURL
	}
	conn, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("RabbitMQ unreachable (AMQP_URL or %s): %v", defaultAMQPURL, err)
		}
		t.Skipf("RabbitMQ unreachable (set AMQP_URL, or run `docker compose up -d`): %v", err)
	}
	require.NoError(t, conn.Close())
	return url
}

func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// rawChannel is a plain amqp091-go channel, standing in for a producer or
// consumer that is not Watermill.
func rawChannel(t testing.TB, url string) *amqp091.Channel {
	t.Helper()
	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	return ch
}

// uniqueQueue returns a fresh queue name, deleting the queue (if anything
// created it) when the test ends.
func uniqueQueue(t testing.TB, url, role string) string {
	t.Helper()
	name := "rabbitmq-test-" + role + "-" + watermill.NewShortUUID()
	t.Cleanup(func() {
		conn, err := amqp091.Dial(url)
		if err != nil {
			return
		}
		defer conn.Close()
		if ch, err := conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(name, false, false, false)
		}
	})
	return name
}

// getOne polls queue until a message is there, leaving it unacked.
func getOne(t *testing.T, ch *amqp091.Channel, queue string) amqp091.Delivery {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		d, ok, err := ch.Get(queue, false)
		require.NoError(t, err)
		if ok {
			return d
		}
		require.True(t, time.Now().Before(deadline), "no message in queue %s within 10s", queue)
		time.Sleep(20 * time.Millisecond)
	}
}

func newSubscriber(t *testing.T, url string, m wamqp.Marshaler) *wamqp.Subscriber {
	t.Helper()
	cfg := wamqp.NewDurableQueueConfig(url)
	cfg.Marshaler = m
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// receive subscribes to queue and returns the first message, acked.
func receive(t *testing.T, ctx context.Context, sub *wamqp.Subscriber, queue string) *message.Message {
	t.Helper()
	msgs, err := sub.Subscribe(ctx, queue)
	require.NoError(t, err)
	select {
	case msg := <-msgs:
		require.NotNil(t, msg)
		msg.Ack()
		return msg
	case <-time.After(10 * time.Second):
		require.FailNow(t, "no message received within 10s", "queue %s", queue)
		return nil
	}
}
