// Package fanin merges the channels of several subscriptions into one, for
// the subscribers that wrap a Watermill subscriber several times over
// (exactlyonce.ConcurrentSubscriber, rabbitmq.PartitionedSubscriber).
package fanin

import (
	"context"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Merge forwards every message of chans to the channel it returns, which
// is closed once all of chans are; cancel is called then. When ctx ends,
// a message taken from chans but not handed over is nacked.
func Merge(ctx context.Context, cancel context.CancelFunc, chans []<-chan *message.Message) <-chan *message.Message {
	out := make(chan *message.Message)
	var wg sync.WaitGroup
	for _, ch := range chans {
		wg.Go(func() {
			for msg := range ch {
				select {
				case out <- msg:
				case <-ctx.Done():
					msg.Nack()
				}
			}
		})
	}
	go func() {
		wg.Wait()
		cancel()
		close(out)
	}()
	return out
}
