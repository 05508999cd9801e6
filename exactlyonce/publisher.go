package exactlyonce

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// OutboxOnly returns the publisher to give router.AddHandler for a handler
// under this middleware. AddHandler needs a publisher to carry the
// handler's publish topic, which the middleware reads as the outbox
// destination; the router itself never publishes for such a handler,
// because the middleware writes the handler's messages to the outbox in its
// transaction and returns none. If messages do reach this publisher, the
// middleware is not wrapping the handler: it refuses them, after a second
// (so that the redelivery loop is slow), with an error that names the
// handler and wraps ErrNoMiddleware (the router nacks, nothing is
// published outside a transaction) instead of publishing them
// non-atomically. Watermill's poison queue cannot take such a message
// (the router publishes after the middlewares returned): add the
// middleware.
//
// A handler with Config.FailOpen needs a real publisher instead: a
// fail-open run hands its messages to the router.
func OutboxOnly() message.Publisher { return outboxOnly{} }

type outboxOnly struct{}

func (outboxOnly) Publish(topic string, messages ...*message.Message) error {
	handler := "this handler"
	if len(messages) > 0 && messages[0] != nil {
		// The router gives the messages it publishes the handler's context.
		if name := message.HandlerNameFromCtx(messages[0].Context()); name != "" {
			handler = fmt.Sprintf("handler %q", name)
		}
	}
	time.Sleep(misconfiguredDelay)
	return fmt.Errorf("exactlyonce: OutboxOnly: the router tried to publish %d message(s) to %q: %w: no AddMiddleware(Guard.Middleware) wraps %s", len(messages), topic, ErrNoMiddleware, handler)
}

func (outboxOnly) Close() error { return nil }
