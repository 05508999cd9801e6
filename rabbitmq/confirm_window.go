package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"strconv"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// confirmation is a publishing's pending publisher confirm
// (*amqp091.DeferredConfirmation): Done is closed once the broker acked or
// nacked it, or its channel closed (then Acked is false).
type confirmation interface {
	Done() <-chan struct{}
	Acked() bool
}

// confirmChannel is what the confirm window uses of a channel in confirm
// mode and its connection: amqpChannel is the real one (publisher_channel.go),
// the window's tests use a fake.
type confirmChannel interface {
	// Publish publishes pub to the default exchange with routing key key,
	// mandatory, and returns its pending confirm. An error means it was not
	// sent.
	Publish(ctx context.Context, key string, pub amqp091.Publishing) (confirmation, error)
	// Returned returns the publishings the broker returned (basic.return)
	// and not yet taken, and forgets them. Every return of a publishing
	// whose confirm is done is among them: the broker sends a return before
	// its message's confirm.
	Returned() []amqp091.Return
	// Closed reports whether the channel closed (it does with its
	// connection).
	Closed() bool
	// ConnClosed reports whether the connection closed.
	ConnClosed() bool
	// Blocked reports whether the broker blocked the connection
	// (connection.blocked: a memory or disk alarm).
	Blocked() bool
	// FrameMax is the connection's negotiated frame size, 0 if unknown.
	FrameMax() int
}

// window publishes messages of one call on one channel, in order, keeping
// up to size of them awaiting their confirm, and sets each message's outcome
// that the channel decides: confirmed, nacked, returned, or refused by the
// client (see run). A window is used once.
type window struct {
	ch      confirmChannel
	size    int           // most messages awaiting their confirm (>= 1)
	timeout time.Duration // PublisherConfig.ConfirmTimeout, from each publish
	b       *outcomes

	queue []inFlight   // awaiting their confirm, in publish order
	sent  []int        // published, in publish order
	acked map[int]bool // confirmed by a basic.ack (returned ones too)
	r     runResult
}

// inFlight is a published message awaiting its confirm.
type inFlight struct {
	i  int // index in b
	dc confirmation
	at time.Time // published
}

// runResult is what run left undone.
type runResult struct {
	lost    []int    // published, the channel closed (or no confirm came) before their confirm
	unsent  []int    // not published: the channel closed first, or the connection is blocked
	ctxErr  error    // ctx ended: every message without an outcome failed with it
	timeout error    // no confirm within ConfirmTimeout: the channel must go
	blocked bool     // stopped publishing: the broker blocked the connection
	nacked  bool     // the broker nacked a message: the channel is not to be used again
	noRoute []string // topics of messages returned as unroutable
}

// runWindow publishes the messages idx of b on ch, in order, keeping up to
// size of them unconfirmed, and waits for their confirms (see window.run).
func runWindow(ctx context.Context, ch confirmChannel, b *outcomes, idx []int, size int, timeout time.Duration) runResult {
	w := &window{ch: ch, size: size, timeout: timeout, b: b, acked: map[int]bool{}}
	return w.run(ctx, idx)
}

// run publishes the messages idx, in order, keeping up to w.size of them
// unconfirmed, and waits for their confirms. It sets the outcome of each
// message confirmed, nacked, returned or refused by the client (too large
// for a frame, or a publish error while the channel stays open: permanent);
// when ctx ends, every message without an outcome fails with ctx's error.
// The others are in the result: lost (published, no confirm: the channel
// closed, or the oldest had none within w.timeout) and unsent (the channel
// closed, or the broker blocked the connection, before their turn).
func (w *window) run(ctx context.Context, idx []int) runResult {
	b := w.b
	for k, i := range idx {
		for len(w.queue) >= w.size {
			if !w.await(ctx) {
				return w.stopped(ctx, idx[k:])
			}
		}
		if w.ch.Closed() {
			w.r.unsent = idx[k:]
			break
		}
		if w.ch.Blocked() {
			// A resource alarm: the broker stopped reading from
			// publishers (a write would block until it ends).
			w.r.unsent, w.r.blocked = idx[k:], true
			break
		}
		if err := frameFits(w.ch.FrameMax(), b.topics[i], b.pubs[i]); err != nil {
			b.set(i, permanent(fmt.Errorf("rabbitmq: %s cannot be sent: %w", b.name(i), err)))
			continue
		}
		dc, err := w.ch.Publish(ctx, b.topics[i], b.pubs[i])
		if err != nil {
			if ctx.Err() != nil {
				return w.cancelled(ctx, idx[k:])
			}
			var netErr net.Error
			if w.ch.Closed() || errors.Is(err, amqp091.ErrClosed) || errors.As(err, &netErr) || w.ch.ConnClosed() {
				// The channel or the connection went (a write on a dead
				// socket): this message and the rest are unsent.
				w.r.unsent = idx[k:]
				break
			}
			// Refused by the client before sending (a header of a type AMQP
			// cannot carry): this message fails alone.
			b.set(i, permanent(fmt.Errorf("rabbitmq: publishing %s: %w", b.name(i), err)))
			continue
		}
		w.queue = append(w.queue, inFlight{i, dc, time.Now()})
		w.sent = append(w.sent, i)
	}
	for len(w.queue) > 0 {
		if !w.await(ctx) {
			return w.stopped(ctx, w.r.unsent)
		}
	}
	w.settle()
	return w.r
}

// await waits for the oldest message in flight; false if ctx ended or its
// confirm did not come within w.timeout (w.r.timeout is set then). An ack
// is settled later (settle: it may have been returned); a nack fails the
// message (not permanent: the queue's state) and marks the channel as one
// not to use again (see Publisher.publish); a confirm done because the
// channel closed leaves it lost.
func (w *window) await(ctx context.Context) bool {
	f := w.queue[0]
	timer := time.NewTimer(time.Until(f.at.Add(w.timeout)))
	defer timer.Stop()
	select {
	case <-f.dc.Done():
	case <-ctx.Done():
		return false
	case <-timer.C:
		w.r.timeout = fmt.Errorf("rabbitmq: no confirm for %s within %s (PublisherConfig.ConfirmTimeout), so the outcome is unknown", w.b.name(f.i), w.timeout)
		return false
	}
	w.queue = w.queue[1:]
	switch {
	case f.dc.Acked():
		w.acked[f.i] = true
	case w.ch.Closed():
		w.r.lost = append(w.r.lost, f.i)
	default:
		w.b.set(f.i, fmt.Errorf("rabbitmq: the broker nacked %s (basic.nack)", w.b.name(f.i)))
		w.r.nacked = true
	}
	return true
}

// cancelled ends the run when ctx ended: the acked messages are settled,
// those in flight and unsent fail with ctx's error.
func (w *window) cancelled(ctx context.Context, unsent []int) runResult {
	w.settle()
	err := ctx.Err()
	for _, f := range w.queue {
		w.b.set(f.i, fmt.Errorf("rabbitmq: %s not confirmed before the context ended: %w", w.b.name(f.i), err))
	}
	for _, i := range unsent {
		w.b.set(i, fmt.Errorf("rabbitmq: %s not published, the context ended: %w", w.b.name(i), err))
	}
	w.r.ctxErr = err
	return w.r
}

// stopped ends the run after await returned false: a timeout leaves the
// messages in flight without an outcome (lost) and the rest unsent;
// otherwise ctx ended.
func (w *window) stopped(ctx context.Context, unsent []int) runResult {
	if w.r.timeout == nil {
		return w.cancelled(ctx, unsent)
	}
	w.settle()
	for _, f := range w.queue {
		w.r.lost = append(w.r.lost, f.i)
	}
	w.r.unsent = unsent
	return w.r
}

// settle sets the outcome of the acked messages among w.sent: returned, or
// confirmed. A return names its publishing by the PublishingHeader stamped
// on it (see stamp): it fails exactly that message, whatever the marshaler
// set (many publishings may share a routing key, a message_id and a body).
// A return without the stamp cannot be attributed: every acked message to
// its routing key fails then (unconfirmed, published again: at-least-once,
// never lost).
func (w *window) settle() {
	b, sent := w.b, w.sent
	returns := w.ch.Returned()
	returned := map[int]*amqp091.Return{}
	if len(returns) > 0 {
		byID := make(map[string]int, len(sent))
		for _, i := range sent {
			byID[publishingID(b.pubs[i].Headers)] = i
		}
		for k := range returns {
			ret := &returns[k]
			if i, ok := byID[publishingID(ret.Headers)]; ok {
				returned[i] = ret
				continue
			}
			for _, i := range sent {
				if b.topics[i] == ret.RoutingKey && returned[i] == nil {
					returned[i] = ret
				}
			}
		}
	}
	for _, i := range sent {
		if !w.acked[i] {
			continue
		}
		if ret := returned[i]; ret != nil {
			if ret.ReplyCode == amqp091.NoRoute {
				w.r.noRoute = append(w.r.noRoute, b.topics[i])
			}
			b.set(i, fmt.Errorf("rabbitmq: %s was returned by the broker: %d %s (no queue is bound to routing key %q on the default exchange)", b.name(i), ret.ReplyCode, ret.ReplyText, ret.RoutingKey))
			continue
		}
		b.set(i, nil)
	}
}

// PublishingHeader is the header Publisher stamps on every publishing with
// an identifier of its own (unique per Publisher), so that a message the
// broker returns (basic.return carries the properties and the body, not the
// delivery tag) is matched to exactly the publishing it belongs to.
// Consumers see it; Marshaler.Unmarshal leaves it out of the metadata.
const PublishingHeader = "_exactlyonce_publishing"

// stamp returns pub with its own PublishingHeader, on a copy of its headers.
func (p *Publisher) stamp(pub amqp091.Publishing) amqp091.Publishing {
	headers := make(amqp091.Table, len(pub.Headers)+1)
	maps.Copy(headers, pub.Headers)
	headers[PublishingHeader] = p.prefix + strconv.FormatUint(p.stamps.Add(1), 36)
	pub.Headers = headers
	return pub
}

// publishingID is the PublishingHeader of headers, "" when absent.
func publishingID(headers amqp091.Table) string {
	id, _ := headers[PublishingHeader].(string)
	return id
}
