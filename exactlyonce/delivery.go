package exactlyonce

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// delivery is one message on its way through the middleware. Middleware
// makes it once per message and passes it down to the message's mode
// (transactional, group commit, lease, store-only lease, fail-open). It
// carries what every mode needs (the message, its consumer and key, the
// context with the delivery's process span) and the delivery's Event,
// whose outcome is set once (settle): what Middleware reports to
// Config.OnEvent and returns to the router follows from it.
type delivery struct {
	msg *message.Message
	// orig is the message's context as the router gave it; the message
	// has it whenever none of the middleware's user code runs (under).
	orig context.Context
	// ctx is orig with the delivery's process span: the parent of every
	// context the middleware derives for the delivery.
	ctx      context.Context
	consumer string
	key      string
	ev       Event
	out      []*message.Message // FailOpen: the handler's messages, for the router to publish
	wait     bool               // wait Config.NackDelay before returning the error
	settled  bool
}

// settle records the delivery's outcome, once. err is the error returned
// to the router (Nacked; FailOpen: the handler's), or why the key was
// parked just now (Parked: acked); nil otherwise. A second call is a bug
// of the middleware: it panics in tests (testing.Testing) and is refused
// otherwise, the first outcome kept.
func (d *delivery) settle(o Outcome, err error) {
	if d.settled {
		if testing.Testing() {
			panic(fmt.Sprintf("exactlyonce: the outcome of message %q is set twice: %s (%v), then %s (%v)", d.msg.UUID, d.ev.Outcome, d.ev.Err, o, err))
		}
		return
	}
	d.settled = true
	d.ev.Outcome, d.ev.Err = o, err
}

// nack settles the delivery as Nacked with err.
func (d *delivery) nack(err error) { d.settle(Nacked, err) }

// nackLater settles the delivery as Nacked with err, returned after
// Config.NackDelay: a redelivery at once would fail the same way (the
// database unavailable, a configuration or data error), and the wait keeps
// a router without a poison queue from spinning on it.
func (d *delivery) nackLater(err error) {
	d.nack(err)
	d.wait = true
}

// errUnsettled is what a delivery that no mode settled is nacked with:
// a bug of the middleware, which panics in tests.
var errUnsettled = errors.New("exactlyonce: internal error: the delivery's outcome was not set")

// result is what Middleware returns to the router.
func (d *delivery) result() ([]*message.Message, error) {
	if !d.settled {
		if testing.Testing() {
			panic(fmt.Sprintf("exactlyonce: the outcome of message %q was never set", d.msg.UUID))
		}
		d.nack(errUnsettled)
	}
	switch d.ev.Outcome {
	case Nacked:
		return nil, d.ev.Err
	case FailOpen:
		return d.out, d.ev.Err
	}
	return nil, nil // Parked: its Err is the reason, for the event only
}

// under runs f with the message's context set to ctx, and gives it its
// router's context back: the one place the message's context changes. The
// middleware's user code reads it: Config.Key (under the process span) and
// the handler (under its handler span, with the delivery's values).
func (d *delivery) under(ctx context.Context, f func()) {
	d.msg.SetContext(ctx)
	defer d.msg.SetContext(d.orig)
	f()
}

// runHandler runs h in an "exactlyonce.handler" span, with vals in its
// context (the transaction, the outbox, the lease: what the context
// helpers find), and turns a panic into Watermill's
// middleware.RecoveredPanicError (the value and the stack), wrapped.
func (m *Guard) runHandler(d *delivery, h message.HandlerFunc, vals *handlerValues) (produced []*message.Message, err error) {
	ctx, span := m.tracer.Start(withHandlerContext(d.ctx, vals), "exactlyonce.handler")
	d.under(ctx, func() { produced, err = recoverHandler(h, d.msg) })
	endSpan(span, err)
	return produced, err
}

// parkedNow settles a delivery whose key this delivery parked (a Permanent
// handler error, a completion that can never commit, a store-only
// misconfiguration), its message kept with it: logged with the commands
// that show and replay it, acked.
func (m *Guard) parkedNow(d *delivery, reason error, attempt int) {
	d.settle(Parked, reason)
	show, replay := m.parkedCommands(d.consumer, d.key)
	m.cfg.Logger.Error("exactlyonce: key parked for an operator with its message, message acked; show it: "+show+"; replay it: "+replay, reason,
		watermill.LogFields{"consumer": d.consumer, "key": d.key, "attempt": attempt, "message_uuid": d.msg.UUID})
}
