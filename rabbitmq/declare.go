package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// defaultConnectionTimeout bounds the TCP connect and the AMQP handshake when
// the URL has no connection_timeout, like amqp091-go's Dial.
const defaultConnectionTimeout = 30 * time.Second

// DeclareQueues connects to amqpURL, declares each queue and disconnects.
//
// Each queue is declared durable, not exclusive, not auto-delete and without
// arguments: the properties watermill-amqp v3's NewDurableQueueConfig
// declares, so a Watermill subscriber of the same queue accepts it later.
// Queues.Declare declares quorum queues, or with other arguments, on the
// first node of a cluster that answers.
// Declaring an existing queue with those properties changes nothing.
//
// Call it before anything publishes to a queue through the default exchange
// (an outbox relay, a PoisonQueue middleware) when its consumers may not have
// started yet: RabbitMQ silently drops a message whose routing key no queue
// has, and watermill-amqp's publisher declares exchanges, never queues.
//
// Empty names are an error; no names at all is a no-op. ctx bounds the
// connection and the declarations; without a deadline in ctx, connecting
// gives up after the URL's connection_timeout (default 30 s).
func DeclareQueues(ctx context.Context, amqpURL string, queues ...string) error {
	for i, q := range queues {
		if q == "" {
			return fmt.Errorf("rabbitmq: DeclareQueues: queue name %d of %d is empty", i+1, len(queues))
		}
	}
	if len(queues) == 0 {
		return nil
	}
	// Same arguments as watermill-amqp's DefaultTopologyBuilder with
	// NewDurableQueueConfig: durable, not auto-delete, not exclusive, wait
	// for the reply, no arguments.
	return declareAll(ctx, "DeclareQueues", []string{amqpURL}, queues, nil)
}

// wrapCtx prefers the context's error when ctx ended, since closing the socket
// is what made err.
func wrapCtx(ctx context.Context, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("%w (%w)", ctxErr, err)
	}
	return err
}

func declareHint(err error) string {
	var amqpErr *amqp091.Error
	if !errors.As(err, &amqpErr) {
		return ""
	}
	switch amqpErr.Code {
	case amqp091.PreconditionFailed:
		return ": the queue exists with other properties than this declaration's (its type, x- arguments): every client of a queue must declare it alike (rabbitmq.Queues; watermill-amqp's NewDurableQueueConfig declares a classic queue without arguments)"
	case amqp091.AccessRefused:
		return ": the user may not configure this queue name in the vhost"
	case amqp091.ResourceLocked:
		return ": another connection holds the queue as exclusive"
	}
	return ""
}

// dialContext connects to amqpURL as amqp091-go's Dial does, under the
// connection name connName, with ctx bounding the TCP connect and the
// handshake (amqp091-go has no dial with a context): it dials with ctx,
// bounds the handshake with a deadline (amqp091-go clears it once
// connected), and closes the socket when ctx ends, which fails whatever is
// in progress on the connection, until stopWatch is called. Without a
// deadline in ctx, connecting gives up after the URL's connection_timeout
// (default 30 s). addr is host:port, for error messages; the error does not
// name the caller.
func dialContext(ctx context.Context, amqpURL, connName string) (conn *amqp091.Connection, addr string, stopWatch func() bool, err error) {
	stopWatch = func() bool { return false }
	uri, err := amqp091.ParseURI(amqpURL)
	if err != nil {
		return nil, "", stopWatch, fmt.Errorf("invalid AMQP URL: %w; expected amqp://user:password@host:5672/vhost", err)
	}
	addr = net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port))
	if err := ctx.Err(); err != nil {
		return nil, addr, stopWatch, fmt.Errorf("not connecting to %s: %w", addr, err)
	}
	timeout := defaultConnectionTimeout
	if uri.ConnectionTimeout > 0 {
		timeout = time.Duration(uri.ConnectionTimeout) * time.Millisecond
	}

	var raw net.Conn
	dial := func(network, address string) (net.Conn, error) {
		c, err := (&net.Dialer{Timeout: timeout}).DialContext(ctx, network, address)
		if err != nil {
			return nil, err
		}
		if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
			_ = c.Close()
			return nil, err
		}
		raw = c
		stopWatch = context.AfterFunc(ctx, func() { _ = c.Close() })
		return c, nil
	}
	props := amqp091.NewConnectionProperties()
	props.SetClientConnectionName(connName)
	// The heartbeat amqp091-go's Dial uses: a connection that went silent
	// (a peer gone without a FIN) is found dead within about 20 s.
	conn, err = amqp091.DialConfig(amqpURL, amqp091.Config{Dial: dial, Properties: props, Heartbeat: 10 * time.Second})
	if err != nil {
		stopWatch()
		if raw != nil {
			_ = raw.Close()
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, addr, stopWatch, fmt.Errorf("connecting to %s: %w (%w)", addr, ctxErr, err)
		}
		return nil, addr, stopWatch, fmt.Errorf("cannot connect to %s: %w", addr, err)
	}
	return conn, addr, stopWatch, nil
}

// declare declares the queues of the topics of idx not yet declared on c's
// connection (unless NoQueueDeclare), and returns the messages left to
// publish: a failed declaration fails its topic's messages (and closes c's
// channel). An error means the connection was lost.
func (p *Publisher) declare(ctx context.Context, c *amqpChannel, b *outcomes, idx []int) ([]int, error) {
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
		err := p.declareQueue(ctx, c, topic)
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
		// The broker closed the channel (a refused declaration), or the
		// caller discards it (a declaration given up on): declare the
		// others on the next.
		return rest, nil
	}
	return idx, nil
}

// declareQueue declares queue on c's channel as Queues.Declare does (and,
// for the zero Queues, DeclareQueues and watermill-amqp's
// NewDurableQueueConfig): durable, not auto-delete, not exclusive. It gives
// up when ctx ends or after ConfirmTimeout: a broker may leave a
// declaration unanswered (RabbitMQ 3.10 does not answer the declaration of
// a new quorum queue on a node cut off from the cluster's majority, with
// cluster_partition_handling ignore, until the majority is back: see
// docs/clusters.md). The channel is closed then (it is still waiting for
// the answer), as after a failed declaration.
func (p *Publisher) declareQueue(ctx context.Context, c *amqpChannel, queue string) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return errPublisherClosed
	}
	p.bg.Add(1) // until the broker answers or the connection closes
	p.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		defer p.bg.Done()
		_, err := c.ch.QueueDeclare(queue, true, false, false, false, p.queueArguments(queue))
		done <- err
	}()
	t := time.NewTimer(p.cfg.ConfirmTimeout)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("no answer before the context ended: %w", ctx.Err())
	case <-t.C:
		return fmt.Errorf("no answer within %s (PublisherConfig.ConfirmTimeout; a quorum queue is declared only while a majority of the cluster's nodes is reachable)", p.cfg.ConfirmTimeout)
	}
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
