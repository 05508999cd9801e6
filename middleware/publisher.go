package exactlyonce

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// OutboxOnly returns the publisher to give router.AddHandler for a handler
// under this middleware. AddHandler needs a publisher to carry the
// handler's publish topic, which the middleware reads as the outbox
// destination; the router itself never publishes for such a handler,
// because the middleware writes the handler's messages to the outbox in its
// transaction and returns none. If messages do reach this publisher, the
// middleware is not wrapping the handler: it refuses them with an error
// (the router nacks, nothing is published outside a transaction) instead
// of publishing them non-atomically.
//
// A handler with Config.FailOpen needs a real publisher instead: a
// fail-open run hands its messages to the router.
func OutboxOnly() message.Publisher { return outboxOnly{} }

type outboxOnly struct{}

func (outboxOnly) Publish(topic string, messages ...*message.Message) error {
	return fmt.Errorf("exactlyonce: OutboxOnly: the router tried to publish %d message(s) to %q: the exactly-once middleware does not wrap this handler (add it with router.AddMiddleware or handler.AddMiddleware)", len(messages), topic)
}

func (outboxOnly) Close() error { return nil }
