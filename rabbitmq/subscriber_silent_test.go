package rabbitmq_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// A connection gone silent (a network partition: no EOF, no reset; the
// proxy's Blackhole) answers nothing until the heartbeat gives it up, 20 s
// and more later, and a broker that accepts the TCP connection and says
// nothing holds a dial for the URL's connection_timeout (30 s): Subscribe,
// Close and the end of a context must not wait for either.

// Subscribe on a connection that went silent (a network partition: no EOF,
// no reset) returns when its context ends, not when the heartbeat gives the
// connection up; and Close then returns too.
func TestSubscriberSubscribeOnSilentConnectionHonoursContext(t *testing.T) {
	url := amqpURL(t)
	proxy, purl := proxied(t, url)
	sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: purl, CloseTimeout: 200 * time.Millisecond, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	_, err = sub.Subscribe(testContext(t), uniqueQueue(t, url, "sub-silent1"))
	require.NoError(t, err)
	proxy.Blackhole()
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	returnsWithin(t, 5*time.Second, "Subscribe on a silent connection", func() {
		_, err = sub.Subscribe(ctx, uniqueQueue(t, url, "sub-silent2"))
	})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	returnsWithin(t, 8*time.Second, "Close on a silent connection", func() { _ = sub.Close() })
}

// Close while a subscription is connecting again to a broker that accepts
// the TCP connection and then says nothing: Close ends the attempt.
func TestSubscriberCloseDuringSilentReconnect(t *testing.T) {
	url := amqpURL(t)
	proxy, purl := proxied(t, url)
	sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: purl, ReconnectDelay: 300 * time.Millisecond, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	msgs, err := sub.Subscribe(testContext(t), uniqueQueue(t, url, "sub-silent-reconnect"))
	require.NoError(t, err)
	proxy.Refuse()
	testenv.Eventually(t, 10*time.Second, func() bool { return proxy.Stats().Refused > 0 }, "an attempt refused")
	proxy.Allow()
	proxy.Blackhole() // the next attempt connects and hears nothing
	testenv.Eventually(t, 10*time.Second, func() bool { return proxy.Stats().Accepted == 2 }, "an attempt in progress")
	time.Sleep(100 * time.Millisecond)
	returnsWithin(t, 5*time.Second, "Close during a silent reconnect", func() { require.NoError(t, sub.Close()) })
	_, open := <-msgs
	require.False(t, open)
}

// The end of Subscribe's context while a subscription connects again to a
// silent broker ends it.
func TestSubscriberContextEndsDuringSilentReconnect(t *testing.T) {
	url := amqpURL(t)
	proxy, purl := proxied(t, url)
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: purl, ReconnectDelay: 300 * time.Millisecond})
	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	msgs, err := sub.Subscribe(ctx, uniqueQueue(t, url, "sub-silent-ctx"))
	require.NoError(t, err)
	proxy.Refuse()
	testenv.Eventually(t, 10*time.Second, func() bool { return proxy.Stats().Refused > 0 }, "an attempt refused")
	proxy.Allow()
	proxy.Blackhole()
	testenv.Eventually(t, 10*time.Second, func() bool { return proxy.Stats().Accepted == 2 }, "an attempt in progress")
	time.Sleep(100 * time.Millisecond)
	cancel()
	returnsWithin(t, 5*time.Second, "the subscription's end", func() {
		for range msgs {
		}
	})
}

// Subscribe's context ending during the first connection to a silent
// broker: Subscribe returns with the context's error.
func TestSubscriberFirstDialSilentHonoursContext(t *testing.T) {
	url := amqpURL(t)
	proxy, purl := proxied(t, url)
	proxy.Blackhole()
	sub := newOwnSubscriber(t, rabbitmq.SubscriberConfig{URL: purl})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var err error
	returnsWithin(t, 5*time.Second, "Subscribe", func() { _, err = sub.Subscribe(ctx, "x") })
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// Close during the first Subscribe's connection to a silent broker (a
// Subscribe without deadline): Close ends it.
func TestSubscriberCloseDuringSilentFirstDial(t *testing.T) {
	url := amqpURL(t)
	proxy, purl := proxied(t, url)
	proxy.Blackhole()
	sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: purl, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	subscribed := make(chan error, 1)
	go func() {
		_, err := sub.Subscribe(context.Background(), "x")
		subscribed <- err
	}()
	testenv.Eventually(t, 10*time.Second, func() bool { return proxy.Stats().Accepted == 1 }, "dialing")
	time.Sleep(100 * time.Millisecond)
	returnsWithin(t, 5*time.Second, "Close during the first dial", func() { require.NoError(t, sub.Close()) })
	select {
	case err := <-subscribed:
		require.Error(t, err)
	case <-time.After(5 * time.Second):
		require.FailNow(t, "Subscribe still running after Close")
	}
}

// A Subscribe waiting for another one's connection to a silent broker
// returns when its own context ends.
func TestSubscriberWaitForOthersDialHonoursContext(t *testing.T) {
	url := amqpURL(t)
	proxy, purl := proxied(t, url)
	proxy.Blackhole()
	sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: purl, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	first := make(chan error, 1)
	go func() {
		_, err := sub.Subscribe(context.Background(), "x")
		first <- err
	}()
	testenv.Eventually(t, 10*time.Second, func() bool { return proxy.Stats().Accepted == 1 }, "dialing")
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	returnsWithin(t, 5*time.Second, "the second Subscribe", func() { _, err = sub.Subscribe(ctx, "y") })
	require.ErrorIs(t, err, context.DeadlineExceeded)
	returnsWithin(t, 5*time.Second, "Close", func() { require.NoError(t, sub.Close()) })
	require.Error(t, <-first, "the first Subscribe, still dialing, ends with Close")
}
