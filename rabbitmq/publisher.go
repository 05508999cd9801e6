package rabbitmq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/exactlyonce/watermill-exactlyonce/msgid"
)

// defaultWindow is PublisherConfig.Window's default.
const defaultWindow = 256

// defaultConfirmTimeout is PublisherConfig.ConfirmTimeout's default.
const defaultConfirmTimeout = 30 * time.Second

// closeTimeout bounds Publisher.Close's goodbye to the broker.
const closeTimeout = 5 * time.Second

// PublisherConfig configures a Publisher. URL is required.
type PublisherConfig struct {
	// URL is the broker's AMQP URL, amqp://user:password@host:5672/vhost.
	// Required.
	URL string

	// Window is the most messages one call keeps awaiting their publisher
	// confirm: the call publishes until Window messages are unconfirmed,
	// then publishes the next one each time the oldest is confirmed.
	// Concurrent calls each have a channel and a window of their own.
	// Defaults to 256.
	Window int

	// Marshaler turns a message into an AMQP publishing. Defaults to
	// Marshaler{} (persistent, the UUID in the _watermill_message_uuid
	// header and in message_id, metadata as headers); watermill-amqp's
	// DefaultMarshaler fits too.
	Marshaler interface {
		Marshal(msg *message.Message) (amqp091.Publishing, error)
	}

	// ConfirmTimeout bounds the wait for a message's confirm, from its
	// publish: a broker that keeps the connection alive but confirms
	// nothing (a quorum queue without a majority, say) fails the messages
	// still unconfirmed then ("no confirm", their outcome unknown: not
	// permanent), and their channel is closed. Defaults to 30s.
	ConfirmTimeout time.Duration

	// NoQueueDeclare turns off the declaration of each topic's queue. By
	// default the first message to a topic on a connection declares the
	// queue named like the topic, durable, not exclusive, not auto-delete,
	// without arguments (as DeclareQueues and watermill-amqp's
	// NewDurableQueueConfig do). Turn it off when the queues are declared
	// elsewhere with other properties (quorum queues, a max length): a
	// declaration that does not match fails the topic's messages.
	NoQueueDeclare bool

	// Partitions makes topics partitioned (per-key order with concurrency
	// across keys, see PartitionedSubscriber and docs/ordering.md): topic
	// -> number of partition queues. A message to such a topic goes to the
	// queue PartitionQueue(topic, Partition(key, n)) of its ordering key
	// (metadata msgid.OrderingKeyMetadata; its UUID when it has none). The
	// first message to the topic on a connection declares its n queues,
	// durable, with PartitionQueueArguments (unless NoQueueDeclare).
	// Changing a topic's number of partitions moves keys to other queues:
	// drain the queues first, or the messages of a moved key may be handled
	// out of order.
	Partitions map[string]int
}

// Publisher publishes to RabbitMQ with publisher confirms, keeping up to
// Window messages of a call in flight at once, and says message by message
// which ones the broker confirmed. It implements message.Publisher and
// outbox.BatchPublisher (PublishBatch), so an outbox Relay hands it each batch
// in one call instead of waiting for one confirm per message.
//
// A message is published to the default exchange with its topic as the
// routing key (the topology of watermill-amqp's NewDurableQueueConfig), with
// the mandatory flag: a message no queue takes is returned by the broker
// (basic.return) and is a failure for that message, never a success. It
// succeeds only once the broker confirmed it (basic.ack: with a durable queue
// and a persistent message, the message is on disk). Every publishing
// carries PublishingHeader, an identifier of the Publisher's own, so that a
// return fails exactly the message it belongs to, whatever the marshaler
// sets; confirms are matched by delivery tag. A nack, a return, a channel or
// connection lost before the confirm, or the context ending fail that
// message; a failed message may still have reached the queue (its confirm
// was lost): the outcome is unknown, and publishing it again is
// at-least-once.
//
// Failures that are the message's own are marked permanent (a method
// Permanent() bool, exactlyonce.Permanent's mark, which the outbox relay
// recognises by default, so that it quarantines the row after
// RelayConfig.MaxAttempts of them; exactlyonce.IsPermanent reports it): a
// message the broker closed the channel for when it was alone on it
// (PRECONDITION_FAILED or CONTENT_TOO_LARGE: over max_message_size, an
// invalid expiration, a user_id that is not the connection's), one the
// client cannot send (a header of a type AMQP cannot carry, a field over 255
// bytes), one the marshaler refuses, a nil message or an empty topic. A
// nack, a return, a failed queue declaration, a connection or channel lost,
// and the context ending are the broker's or the destination's state, never
// the message's: not permanent.
//
// Publisher connects at the first call (NewPublisher does not), and a call
// after the connection was lost dials again. It is safe for concurrent use:
// each call publishes on a channel of its own, taken from the idle channels
// of the connection or opened. Close closes the connection.
type Publisher struct {
	cfg    PublisherConfig
	prefix string        // of this Publisher's PublishingHeader values
	stamps atomic.Uint64 // publishings stamped

	dialMu sync.Mutex // one dial at a time

	mu       sync.Mutex
	closed   bool
	conn     *amqp091.Connection
	blocked  *atomic.Bool    // conn is blocked by a resource alarm (connection.blocked)
	declared map[string]bool // topics whose queue was declared on conn

	partitionOf map[string]string // partition queue of cfg.Partitions -> its topic
	idle        []*confirmChannel // channels of conn no call uses
	bg          sync.WaitGroup    // each channel's drain, and channels closing
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher validates cfg and returns a Publisher. It does not connect:
// the first call does, so that a relay can start while RabbitMQ is down.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.URL == "" {
		return nil, errors.New("rabbitmq: PublisherConfig.URL is required: amqp://user:password@host:5672/vhost")
	}
	if _, err := amqp091.ParseURI(cfg.URL); err != nil {
		return nil, fmt.Errorf("rabbitmq: PublisherConfig.URL: invalid AMQP URL: %w; expected amqp://user:password@host:5672/vhost", err)
	}
	if cfg.Window < 0 {
		return nil, fmt.Errorf("rabbitmq: PublisherConfig.Window is %d, it must be >= 1 (0: the default, %d)", cfg.Window, defaultWindow)
	}
	if cfg.Window == 0 {
		cfg.Window = defaultWindow
	}
	if cfg.ConfirmTimeout < 0 {
		return nil, fmt.Errorf("rabbitmq: PublisherConfig.ConfirmTimeout is %s, it must be > 0 (0: the default, %s)", cfg.ConfirmTimeout, defaultConfirmTimeout)
	}
	if cfg.ConfirmTimeout == 0 {
		cfg.ConfirmTimeout = defaultConfirmTimeout
	}
	if cfg.Marshaler == nil {
		cfg.Marshaler = Marshaler{}
	}
	pq := map[string]string{}
	for topic, n := range cfg.Partitions {
		if err := checkPartitions(topic, n); err != nil {
			return nil, fmt.Errorf("rabbitmq: PublisherConfig.Partitions: %w", err)
		}
		for i := range n {
			pq[PartitionQueue(topic, i)] = topic
		}
	}
	var r [6]byte
	_, _ = rand.Read(r[:])
	return &Publisher{cfg: cfg, prefix: hex.EncodeToString(r[:]) + "-", partitionOf: pq}, nil
}

var errPublisherClosed = errors.New("rabbitmq: Publisher is closed")

// Publish publishes msgs to topic (see PublishBatch) and returns an error if
// any of them was not confirmed; the others were.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	batch := make([]msgid.TopicMessage, len(msgs))
	for i, m := range msgs {
		batch[i] = msgid.TopicMessage{Topic: topic, Message: m}
	}
	var first error
	failed := 0
	for _, err := range p.PublishBatch(context.Background(), batch) {
		if err != nil {
			if first == nil {
				first = err
			}
			failed++
		}
	}
	if failed == 0 {
		return nil
	}
	return fmt.Errorf("rabbitmq: %d of %d message(s) to %q not confirmed, the first: %w", failed, len(msgs), topic, first)
}

// PublishBatch publishes each batch[i].Message to the queue batch[i].Topic
// (the default exchange, routing key batch[i].Topic; for a partitioned
// topic, see PublisherConfig.Partitions, its partition queue), in order, on
// one channel, keeping up to Window of them awaiting their confirm, and
// returns one error per message: nil when the broker confirmed it, else why
// not. It returns when every
// message has an outcome, or soon after ctx ends (the messages not confirmed
// by then fail with ctx's error).
//
// When the broker closes the channel (a message it refuses: a user_id that
// is not the connection's user, an invalid expiration, a body over
// max_message_size), the messages published after that one were dropped and
// those before it may be in the queue without their confirm: each message
// then unconfirmed is published again on its own channel, so that only the
// message the broker refuses fails, permanently (the others may arrive
// twice). When the connection is lost, the messages not confirmed fail, and
// the next call dials again.
func (p *Publisher) PublishBatch(ctx context.Context, batch []msgid.TopicMessage) []error {
	topics, msgs := p.route(batch)
	b := &outcomes{topics: topics, msgs: msgs, errs: make([]error, len(msgs)), settled: make([]bool, len(msgs))}
	b.pubs = make([]amqp091.Publishing, len(msgs))
	todo := make([]int, 0, len(msgs))
	for i, m := range msgs {
		switch {
		// A nil message or an empty topic is the caller's mistake, not the
		// message's (the outbox never hands either over): not marked
		// permanent, so that a handler publishing with a topic missing from
		// its configuration is redelivered until it is fixed, not parked.
		case m == nil:
			b.set(i, errors.New("rabbitmq: nil message"))
		case topics[i] == "":
			b.set(i, fmt.Errorf("rabbitmq: message %q has an empty topic", m.UUID))
		default:
			pub, err := p.cfg.Marshaler.Marshal(m)
			if err != nil {
				// Permanent only when the marshaler says so (Permanent()
				// bool): a marshaler may fail for a while (a schema
				// registry, a key service down).
				b.set(i, fmt.Errorf("rabbitmq: marshaling message %q: %w", m.UUID, err))
				continue
			}
			if err := checkShortstrs(topics[i], pub); err != nil {
				// amqp091-go would fail writing it and close the connection.
				b.set(i, permanent(fmt.Errorf("rabbitmq: message %q to %q cannot be sent: %w", m.UUID, topics[i], err)))
				continue
			}
			b.pubs[i] = p.stamp(pub)
			todo = append(todo, i)
		}
	}
	err := p.publish(ctx, b, todo, p.cfg.Window)
	for _, i := range todo {
		if !b.settled[i] {
			// Not sent, or sent without an outcome, for a reason of the
			// connection's (it could not be made, it was lost, ctx
			// ended). Only a confirm makes a success: a message without
			// an outcome is never reported confirmed.
			if err == nil {
				err = errors.New("rabbitmq: no outcome for the message (not confirmed)")
			}
			b.errs[i] = err
		}
	}
	return b.errs
}

// Close closes the connection: calls in progress fail their unconfirmed
// messages, and later calls fail. Calling it again does nothing.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	conn := p.conn
	p.idle = nil
	p.mu.Unlock()
	var err error
	if conn != nil && !conn.IsClosed() {
		err = conn.CloseDeadline(time.Now().Add(closeTimeout))
	}
	p.bg.Wait()
	if err != nil && !errors.Is(err, amqp091.ErrClosed) {
		return fmt.Errorf("rabbitmq: closing the connection: %w", err)
	}
	return nil
}

// outcomes are the messages of one PublishBatch call and what became of
// them.
type outcomes struct {
	topics  []string
	msgs    []*message.Message
	pubs    []amqp091.Publishing
	errs    []error
	settled []bool
}

func (b *outcomes) set(i int, err error) {
	b.errs[i], b.settled[i] = err, true
}

func (b *outcomes) name(i int) string {
	return fmt.Sprintf("message %q to %q", b.msgs[i].UUID, b.topics[i])
}

// publish publishes the messages idx of b, window at a time, until each has
// an outcome, taking channels as needed. It returns an error (for every
// message still without an outcome) when it cannot go on: no connection, the
// connection lost, ctx ended.
func (p *Publisher) publish(ctx context.Context, b *outcomes, idx []int, window int) error {
	stalls := 0 // channels in a row closed before anything was sent on them
	for len(idx) > 0 {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("rabbitmq: not published, the context ended: %w", err)
		}
		c, err := p.take(ctx)
		if err != nil {
			return err
		}
		n := len(idx)
		if idx, err = p.declare(c, b, idx); err != nil {
			p.discard(c)
			return err
		}
		if len(idx) < n { // a declaration failed, closing the channel
			p.discard(c)
			continue
		}
		r := c.run(ctx, b, idx, window)
		for _, topic := range r.noRoute {
			p.forget(c.conn, topic)
		}
		switch {
		case r.ctxErr != nil:
			p.discard(c) // confirms outstanding
			return r.ctxErr
		case r.timeout != nil:
			p.discard(c) // confirms outstanding, maybe for ever
			for _, i := range r.lost {
				b.set(i, r.timeout)
			}
			return r.timeout
		case r.blocked && len(r.lost) == 0 && !c.ch.IsClosed():
			p.release(c)
			return errors.New("rabbitmq: not published: the broker blocked the connection (a memory or disk alarm); it takes messages again once the alarm clears")
		case len(r.lost) == 0 && len(r.unsent) == 0:
			p.release(c) // every message has its outcome
			return nil
		}
		// The channel or its connection went: it may not say so yet (a
		// write on a socket whose closing the client has not read).
		p.discard(c)
		reason := c.closeReason()
		if len(r.unsent) == len(idx) {
			if stalls++; stalls == 3 {
				return fmt.Errorf("rabbitmq: not published, the broker closed %d channels in a row before anything was sent on them: %w", stalls, reason)
			}
		} else {
			stalls = 0
		}
		if c.conn.IsClosed() || !channelException(reason) {
			// The connection went (its closing may reach the channel
			// before the connection says so): not these messages' doing.
			for _, i := range r.lost {
				b.set(i, fmt.Errorf("rabbitmq: connection lost before %s was confirmed (it may have reached the queue): %w", b.name(i), reason))
			}
			return fmt.Errorf("rabbitmq: not published, the connection was lost: %w", reason)
		}
		// The broker closed the channel because of one message: those
		// after it were dropped, those before it may be in the queue.
		// Each unconfirmed one goes again on its own, so that only that
		// message fails. Alone on its channel, it is the cause: when the
		// broker refused the message itself (its size, a property), the
		// failure is permanent.
		if window == 1 || len(r.lost) == 1 {
			for _, i := range r.lost {
				err := fmt.Errorf("rabbitmq: the broker closed the channel before %s was confirmed: %w", b.name(i), reason)
				if refusesMessage(reason) {
					err = permanent(err)
				}
				b.set(i, err)
			}
		} else if err := p.publish(ctx, b, r.lost, 1); err != nil {
			return err
		}
		idx = r.unsent
	}
	return nil
}

// take returns an idle channel of the current connection, or opens one,
// dialing when there is no connection or it was lost.
func (p *Publisher) take(ctx context.Context) (*confirmChannel, error) {
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
	conn, _, stopWatch, err := dialContext(ctx, p.cfg.URL, "watermill-exactlyonce rabbitmq.Publisher")
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: Publisher: %w", err)
	}
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
func (p *Publisher) open(conn *amqp091.Connection) (*confirmChannel, error) {
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
	c := &confirmChannel{
		conn:           conn,
		blocked:        blocked,
		confirmTimeout: p.cfg.ConfirmTimeout,
		ch:             ch,
		closes:         ch.NotifyClose(make(chan *amqp091.Error, 1)),
		returns:        make(chan amqp091.Return), // unbuffered: see drain
		barrier:        make(chan chan struct{}),
		drained:        make(chan struct{}),
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
func (p *Publisher) release(c *confirmChannel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed && c.conn == p.conn {
		p.idle = append(p.idle, c)
		return
	}
	p.closeInBackground(c)
}

// discard closes c, which may have confirms outstanding or be closed.
func (p *Publisher) discard(c *confirmChannel) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closeInBackground(c)
}

// closeInBackground closes c's channel without waiting for the broker's
// reply (Close waits for it). p.mu is held.
func (p *Publisher) closeInBackground(c *confirmChannel) {
	if c.ch.IsClosed() || p.closed {
		return // (Close closes the connection, and with it the channel)
	}
	p.bg.Add(1)
	go func() {
		defer p.bg.Done()
		_ = c.ch.Close()
	}()
}

// declare declares the queues of the topics of idx not yet declared on c's
// connection (unless NoQueueDeclare), and returns the messages left to
// publish: a failed declaration fails its topic's messages (and closes c's
// channel). An error means the connection was lost.
func (p *Publisher) declare(c *confirmChannel, b *outcomes, idx []int) ([]int, error) {
	if p.cfg.NoQueueDeclare {
		return idx, nil
	}
	var todo []string
	p.mu.Lock()
	seen := map[string]bool{}
	current := c.conn == p.conn
	for _, i := range idx {
		if t := b.topics[i]; !seen[t] && (!current || !p.declared[t]) {
			seen[t] = true
			todo = append(todo, t)
		}
	}
	// A partition queue: every partition of its topic is declared with it,
	// so that subscribers find them all, whichever got a message first.
	for _, q := range todo {
		topic, ok := p.partitionOf[q]
		if !ok {
			continue
		}
		for i := range p.cfg.Partitions[topic] {
			if pq := PartitionQueue(topic, i); !seen[pq] && (!current || !p.declared[pq]) {
				seen[pq] = true
				todo = append(todo, pq)
			}
		}
	}
	p.mu.Unlock()
	for _, topic := range todo {
		// As DeclareQueues and watermill-amqp's NewDurableQueueConfig:
		// durable, not auto-delete, not exclusive, no arguments.
		_, err := c.ch.QueueDeclare(topic, true, false, false, false, p.queueArguments(topic))
		if err == nil {
			p.mu.Lock()
			if c.conn == p.conn {
				p.declared[topic] = true
			}
			p.mu.Unlock()
			continue
		}
		if c.conn.IsClosed() {
			return nil, fmt.Errorf("rabbitmq: declaring queue %q: connection lost: %w", topic, err)
		}
		rest := idx[:0:0]
		for _, i := range idx {
			if b.topics[i] == topic {
				b.set(i, fmt.Errorf("rabbitmq: declaring queue %q for %s: %w%s (PublisherConfig.NoQueueDeclare turns declarations off)", topic, b.name(i), err, declareHint(err)))
			} else {
				rest = append(rest, i)
			}
		}
		return rest, nil // the channel is closed: declare the others on the next
	}
	return idx, nil
}

// forget makes the next call declare topic's queue again: a message to it
// came back unroutable, so the queue is gone (deleted since it was declared).
func (p *Publisher) forget(conn *amqp091.Connection, topic string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if conn == p.conn {
		delete(p.declared, topic)
	}
}

// confirmChannel is a channel in confirm mode that one call at a time
// publishes on.
type confirmChannel struct {
	conn           *amqp091.Connection
	blocked        *atomic.Bool // the connection's
	confirmTimeout time.Duration
	ch             *amqp091.Channel
	closes         chan *amqp091.Error
	reason         error // why the channel closed, once read from closes
	returns        chan amqp091.Return
	barrier        chan chan struct{}
	drained        chan struct{} // closed when drain returned

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
func (c *confirmChannel) drain() {
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
func (c *confirmChannel) takeReturns() []amqp091.Return {
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
func (c *confirmChannel) closeReason() error {
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

// checkShortstrs checks the fields AMQP 0-9-1 encodes as short strings (at
// most 255 bytes): the routing key, the string properties and the header
// names, nested tables included. amqp091-go finds out only while writing the
// frame, and then closes the connection.
func checkShortstrs(topic string, p amqp091.Publishing) error {
	for _, f := range [...]struct{ name, value string }{
		{"the topic (routing key)", topic},
		{"content_type", p.ContentType}, {"content_encoding", p.ContentEncoding},
		{"correlation_id", p.CorrelationId}, {"reply_to", p.ReplyTo},
		{"expiration", p.Expiration}, {"message_id", p.MessageId},
		{"type", p.Type}, {"user_id", p.UserId}, {"app_id", p.AppId},
	} {
		if len(f.value) > 255 {
			return fmt.Errorf("%s is %d bytes, AMQP allows at most 255", f.name, len(f.value))
		}
	}
	return checkTableKeys(p.Headers)
}

func checkTableKeys(v any) error {
	switch t := v.(type) {
	case amqp091.Table:
		for k, e := range t {
			if len(k) > 255 {
				return fmt.Errorf("header name %.40q... is %d bytes, AMQP allows at most 255", k, len(k))
			}
			if err := checkTableKeys(e); err != nil {
				return err
			}
		}
	case []any:
		for _, e := range t {
			if err := checkTableKeys(e); err != nil {
				return err
			}
		}
	}
	return nil
}

// permanentError marks a failure that is the message's own: it repeats
// whenever the message is published (the outbox relay counts it towards
// RelayConfig.MaxAttempts). Its mark is exactlyonce.Permanent's, a method
// Permanent() bool, so that this package need not import the middleware.
type permanentError struct{ err error }

func permanent(err error) error { return permanentError{err} }

func (e permanentError) Error() string   { return e.err.Error() }
func (e permanentError) Unwrap() error   { return e.err }
func (e permanentError) Permanent() bool { return true }

// refusesMessage reports whether the broker closed a channel because of the
// message published on it, not the broker's or the destination's state: a
// body over max_message_size (CONTENT_TOO_LARGE, or PRECONDITION_FAILED as
// RabbitMQ reports it), an expiration or user_id it rejects
// (PRECONDITION_FAILED). Access refused, a missing exchange or a locked
// resource are the destination's, and may change.
func refusesMessage(reason error) bool {
	var e *amqp091.Error
	return errors.As(reason, &e) && e.Server && (e.Code == amqp091.PreconditionFailed || e.Code == amqp091.ContentTooLarge)
}

// channelException reports whether the broker closed a channel with a
// channel-level exception, which one message caused (PRECONDITION_FAILED for
// an expiration it refuses, say), rather than because the connection went:
// then amqp091-go closes every channel with the connection's error.
func channelException(reason error) bool {
	var e *amqp091.Error
	if !errors.As(reason, &e) || !e.Server {
		return false
	}
	switch e.Code {
	case amqp091.ContentTooLarge, amqp091.NoRoute, amqp091.NoConsumers, amqp091.AccessRefused,
		amqp091.NotFound, amqp091.ResourceLocked, amqp091.PreconditionFailed:
		return true
	}
	return false
}

// frameFits reports an error when pub's content header would not fit in one
// frame of conn (its negotiated frame_max): RabbitMQ closes the whole
// connection on such a frame (501 FRAME_ERROR), failing every call on it,
// again at each retry. A message with that much in its headers can never
// be sent.
func frameFits(conn *amqp091.Connection, topic string, pub amqp091.Publishing) error {
	frameMax := conn.Config.FrameSize
	if frameMax <= 0 {
		return nil
	}
	// Frame header (7) and end (1); class, weight, body size (12); the
	// property flags (2) and the properties.
	size := 7 + 1 + 12 + 2 + 1 + 1 + 8 // delivery mode, priority, timestamp
	for _, v := range []string{pub.ContentType, pub.ContentEncoding, pub.CorrelationId, pub.ReplyTo,
		pub.Expiration, pub.MessageId, pub.Type, pub.UserId, pub.AppId} {
		size += 1 + len(v)
	}
	size += tableSize(pub.Headers)
	if size > frameMax {
		return fmt.Errorf("its properties and headers take about %d bytes, more than the connection's frame size (%d): RabbitMQ would close the connection", size, frameMax)
	}
	return nil
}

// tableSize is the encoded size of an AMQP field table (an upper bound for
// the types amqp091-go encodes).
func tableSize(t amqp091.Table) int {
	n := 4
	for k, v := range t {
		n += 1 + len(k) + 1 + valueSize(v)
	}
	return n
}

func valueSize(v any) int {
	switch x := v.(type) {
	case string:
		return 4 + len(x)
	case []byte:
		return 4 + len(x)
	case amqp091.Table:
		return tableSize(x)
	case []any:
		n := 4
		for _, e := range x {
			n += 1 + valueSize(e)
		}
		return n
	case amqp091.Decimal:
		return 5
	default: // numbers, booleans, timestamps, nil
		return 8
	}
}
