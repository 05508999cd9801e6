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

// runResult is what run left undone.
type runResult struct {
	lost    []int    // published, the channel closed (or no confirm came) before their confirm
	unsent  []int    // not published: the channel closed first, or the connection is blocked
	ctxErr  error    // ctx ended: every message without an outcome failed with it
	timeout error    // no confirm within ConfirmTimeout: the channel must go
	blocked bool     // stopped publishing: the broker blocked the connection
	noRoute []string // topics of messages returned as unroutable
}

// run publishes the messages idx of b on c, in order, keeping up to window
// of them unconfirmed, and waits for their confirms. It sets the outcome of
// each message confirmed, nacked, returned or refused by the client; the
// others are in the result.
func (c *confirmChannel) run(ctx context.Context, b *outcomes, idx []int, window int) (r runResult) {
	type inFlight struct {
		i  int
		dc *amqp091.DeferredConfirmation
		at time.Time
	}
	var (
		queue []inFlight // awaiting their confirm, in publish order
		sent  []int      // in publish order
		acked = map[int]bool{}
	)
	// await waits for the oldest message in flight; false if ctx ended or
	// its confirm did not come within ConfirmTimeout (r.timeout).
	await := func() bool {
		f := queue[0]
		timer := time.NewTimer(time.Until(f.at.Add(c.confirmTimeout)))
		defer timer.Stop()
		select {
		case <-f.dc.Done():
		case <-ctx.Done():
			return false
		case <-timer.C:
			r.timeout = fmt.Errorf("rabbitmq: no confirm for %s within %s (PublisherConfig.ConfirmTimeout): the broker keeps the connection but confirms nothing; the outcome is unknown", b.name(f.i), c.confirmTimeout)
			return false
		}
		queue = queue[1:]
		switch {
		case f.dc.Acked():
			acked[f.i] = true
		case c.ch.IsClosed():
			r.lost = append(r.lost, f.i)
		default:
			b.set(f.i, fmt.Errorf("rabbitmq: the broker nacked %s (basic.nack: it could not take it, e.g. the queue is full with overflow reject-publish)", b.name(f.i)))
		}
		return true
	}
	cancelled := func(unsent []int) runResult {
		c.settle(b, sent, acked, &r)
		err := ctx.Err()
		for _, f := range queue {
			b.set(f.i, fmt.Errorf("rabbitmq: %s not confirmed before the context ended: %w", b.name(f.i), err))
		}
		for _, i := range unsent {
			b.set(i, fmt.Errorf("rabbitmq: %s not published, the context ended: %w", b.name(i), err))
		}
		r.ctxErr = err
		return r
	}
	// stopped ends the run after await returned false: a timeout leaves
	// the messages in flight without an outcome (lost) and the rest
	// unsent; otherwise ctx ended.
	stopped := func(unsent []int) runResult {
		if r.timeout == nil {
			return cancelled(unsent)
		}
		c.settle(b, sent, acked, &r)
		for _, f := range queue {
			r.lost = append(r.lost, f.i)
		}
		r.unsent = unsent
		return r
	}

	for k, i := range idx {
		for len(queue) >= window {
			if !await() {
				return stopped(idx[k:])
			}
		}
		if c.ch.IsClosed() {
			r.unsent = idx[k:]
			break
		}
		if c.blocked.Load() {
			// A resource alarm: the broker stopped reading from
			// publishers (a write would block until it ends).
			r.unsent, r.blocked = idx[k:], true
			break
		}
		if err := frameFits(c.conn, b.topics[i], b.pubs[i]); err != nil {
			b.set(i, permanent(fmt.Errorf("rabbitmq: %s cannot be sent: %w", b.name(i), err)))
			continue
		}
		dc, err := c.ch.PublishWithDeferredConfirmWithContext(ctx, "", b.topics[i], true, false, b.pubs[i])
		if err != nil {
			if ctx.Err() != nil {
				return cancelled(idx[k:])
			}
			var netErr net.Error
			if c.ch.IsClosed() || errors.Is(err, amqp091.ErrClosed) || errors.As(err, &netErr) || c.conn.IsClosed() {
				// The channel or the connection went (a write on a dead
				// socket): this message and the rest are unsent.
				r.unsent = idx[k:]
				break
			}
			// Refused by the client before sending (a header of a type AMQP
			// cannot carry): this message fails alone.
			b.set(i, permanent(fmt.Errorf("rabbitmq: publishing %s: %w", b.name(i), err)))
			continue
		}
		queue = append(queue, inFlight{i, dc, time.Now()})
		sent = append(sent, i)
	}
	for len(queue) > 0 {
		if !await() {
			return stopped(r.unsent)
		}
	}
	c.settle(b, sent, acked, &r)
	return r
}

// settle sets the outcome of the acked messages among sent: returned, or
// confirmed. A return names its publishing by the PublishingHeader stamped
// on it (see stamp): it fails exactly that message, whatever the marshaler
// set (many publishings may share a routing key, a message_id and a body).
// A return without the stamp cannot be attributed: every acked message to
// its routing key fails then (unconfirmed, published again: at-least-once,
// never lost).
func (c *confirmChannel) settle(b *outcomes, sent []int, acked map[int]bool, r *runResult) {
	returns := c.takeReturns()
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
		if !acked[i] {
			continue
		}
		if ret := returned[i]; ret != nil {
			if ret.ReplyCode == amqp091.NoRoute {
				r.noRoute = append(r.noRoute, b.topics[i])
			}
			b.set(i, fmt.Errorf("rabbitmq: %s was returned by the broker: %d %s (no queue is bound to routing key %q on the default exchange: declare the queue, see DeclareQueues)", b.name(i), ret.ReplyCode, ret.ReplyText, ret.RoutingKey))
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
