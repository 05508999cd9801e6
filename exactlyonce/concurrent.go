package exactlyonce

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/fanin"
)

// ConcurrentSubscriber returns a message.Subscriber that, for each
// Subscribe, subscribes to sub n times and merges the deliveries into one
// channel. Register a handler with it to have up to n of its deliveries in
// flight at once (Watermill's router runs each delivery it receives in its
// own goroutine) under one handler name, and so under one consumer name:
//
//	router.AddHandler("send-sms", "sms.requested", exactlyonce.ConcurrentSubscriber(sub, 8), ...)
//
// Registering the same handler n times under n names gives the same
// concurrency, but each copy records keys under its own consumer name by
// default, so a redelivery that reaches another copy runs again.
//
// sub must share each message among its subscriptions (competing
// consumers), as watermill-amqp's queue configs do: one consumer and channel
// per Subscribe, one delivery in flight each. With a fan-out subscriber
// (Watermill's GoChannel, watermill-amqp's pub/sub configs) every
// subscription receives every message: nothing breaks, the inbox drops the
// n-1 copies, but the work is done n times over.
// Closing the returned subscriber closes sub. When ctx ends, deliveries
// already taken from sub but not yet handed over are nacked.
func ConcurrentSubscriber(sub message.Subscriber, n int) message.Subscriber {
	return &concurrentSubscriber{sub: sub, n: n}
}

type concurrentSubscriber struct {
	sub       message.Subscriber
	n         int
	closeOnce sync.Once
	closeErr  error
}

func (c *concurrentSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if c.sub == nil {
		return nil, errors.New("exactlyonce: ConcurrentSubscriber: subscriber is nil")
	}
	if c.n < 1 {
		return nil, fmt.Errorf("exactlyonce: ConcurrentSubscriber: n is %d, it must be at least 1", c.n)
	}
	ctx, cancel := context.WithCancel(ctx)
	chans := make([]<-chan *message.Message, 0, c.n)
	for i := range c.n {
		ch, err := c.sub.Subscribe(ctx, topic)
		if err != nil {
			cancel()
			return nil, fmt.Errorf("exactlyonce: ConcurrentSubscriber: subscription %d of %d to %q: %w", i+1, c.n, topic, err)
		}
		chans = append(chans, ch)
	}
	return fanin.Merge(ctx, cancel, chans), nil
}

func (c *concurrentSubscriber) Close() error {
	c.closeOnce.Do(func() {
		if c.sub != nil {
			c.closeErr = c.sub.Close()
		}
	})
	return c.closeErr
}
