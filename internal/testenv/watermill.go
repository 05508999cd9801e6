package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// Logger is a Watermill logger that writes warnings and errors to the test
// log; set TEST_DEBUG=1 for debug level.
func Logger(t testing.TB) watermill.LoggerAdapter {
	return watermill.NewStdLogger(false, false)
}

// AMQPPublisher returns a watermill-amqp publisher for durable queues named
// like the topic, with publisher confirms and a channel pool, closed at
// cleanup.
func AMQPPublisher(t testing.TB) message.Publisher {
	t.Helper()
	cfg := wamqp.NewDurableQueueConfig(AMQPURL())
	cfg.Publish.ConfirmDelivery = true
	cfg.Publish.ChannelPoolSize = 4
	pub, err := wamqp.NewPublisher(cfg, watermill.NopLogger{})
	require.NoError(t, err, "RabbitMQ at "+AMQPURL()+hint)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// AMQPSubscriber returns a watermill-amqp subscriber for durable queues named
// like the topic, with the given prefetch (0 keeps watermill's 1), closed at
// cleanup.
func AMQPSubscriber(t testing.TB, prefetch int) message.Subscriber {
	t.Helper()
	cfg := wamqp.NewDurableQueueConfig(AMQPURL())
	if prefetch > 0 {
		cfg.Consume.Qos.PrefetchCount = prefetch
	}
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err, "RabbitMQ at "+AMQPURL()+hint)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// StartRouter runs r in the background until cleanup (or until the test
// closes it) and waits until it is running.
func StartRouter(t testing.TB, r *message.Router) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		cancel()
		require.NoError(t, err, "router stopped before running")
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatal("router did not start within 30s")
	}
	t.Cleanup(func() {
		cancel()
		_ = r.Close()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("router stopped with an error: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("router did not stop within 30s")
		}
	})
}

// Eventually polls cond every 20ms until it holds or timeout passes, then
// fails the test with msg. Use it to await an observable state, not as a
// sleep.
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	require.Eventually(t, cond, timeout, 20*time.Millisecond, append([]any{msg}, args...)...)
}

// PartitionSubscriberConfig is the watermill-amqp configuration of a
// subscriber of partition queues (rabbitmq.PartitionedSubscriber): durable
// queues named like the topic, declared with single active consumer, one
// message at a time, rabbitmq.Marshaler.
func PartitionSubscriberConfig(amqpURL string) wamqp.Config {
	cfg := wamqp.NewDurableQueueConfig(amqpURL)
	cfg.Marshaler = rabbitmq.Marshaler{}
	cfg.Queue.Arguments = rabbitmq.PartitionQueueArguments()
	cfg.Consume.Qos.PrefetchCount = 1
	return cfg
}
