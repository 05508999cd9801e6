package rabbitmq

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// take returns an idle channel of the current connection, or opens one,
// dialing when there is no connection or it was lost.
func (p *Publisher) take(ctx context.Context) (*amqpChannel, error) {
	for attempt := 0; ; attempt++ {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, errPublisherClosed
		}
		for len(p.idle) > 0 {
			c := p.idle[len(p.idle)-1]
			p.idle = p.idle[:len(p.idle)-1]
			if c.conn == p.conn && !c.ch.IsClosed() && !c.conn.IsClosed() {
				p.mu.Unlock()
				return c, nil
			}
		}
		conn := p.conn
		p.mu.Unlock()

		if conn == nil || conn.IsClosed() {
			var err error
			if conn, err = p.connect(ctx); err != nil {
				return nil, err
			}
		}
		c, err := p.open(conn)
		if err == nil {
			return c, nil
		}
		if !conn.IsClosed() || attempt > 0 {
			return nil, err
		}
		// The connection was lost before it was noticed: dial again, once.
	}
}

// connect dials, unless another call did meanwhile, and makes the new
// connection the current one.
func (p *Publisher) connect(ctx context.Context) (*amqp091.Connection, error) {
	p.dialMu.Lock()
	defer p.dialMu.Unlock()
	p.mu.Lock()
	closed, conn := p.closed, p.conn
	p.mu.Unlock()
	switch {
	case closed:
		return nil, errPublisherClosed
	case conn != nil && !conn.IsClosed():
		return conn, nil
	}
	conn, _, node, stopWatch, err := dialAny(ctx, p.urls, p.node+1, "watermill-exactlyonce rabbitmq.Publisher")
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: Publisher: %w", err)
	}
	p.node = node
	if !stopWatch() && ctx.Err() != nil {
		// ctx ended as the dial returned: the watch closed the socket.
		_ = conn.CloseDeadline(time.Now().Add(closeTimeout))
		return nil, fmt.Errorf("rabbitmq: Publisher: connecting: %w", ctx.Err())
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = conn.CloseDeadline(time.Now().Add(closeTimeout))
		return nil, errPublisherClosed
	}
	blocked := new(atomic.Bool)
	notes := conn.NotifyBlocked(make(chan amqp091.Blocking, 1))
	p.bg.Add(1)
	go func() { // until the connection closes (amqp091 closes notes then)
		defer p.bg.Done()
		for n := range notes {
			blocked.Store(n.Active)
		}
	}()
	p.conn, p.blocked, p.declared, p.idle = conn, blocked, map[string]bool{}, nil
	p.mu.Unlock()
	return conn, nil
}

// open opens a channel on conn in confirm mode, with its returns drained.
func (p *Publisher) open(conn *amqp091.Connection) (*amqpChannel, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: opening a channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("rabbitmq: putting a channel in confirm mode: %w", err)
	}
	p.mu.Lock()
	blocked := p.blocked
	if conn != p.conn || blocked == nil {
		blocked = new(atomic.Bool)
	}
	p.mu.Unlock()
	c := &amqpChannel{
		conn:    conn,
		blocked: blocked,
		ch:      ch,
		closes:  ch.NotifyClose(make(chan *amqp091.Error, 1)),
		returns: make(chan amqp091.Return), // unbuffered: see drain
		barrier: make(chan chan struct{}),
		drained: make(chan struct{}),
	}
	ch.NotifyReturn(c.returns)
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = ch.Close()
		return nil, errPublisherClosed
	}
	p.bg.Add(1)
	p.mu.Unlock()
	go func() {
		defer p.bg.Done()
		c.drain()
	}()
	return c, nil
}

// release makes c idle: every message published on it has its confirm.
func (p *Publisher) release(c *amqpChannel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed && c.conn == p.conn {
		p.idle = append(p.idle, c)
		return
	}
	p.closeInBackground(c)
}

// discard closes c, which may have confirms outstanding or be closed.
func (p *Publisher) discard(c *amqpChannel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closeInBackground(c)
}

// closeInBackground closes c's channel without waiting for the broker's
// reply (Close waits for it). p.mu is held.
func (p *Publisher) closeInBackground(c *amqpChannel) {
	if c.ch.IsClosed() || p.closed {
		return // (Close closes the connection, and with it the channel)
	}
	p.bg.Add(1)
	go func() {
		defer p.bg.Done()
		_ = c.ch.Close()
	}()
}

// amqpChannel is a channel in confirm mode that one call at a time
// publishes on: the confirm window's confirmChannel.
type amqpChannel struct {
	conn    *amqp091.Connection
	blocked *atomic.Bool // the connection's
	ch      *amqp091.Channel
	closes  chan *amqp091.Error
	reason  error // why the channel closed, once read from closes
	returns chan amqp091.Return
	barrier chan chan struct{}
	drained chan struct{} // closed when drain returned

	mu  sync.Mutex
	got []amqp091.Return // returned messages not yet taken
}

// drain receives the channel's returned messages until the channel closes.
// It is always ready to receive: amqp091-go drops a return its listener has
// not taken within 5 s, and a dropped return would leave its message looking
// confirmed.
// The broker sends a message's basic.return before its basic.ack, and
// amqp091-go hands both over in that order from one goroutine; returns is
// unbuffered, so a return has been received here before the confirm of its
// message is seen as done. A barrier request, received after it, is answered
// once it has been stored: see takeReturns.
func (c *amqpChannel) drain() {
	defer close(c.drained)
	for {
		select {
		case r, ok := <-c.returns:
			if !ok {
				return
			}
			c.mu.Lock()
			c.got = append(c.got, r)
			c.mu.Unlock()
		case done := <-c.barrier:
			close(done)
		}
	}
}

// takeReturns returns the messages returned so far (every return of a
// message whose confirm was seen is among them) and forgets them.
func (c *amqpChannel) takeReturns() []amqp091.Return {
	done := make(chan struct{})
	select {
	case c.barrier <- done:
		<-done
	case <-c.drained:
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	got := c.got
	c.got = nil
	return got
}

// closeReason says why the closed channel closed. amqp091-go marks a
// channel closed before it hands over the reason, so it waits a moment for
// the reason (or for the notification channel to close, when there is
// none).
func (c *amqpChannel) closeReason() error {
	if c.reason == nil {
		select {
		case e, ok := <-c.closes:
			if ok && e != nil {
				c.reason = e
			}
		case <-time.After(closeReasonWait):
		}
		if c.reason == nil {
			c.reason = amqp091.ErrClosed
		}
	}
	return c.reason
}

// closeReasonWait bounds closeReason's wait for a reason.
const closeReasonWait = time.Second

var _ confirmChannel = (*amqpChannel)(nil)

// Publish publishes pub to the default exchange, mandatory (a message no
// queue takes comes back as a basic.return).
func (c *amqpChannel) Publish(ctx context.Context, key string, pub amqp091.Publishing) (confirmation, error) {
	dc, err := c.ch.PublishWithDeferredConfirmWithContext(ctx, "", key, true, false, pub)
	if err != nil {
		return nil, err
	}
	return dc, nil
}

// Returned takes the messages returned so far: see takeReturns.
func (c *amqpChannel) Returned() []amqp091.Return { return c.takeReturns() }

// Closed reports whether the channel closed.
func (c *amqpChannel) Closed() bool { return c.ch.IsClosed() }

// ConnClosed reports whether the connection closed.
func (c *amqpChannel) ConnClosed() bool { return c.conn.IsClosed() }

// Blocked reports whether the broker blocked the connection.
func (c *amqpChannel) Blocked() bool { return c.blocked.Load() }

// FrameMax is the connection's negotiated frame size.
func (c *amqpChannel) FrameMax() int { return c.conn.Config.FrameSize }
