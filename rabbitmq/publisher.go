package rabbitmq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
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
	// Required (unless URLs has one).
	URL string

	// URLs are the AMQP URLs of the cluster's other nodes. The Publisher
	// connects to the first of URL, URLs... that answers; after a lost
	// connection it tries them in turn from the node after the one it was
	// connected to, so a node that died is tried last. Any node of a
	// cluster serves any queue (a quorum queue's leader may be on another).
	URLs []string

	// Queues says how the queues the Publisher declares are declared:
	// classic (the default) or quorum, a delivery limit, dead-lettering.
	// Subscribers of the queues must declare them the same way
	// (SubscriberConfig.Queues). See docs/clusters.md.
	Queues Queues

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
	// permanent), and their channel is closed. It bounds a queue
	// declaration's answer too (a new quorum queue is not declared without
	// a majority): the messages of that queue fail, not permanently.
	// Defaults to 30s.
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
// of the connection or opened; a channel on which the broker nacked a
// message is closed, not reused. Close closes the connection.
type Publisher struct {
	cfg    PublisherConfig
	urls   []string      // URL, then URLs
	prefix string        // of this Publisher's PublishingHeader values
	stamps atomic.Uint64 // publishings stamped

	dialMu sync.Mutex // one dial at a time
	node   int        // index in urls of the last connection (-1: none yet); under dialMu

	mu       sync.Mutex
	closed   bool
	conn     *amqp091.Connection
	blocked  *atomic.Bool    // conn is blocked by a resource alarm (connection.blocked)
	declared map[string]bool // topics whose queue was declared on conn

	partitionOf map[string]string // partition queue of cfg.Partitions -> its topic
	idle        []*amqpChannel    // channels of conn no call uses
	bg          sync.WaitGroup    // each channel's drain, and channels closing
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher validates cfg and returns a Publisher. It does not connect:
// the first call does, so that a relay can start while RabbitMQ is down.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	urls, err := brokerURLs("PublisherConfig", cfg.URL, cfg.URLs)
	if err != nil {
		return nil, err
	}
	if err := cfg.Queues.Validate(); err != nil {
		return nil, fmt.Errorf("rabbitmq: PublisherConfig.Queues: %w", err)
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
	return &Publisher{cfg: cfg, urls: urls, node: -1, prefix: hex.EncodeToString(r[:]) + "-", partitionOf: pq}, nil
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
		if idx, err = p.declare(ctx, c, b, idx); err != nil {
			p.discard(c)
			return err
		}
		if len(idx) < n { // a declaration failed, closing the channel
			p.discard(c)
			continue
		}
		r := runWindow(ctx, c, b, idx, window, p.cfg.ConfirmTimeout)
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
			if r.nacked {
				p.discard(c) // see below
			} else {
				p.release(c)
			}
			return errors.New("rabbitmq: not published: the broker blocked the connection (a memory or disk alarm)")
		case len(r.lost) == 0 && len(r.unsent) == 0 && r.nacked:
			// Every message has its outcome, but the broker nacked some:
			// the channel is closed, not reused. A quorum queue nacks
			// every publish of a channel whose first publish to it came
			// as the queue's leader died, for as long as that node is
			// down, while a new channel's publishes are confirmed
			// (RabbitMQ 3.10, tests/cluster); the next call opens a
			// channel of its own.
			p.discard(c)
			return nil
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
