package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// SubscriberConfig configures a Subscriber. URL is required.
type SubscriberConfig struct {
	// URL is the broker's AMQP URL, amqp://user:password@host:5672/vhost.
	// Required (unless URLs has one).
	URL string

	// URLs are the AMQP URLs of the cluster's other nodes. The Subscriber
	// connects to the first of URL, URLs... that answers; after a lost
	// connection it consumes again through the next node that answers,
	// from the one after the node it was connected to.
	URLs []string

	// Queues says how Subscribe declares its queue, and
	// PartitionedSubscriber its partitions: classic (the default) or
	// quorum, a delivery limit, dead-lettering. It must match the
	// publisher's (PublisherConfig.Queues). See docs/clusters.md.
	Queues Queues

	// Prefetch is how many deliveries of one subscription are in flight at
	// once: the consumer's basic.qos prefetch count, and so how many
	// messages of the topic the router handles at the same moment (it runs
	// each delivery in its own goroutine). Defaults to 64; at most 65535.
	// PartitionedSubscriber subscribes to each partition with 1, whatever
	// this says.
	Prefetch int

	// QueueArguments are the arguments of the durable queue Subscribe
	// declares, named like the topic (not exclusive, not auto-delete),
	// for arguments Queues has no field for; set one of them, not both.
	// nil (the default) declares it with Queues.Arguments(): for the zero
	// Queues without arguments, as Publisher, DeclareQueues and
	// watermill-amqp's NewDurableQueueConfig do. A declaration whose
	// arguments differ from the queue's fails Subscribe.
	// PartitionedSubscriber declares partition queues with
	// Queues.PartitionArguments(), whatever this says.
	QueueArguments amqp091.Table

	// NoQueueDeclare turns the declaration off: the queue must exist.
	NoQueueDeclare bool

	// Marshaler turns a delivery into a message. The zero value is ready
	// (the UUID from the _watermill_message_uuid header, else message_id).
	Marshaler Marshaler

	// AckHold is how long an ack may wait for the acks of earlier
	// deliveries, so that one basic.ack with the multiple flag settles them
	// all. The ack of the oldest delivery in flight never waits. Defaults
	// to 5ms; negative: an ack that cannot join the oldest ones goes out
	// alone, at once.
	AckHold time.Duration

	// CloseTimeout is how long Close (and the end of Subscribe's context)
	// waits for the deliveries in flight to be acked or nacked before it
	// closes the channel; what is still in flight then goes back to the
	// queue. Defaults to 10s.
	CloseTimeout time.Duration

	// ReconnectDelay is the longest wait between two attempts to consume
	// again after the connection or channel was lost (the first waits
	// 50ms, each next one twice as long). Defaults to 2s.
	ReconnectDelay time.Duration

	// Logger logs lost connections and reconnections. Defaults to
	// watermill.NewStdLogger(false, false).
	Logger watermill.LoggerAdapter
}

const (
	defaultPrefetch       = 64
	defaultAckHold        = 5 * time.Millisecond
	defaultCloseTimeout   = 10 * time.Second
	defaultReconnectDelay = 2 * time.Second
	firstReconnectDelay   = 50 * time.Millisecond
)

func (c *SubscriberConfig) setDefaults() {
	if c.Prefetch == 0 {
		c.Prefetch = defaultPrefetch
	}
	if c.AckHold == 0 {
		c.AckHold = defaultAckHold
	}
	if c.CloseTimeout <= 0 {
		c.CloseTimeout = defaultCloseTimeout
	}
	if c.ReconnectDelay <= 0 {
		c.ReconnectDelay = defaultReconnectDelay
	}
	if c.Logger == nil {
		c.Logger = watermill.NewStdLogger(false, false)
	}
}

func (c *SubscriberConfig) validate() error {
	if _, err := brokerURLs("SubscriberConfig", c.URL, c.URLs); err != nil {
		return err
	}
	if err := c.Queues.Validate(); err != nil {
		return fmt.Errorf("rabbitmq: SubscriberConfig.Queues: %w", err)
	}
	if c.QueueArguments != nil && c.Queues != (Queues{}) {
		return errors.New("rabbitmq: SubscriberConfig: both QueueArguments and Queues are set; set one of them")
	}
	if c.Prefetch < 1 || c.Prefetch > 65535 {
		return fmt.Errorf("rabbitmq: SubscriberConfig.Prefetch is %d, it must be between 1 and 65535", c.Prefetch)
	}
	return nil
}

// Subscriber consumes RabbitMQ queues with many deliveries in flight on one
// subscription, and acknowledges them together.
//
// Subscribe(ctx, topic) consumes the durable queue named like the topic
// (declared as Publisher and watermill-amqp's NewDurableQueueConfig do) on
// a channel of its own with a prefetch of Prefetch, and hands every delivery
// to the returned channel at once: the router runs up to Prefetch of them at
// the same time, without ConcurrentSubscriber. A message the handler acked
// is acknowledged with basic.ack; acks that arrive together, or within
// AckHold of each other, go out as one basic.ack with the multiple flag
// (settling every earlier delivery). A nacked message is rejected on its own
// at once, with requeue. Nothing is acknowledged before the router acked
// it, so the middleware's guarantee is unchanged: a message is acked only
// after its effects committed.
//
// When the connection or channel is lost, the subscription consumes again
// (with ReconnectDelay's backoff) on a new one; the deliveries in flight on
// the lost channel cannot be acknowledged any more and come back from the
// broker (the inbox drops those that committed). Subscribe itself fails when
// its first attempt does (an unreachable broker, a queue declared with other
// arguments), with the reason.
//
// The first Subscribe connects; subscriptions share the connection. It is
// safe for concurrent use. Close stops every subscription (see
// CloseTimeout) and closes the connection.
type Subscriber struct {
	cfg  SubscriberConfig
	urls []string // URL, then URLs
	node int      // index in urls of the last connection (-1: none yet); while holding dialing

	dialing chan struct{} // holds a value while one dials: one dial at a time

	mu      sync.Mutex
	closed  bool
	closing chan struct{} // closed by Close
	conn    *amqp091.Connection
	subs    sync.WaitGroup // subscriptions running
	// bg counts channel work left to finish in the background: a channel
	// being opened for a Subscribe that gave up, a channel being closed.
	// On a connection gone silent it ends when the connection is closed,
	// which Close does before waiting for it.
	bg sync.WaitGroup
}

var _ message.Subscriber = (*Subscriber)(nil)

// NewSubscriber validates cfg and returns a Subscriber. It does not
// connect: the first Subscribe does.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	urls, _ := brokerURLs("SubscriberConfig", cfg.URL, cfg.URLs) // validated
	return &Subscriber{cfg: cfg, urls: urls, node: -1, closing: make(chan struct{}), dialing: make(chan struct{}, 1)}, nil
}

var errSubscriberClosed = errors.New("rabbitmq: Subscriber is closed")

// Subscribe consumes the queue named topic; see Subscriber. The channel it
// returns is closed when ctx ends or the Subscriber is closed, once the
// deliveries in flight were settled (or CloseTimeout passed).
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	args := s.cfg.QueueArguments
	if args == nil {
		args = s.cfg.Queues.Arguments()
	}
	return s.subscribe(ctx, topic, s.cfg.Prefetch, args)
}

// subscribe is Subscribe with the prefetch and queue arguments given.
func (s *Subscriber) subscribe(ctx context.Context, queue string, prefetch int, args amqp091.Table) (<-chan *message.Message, error) {
	switch {
	case queue == "":
		return nil, errors.New("rabbitmq: Subscribe: the topic is empty; it names the queue to consume")
	case len(queue) > 255:
		return nil, fmt.Errorf("rabbitmq: Subscribe: the topic %.40q... is %d bytes; a queue name has at most 255", queue, len(queue))
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errSubscriberClosed
	}
	s.subs.Add(1)
	s.mu.Unlock()

	sub := &subscription{s: s, queue: queue, prefetch: prefetch, args: args, ctx: ctx, out: make(chan *message.Message)}
	octx, cancel := s.untilClosed(ctx)
	c, err := sub.open(octx)
	cancel()
	if err != nil {
		s.subs.Done()
		select {
		case <-s.closing:
			return nil, fmt.Errorf("rabbitmq: Subscribe to %q: %w", queue, errSubscriberClosed)
		default:
		}
		return nil, fmt.Errorf("rabbitmq: Subscribe to %q: %w", queue, err)
	}
	go sub.run(c)
	return sub.out, nil
}

// Close stops every subscription, waiting up to CloseTimeout for the
// deliveries in flight to be settled, and closes the connection.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.closing)
	s.mu.Unlock()
	s.subs.Wait()
	s.dialing <- struct{}{} // nobody dials any more: every dial ran in a subscription
	defer func() { <-s.dialing }()
	s.mu.Lock()
	conn := s.conn
	s.conn = nil
	s.mu.Unlock()
	var err error
	if conn != nil && !conn.IsClosed() {
		if cerr := conn.CloseDeadline(time.Now().Add(closeTimeout)); cerr != nil && !errors.Is(cerr, amqp091.ErrClosed) {
			err = fmt.Errorf("rabbitmq: closing the Subscriber's connection: %w", cerr)
		}
	}
	s.bg.Wait() // the connection is closed: what waited for its answers returned
	return err
}

// untilClosed returns ctx, ended also when the Subscriber is closing.
func (s *Subscriber) untilClosed(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		select {
		case <-s.closing:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// connection returns the shared connection, dialing when there is none or
// it was lost.
func (s *Subscriber) connection(ctx context.Context) (*amqp091.Connection, error) {
	select { // another subscription may be dialing a broker that does not answer
	case s.dialing <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("connecting: %w", ctx.Err())
	}
	defer func() { <-s.dialing }()
	s.mu.Lock()
	closed, conn := s.closed, s.conn
	s.mu.Unlock()
	switch {
	case closed:
		return nil, errSubscriberClosed
	case conn != nil && !conn.IsClosed():
		return conn, nil
	}
	conn, _, node, stopWatch, err := dialAny(ctx, s.urls, s.node+1, "watermill-exactlyonce rabbitmq.Subscriber")
	if err != nil {
		return nil, err
	}
	s.node = node
	if s.cfg.Queues.Type == Quorum && s.cfg.Queues.DeliveryLimit == 0 && brokerMajor(conn) >= 4 {
		s.cfg.Logger.Error("rabbitmq: Subscriber: this broker gives quorum queues a delivery limit by default (20 on RabbitMQ 4.0) and Queues.DeliveryLimit leaves it: a message returned that often (nacks while the database is down, crashing consumers) is dropped unless the queue dead-letters; set Queues.DeliveryLimit with Queues.DeadLetterExchange, or a policy without a limit (docs/clusters.md)", nil, watermill.LogFields{"broker_version": conn.Properties["version"]})
	}
	if !stopWatch() && ctx.Err() != nil {
		_ = conn.CloseDeadline(time.Now().Add(closeTimeout))
		return nil, fmt.Errorf("connecting: %w", ctx.Err())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		_ = conn.CloseDeadline(time.Now().Add(closeTimeout))
		return nil, errSubscriberClosed
	}
	s.conn = conn
	return conn, nil
}

// subscription is one Subscribe: a consumer on a channel of its own,
// opened again after the channel was lost.
type subscription struct {
	s        *Subscriber
	queue    string
	prefetch int
	args     amqp091.Table
	ctx      context.Context // Subscribe's: the messages' context
	out      chan *message.Message
}

// run serves c, and consumers opened after it, until the subscription ends.
func (sub *subscription) run(c *consumer) {
	defer sub.s.subs.Done()
	defer close(sub.out)
	// The subscription ends when its context ends or the Subscriber closes.
	stopCtx, release := sub.s.untilClosed(sub.ctx)
	defer release()
	stop := stopCtx.Done()
	log := sub.s.cfg.Logger
	fields := watermill.LogFields{"queue": sub.queue}
	delay := firstReconnectDelay
	for {
		if c != nil {
			err := c.serve(sub, stop)
			if err == nil { // stopped
				c.finish(sub.s)
				return
			}
			c.abandon(sub.s)
			log.Error("rabbitmq: Subscriber lost its channel, consuming again; the deliveries in flight will be redelivered", err, fields)
			delay = firstReconnectDelay
		}
		t := time.NewTimer(delay)
		select {
		case <-stop:
			t.Stop()
			return
		case <-t.C:
		}
		var err error
		if c, err = sub.open(stopCtx); err != nil {
			c = nil
			delay = min(2*delay, sub.s.cfg.ReconnectDelay)
			log.Error("rabbitmq: Subscriber cannot consume yet, trying again", err, watermill.LogFields{"queue": sub.queue, "retry_in": delay.String()})
			continue
		}
		log.Info("rabbitmq: Subscriber consumes again", fields)
	}
}

// open opens a channel, declares the queue and starts consuming, giving up
// when ctx ends.
func (sub *subscription) open(ctx context.Context) (*consumer, error) {
	s := sub.s
	for attempt := 0; ; attempt++ {
		conn, err := s.connection(ctx)
		if err != nil {
			return nil, err
		}
		c, err := sub.start(ctx, conn)
		if err != nil {
			if errors.Is(err, errChannelOpen) && errors.Is(err, amqp091.ErrClosed) && attempt == 0 {
				continue // lost before it was noticed: dial again, once
			}
			return nil, err
		}
		return c, nil
	}
}

var errChannelOpen = errors.New("opening a channel")

// start opens a channel on conn and consumes on it, or gives up when ctx
// ends: amqp091-go waits for the broker's answers without a deadline, and on
// a connection gone silent nothing but the heartbeat would end the wait.
// What a start given up on still opens is closed once it is open (at the
// latest when Close closes the connection).
func (sub *subscription) start(ctx context.Context, conn *amqp091.Connection) (*consumer, error) {
	type result struct {
		c   *consumer
		err error
	}
	done := make(chan result)
	gaveUp := make(chan struct{})
	sub.s.bg.Add(1)
	go func() {
		defer sub.s.bg.Done()
		var r result
		if ch, err := conn.Channel(); err != nil {
			r.err = fmt.Errorf("%w: %w", errChannelOpen, err)
		} else if r.c, r.err = sub.consume(ch); r.err != nil {
			_ = ch.Close()
		}
		select {
		case done <- r:
		case <-gaveUp:
			if r.c != nil {
				r.c.goneOnce.Do(func() { close(r.c.gone) })
				<-r.c.acked
				_ = r.c.ch.Close() // its deliveries go back to the queue
			}
		}
	}()
	select {
	case r := <-done:
		return r.c, r.err
	case <-ctx.Done():
		close(gaveUp)
		return nil, fmt.Errorf("opening a channel and consuming: %w", ctx.Err())
	}
}

func (sub *subscription) consume(ch *amqp091.Channel) (*consumer, error) {
	if !sub.s.cfg.NoQueueDeclare {
		if _, err := ch.QueueDeclare(sub.queue, true, false, false, false, sub.args); err != nil {
			return nil, fmt.Errorf("declaring queue %q: %w", sub.queue, err)
		}
	}
	if err := ch.Qos(sub.prefetch, 0, false); err != nil {
		return nil, fmt.Errorf("setting the prefetch to %d: %w", sub.prefetch, err)
	}
	c := &consumer{
		ch:       ch,
		prefetch: sub.prefetch,
		hold:     sub.s.cfg.AckHold,
		closes:   ch.NotifyClose(make(chan *amqp091.Error, 1)),
		settles:  make(chan settle, sub.prefetch),
		gone:     make(chan struct{}),
		finished: make(chan struct{}),
		acked:    make(chan struct{}),
		tag:      fmt.Sprintf("exactlyonce-%s", watermill.NewShortUUID()),
	}
	deliveries, err := ch.Consume(sub.queue, c.tag, false, false, false, false, nil)
	if err != nil {
		return nil, fmt.Errorf("consuming queue %q: %w", sub.queue, err)
	}
	c.deliveries = deliveries
	go c.ack()
	return c, nil
}

// consumer is one channel's consumer of a subscription.
type consumer struct {
	ch         *amqp091.Channel
	tag        string
	prefetch   int
	hold       time.Duration
	deliveries <-chan amqp091.Delivery
	closes     chan *amqp091.Error
	settles    chan settle    // outcomes of deliveries, for ack
	waiters    sync.WaitGroup // deliveries handed over and not settled
	gone       chan struct{}  // closed: the channel is gone, stop settling
	goneOnce   sync.Once
	finished   chan struct{} // closed by finish: flush and stop
	acked      chan struct{} // closed when ack returned
}

type settle struct {
	tag uint64
	ack bool
}

// serve hands the deliveries over until stop (it returns nil) or the
// channel is lost (it returns why).
func (c *consumer) serve(sub *subscription, stop <-chan struct{}) error {
	m := sub.s.cfg.Marshaler
	for {
		select {
		case <-stop:
			return nil
		case err := <-c.closes:
			if err == nil {
				return errors.New("the channel was closed")
			}
			return err
		case d, ok := <-c.deliveries:
			if !ok {
				return c.lostReason()
			}
			msg, err := m.Unmarshal(d)
			if err != nil { // Marshaler never fails; keep the delivery safe anyway
				c.send(settle{tag: d.DeliveryTag})
				continue
			}
			msg.SetContext(sub.ctx)
			select {
			case sub.out <- msg:
			case <-stop:
				c.send(settle{tag: d.DeliveryTag}) // not handed over: back to the queue
				return nil
			}
			c.waiters.Add(1)
			go c.await(msg, d.DeliveryTag)
		}
	}
}

// lostReason is why the deliveries stopped: the channel's close reason, or
// the broker cancelled the consumer (the queue was deleted).
func (c *consumer) lostReason() error {
	select {
	case err := <-c.closes:
		if err != nil {
			return err
		}
	case <-time.After(100 * time.Millisecond):
	}
	return errors.New("the broker cancelled the consumer (was the queue deleted?)")
}

// await waits for the router's verdict on msg and passes it on.
func (c *consumer) await(msg *message.Message, tag uint64) {
	defer c.waiters.Done()
	s := settle{tag: tag}
	select {
	case <-msg.Acked():
		s.ack = true
	case <-msg.Nacked():
	case <-c.gone:
		return
	}
	c.send(s)
}

func (c *consumer) send(s settle) {
	select {
	case c.settles <- s:
	case <-c.gone:
	}
}

// ack acknowledges settled deliveries: the oldest ones in one basic.ack
// with the multiple flag, each nack at once, and an ack that cannot join
// the oldest ones alone once it waited AckHold.
func (c *consumer) ack() {
	defer close(c.acked)
	a := acker{ch: c.ch, low: 1, state: map[uint64]bool{}}
	var timer *time.Timer
	var timerC <-chan time.Time
	for {
		select {
		case s := <-c.settles:
			a.record(s)
		case <-timerC:
			timerC = nil
			a.sendHeld()
		case <-c.finished:
			for more := true; more; {
				select {
				case s := <-c.settles:
					a.record(s)
				default:
					more = false
				}
			}
			a.flush()
			a.sendHeld()
			return
		case <-c.gone:
			return
		}
		for more := true; more; { // everything settled meanwhile goes in this round
			select {
			case s := <-c.settles:
				a.record(s)
			default:
				more = false
			}
		}
		a.flush()
		switch {
		case a.held == 0:
			if timer != nil {
				timer.Stop()
			}
			timerC = nil
		case c.hold < 0 || a.held >= max(1, c.prefetch/2):
			a.sendHeld()
			timerC = nil
		case timerC == nil:
			if timer == nil {
				timer = time.NewTimer(c.hold)
			} else {
				timer.Reset(c.hold)
			}
			timerC = timer.C
		}
		if a.err != nil {
			return // the channel is gone: serve sees it
		}
	}
}

// abandon gives up a lost channel: nothing in flight on it can be
// acknowledged any more.
func (c *consumer) abandon(s *Subscriber) {
	c.goneOnce.Do(func() { close(c.gone) })
	<-c.acked
	// Closed in the background: when only the consumer was cancelled the
	// channel is open, and its connection may have gone silent meanwhile.
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		_ = c.ch.Close()
	}()
}

// finish stops consuming, waits up to CloseTimeout for the deliveries in
// flight to be settled, acknowledges them and closes the channel; what is
// left goes back to the queue.
func (c *consumer) finish(s *Subscriber) {
	timeout := s.cfg.CloseTimeout
	// No wait for the broker's answers here: on a connection that went
	// silent they would come only when the heartbeat gives it up.
	_ = c.ch.Cancel(c.tag, true)
	waited := make(chan struct{})
	go func() {
		c.waiters.Wait()
		close(waited)
	}()
	t := time.NewTimer(timeout)
	select {
	case <-waited:
	case <-t.C:
	case <-c.acked: // the channel was lost meanwhile
	}
	t.Stop()
	close(c.finished)
	<-c.acked
	c.goneOnce.Do(func() { close(c.gone) })
	closed := make(chan struct{})
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		_ = c.ch.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-s.closing: // Close closes the connection (with a deadline) next, and this channel with it
	case <-time.After(closeTimeout):
	}
}

// ackChannel is what acker needs of an *amqp091.Channel.
type ackChannel interface {
	Ack(tag uint64, multiple bool) error
	Nack(tag uint64, multiple, requeue bool) error
}

// acker is the bookkeeping of ack: delivery tags of a channel are 1, 2, 3,
// ... in delivery order, and each delivery is settled once.
type acker struct {
	ch    ackChannel
	low   uint64          // the oldest delivery not settled
	state map[uint64]bool // settled tags above low: true = acked and not sent yet (held), false = sent
	held  int
	err   error
}

func (a *acker) record(s settle) {
	if s.tag < a.low || a.err != nil {
		return
	}
	if _, dup := a.state[s.tag]; dup {
		return
	}
	if !s.ack {
		a.state[s.tag] = false
		a.err = a.ch.Nack(s.tag, false, true)
		return
	}
	a.state[s.tag] = true
	a.held++
}

// flush acknowledges the oldest settled deliveries in one basic.ack.
func (a *acker) flush() {
	var last uint64
	for {
		held, ok := a.state[a.low]
		if !ok {
			break
		}
		if held {
			last = a.low
			a.held--
		}
		delete(a.state, a.low)
		a.low++
	}
	if last > 0 && a.err == nil {
		a.err = a.ch.Ack(last, true)
	}
}

// sendHeld acknowledges each held delivery on its own.
func (a *acker) sendHeld() {
	if a.held == 0 || a.err != nil {
		return
	}
	tags := make([]uint64, 0, a.held)
	for t, held := range a.state {
		if held {
			tags = append(tags, t)
		}
	}
	sort.Slice(tags, func(i, j int) bool { return tags[i] < tags[j] })
	for _, t := range tags {
		if a.err = a.ch.Ack(t, false); a.err != nil {
			return
		}
		a.state[t] = false
		a.held--
	}
}
