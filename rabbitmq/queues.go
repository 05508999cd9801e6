package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// QueueType is the type of the queues the package declares.
type QueueType string

const (
	// Classic is a classic queue: its messages live on one node. The
	// default (as is the empty QueueType).
	Classic QueueType = "classic"
	// Quorum is a quorum queue: replicated on the cluster's nodes (Raft),
	// a publish confirmed once a majority of them has it, available while
	// a majority runs. RabbitMQ's choice for data safety in a cluster.
	Quorum QueueType = "quorum"
)

// Queues says how the package declares the queues it declares (Publisher
// and Subscriber, the partitions of a partitioned topic, Declare and
// DeclarePartitions). The zero value declares durable classic queues
// without arguments, as watermill-amqp's NewDurableQueueConfig does.
//
// A queue is declared once with its arguments and RabbitMQ refuses a
// declaration whose arguments differ (PRECONDITION_FAILED, inequivalent
// arg): every publisher and subscriber of a queue must use the same Queues,
// and turning an existing classic queue into a quorum queue means a new
// queue (drain the old one first). See docs/clusters.md.
type Queues struct {
	// Type is Classic (the default) or Quorum.
	Type QueueType

	// DeliveryLimit is a quorum queue's x-delivery-limit: how many times
	// the broker delivers a message (the first delivery included, and
	// every return: a nack with requeue, a consumer's channel or
	// connection lost) before it dead-letters it to DeadLetterExchange.
	// The broker counts deliveries for any reason, not the handler's
	// failures: a database outage during which the middleware nacks every
	// NackDelay, or consumers crashing, use the count up too. RabbitMQ
	// 3.10 dead-letters a message once it was returned more than
	// DeliveryLimit times: it is delivered DeliveryLimit+1 times. 0 (the
	// default) leaves it unset: no limit on RabbitMQ 3.x; on RabbitMQ 4.0
	// and later the broker's default limit (20) applies, and the Subscriber
	// logs an error at connect (see docs/clusters.md). A limit needs
	// DeadLetterExchange or DeadLetterRoutingKey: without one, the broker
	// drops the message, and that is refused here. Negative values are
	// refused: RabbitMQ 3.10 takes -1 as a limit of none, and drops a
	// message at its first return. The middleware's own park (a key
	// parked with its message in the database, for an operator) does not
	// need a broker limit; see docs/clusters.md.
	DeliveryLimit int

	// DeadLetterExchange (x-dead-letter-exchange) is where the broker
	// sends a message over DeliveryLimit (and, for any queue type, a
	// message rejected without requeue or expired); "" is the default
	// exchange, with DeadLetterRoutingKey naming the queue. Empty with
	// DeadLetterRoutingKey empty: no dead-lettering. On a quorum queue
	// dead-lettering is at-least-once (x-dead-letter-strategy, which
	// needs x-overflow reject-publish: a full queue refuses publishes,
	// which a Publisher reports as nacks, never as a message's own
	// failure).
	DeadLetterExchange string

	// DeadLetterRoutingKey (x-dead-letter-routing-key) replaces the
	// message's routing key when it is dead-lettered; "" keeps it.
	DeadLetterRoutingKey string
}

// deadLettering reports whether q dead-letters.
func (q Queues) deadLettering() bool {
	return q.DeadLetterExchange != "" || q.DeadLetterRoutingKey != ""
}

// Validate reports a Queues the broker would refuse, or one that would lose
// messages.
func (q Queues) Validate() error {
	switch q.Type {
	case "", Classic, Quorum:
	default:
		return fmt.Errorf("rabbitmq: Queues.Type is %q; it is rabbitmq.Classic or rabbitmq.Quorum", string(q.Type))
	}
	switch {
	case q.DeliveryLimit != 0 && q.Type != Quorum:
		return fmt.Errorf("rabbitmq: Queues.DeliveryLimit is %d, but only a quorum queue has a delivery limit (Queues.Type: rabbitmq.Quorum)", q.DeliveryLimit)
	case q.DeliveryLimit < 0:
		return fmt.Errorf("rabbitmq: Queues.DeliveryLimit is %d; it is a number of returns, or 0 (unset): RabbitMQ 3.x takes a negative limit as none left and drops the message at its first return", q.DeliveryLimit)
	case q.DeliveryLimit > 0 && !q.deadLettering():
		return fmt.Errorf("rabbitmq: Queues.DeliveryLimit is %d without a dead-letter exchange: the broker would drop a message delivered %d times (a database outage or crashing consumers are enough); set Queues.DeadLetterExchange (or DeadLetterRoutingKey), or leave DeliveryLimit 0", q.DeliveryLimit, q.DeliveryLimit)
	}
	return nil
}

// Arguments are the arguments of a queue declared with q (nil for the zero
// value, as watermill-amqp's NewDurableQueueConfig declares). A subscriber
// declaring the queue itself must pass the same (watermill-amqp:
// cfg.Queue.Arguments).
func (q Queues) Arguments() amqp091.Table {
	args := amqp091.Table{}
	if q.Type == Quorum {
		args["x-queue-type"] = string(Quorum)
		if q.DeliveryLimit != 0 {
			args["x-delivery-limit"] = int64(q.DeliveryLimit)
		}
		if q.deadLettering() {
			args["x-dead-letter-strategy"] = "at-least-once"
			args["x-overflow"] = "reject-publish"
		}
	}
	if q.DeadLetterExchange != "" || q.DeadLetterRoutingKey != "" {
		args["x-dead-letter-exchange"] = q.DeadLetterExchange
	}
	if q.DeadLetterRoutingKey != "" {
		args["x-dead-letter-routing-key"] = q.DeadLetterRoutingKey
	}
	if len(args) == 0 {
		return nil
	}
	return args
}

// PartitionArguments are the arguments of a partition queue declared with
// q: Arguments with single active consumer (x-single-active-consumer), so
// that RabbitMQ delivers the partition to one subscriber at a time, in
// queue order. On a quorum queue, the single active consumer is kept by
// the queue's leader: when the leader moves or the consumer's connection
// goes, the next consumer takes over and the unacked messages come back in
// order.
func (q Queues) PartitionArguments() amqp091.Table {
	args := q.Arguments()
	if args == nil {
		args = amqp091.Table{}
	}
	args["x-single-active-consumer"] = true
	return args
}

// Declare connects to the first of urls that answers (the nodes of one
// cluster, tried in turn), declares each queue durable with q's arguments,
// and disconnects. See DeclareQueues, which is Queues{}.Declare.
func (q Queues) Declare(ctx context.Context, urls []string, queues ...string) error {
	if err := q.Validate(); err != nil {
		return fmt.Errorf("rabbitmq: Declare: %w", err)
	}
	for i, name := range queues {
		if name == "" {
			return fmt.Errorf("rabbitmq: Declare: queue name %d of %d is empty", i+1, len(queues))
		}
	}
	if len(queues) == 0 {
		return nil
	}
	return declareAll(ctx, "Declare", urls, queues, q.Arguments())
}

// DeclarePartitions declares the n partition queues of topic (durable, with
// PartitionArguments), as a Publisher with the same Queues does on its
// first message to the topic; call it before consumers subscribe when they
// start first. See the package function DeclarePartitions, which is
// Queues{}.DeclarePartitions.
func (q Queues) DeclarePartitions(ctx context.Context, urls []string, topic string, n int) error {
	if err := q.Validate(); err != nil {
		return fmt.Errorf("rabbitmq: DeclarePartitions: %w", err)
	}
	if err := checkPartitions(topic, n); err != nil {
		return fmt.Errorf("rabbitmq: DeclarePartitions: %w", err)
	}
	queues := make([]string, n)
	for i := range n {
		queues[i] = PartitionQueue(topic, i)
	}
	return declareAll(ctx, "DeclarePartitions", urls, queues, q.PartitionArguments())
}

// declareAll declares queues with args on a connection to the first of urls
// that answers.
func declareAll(ctx context.Context, fn string, urls, queues []string, args amqp091.Table) error {
	if len(urls) == 0 {
		return fmt.Errorf("rabbitmq: %s: no broker URL", fn)
	}
	conn, addr, _, stopWatch, err := dialAny(ctx, urls, 0, "watermill-exactlyonce rabbitmq."+fn)
	if err != nil {
		return fmt.Errorf("rabbitmq: %s: %w", fn, err)
	}
	// The watch stays: closing the socket when ctx ends fails a declaration
	// in progress.
	defer stopWatch()
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("rabbitmq: %s: open a channel on %s: %w", fn, addr, wrapCtx(ctx, err))
	}
	for _, name := range queues {
		if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
			return fmt.Errorf("rabbitmq: %s: declare queue %q on %s: %w%s", fn, name, addr, wrapCtx(ctx, err), declareHint(err))
		}
	}
	return nil
}

// dialAny connects to the first of urls that answers, trying them in turn
// from urls[start]: the nodes of one cluster. It returns the connection and
// the index of its URL; the error names every node that failed.
func dialAny(ctx context.Context, urls []string, start int, connName string) (conn *amqp091.Connection, addr string, idx int, stopWatch func() bool, err error) {
	var errs []error
	for i := range urls {
		idx = (start + i) % len(urls)
		conn, addr, stopWatch, err = dialContext(ctx, urls[idx], connName)
		if err == nil {
			return conn, addr, idx, stopWatch, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	if len(errs) == 1 {
		return nil, addr, idx, stopWatch, errs[0]
	}
	return nil, addr, idx, stopWatch, fmt.Errorf("no node of %d answers: %w", len(urls), errors.Join(errs...))
}

// brokerURLs are url followed by more, without empty ones, each checked: the
// nodes a Publisher or Subscriber connects to. field names the setting in
// errors.
func brokerURLs(field, url string, more []string) ([]string, error) {
	var urls []string
	if url != "" {
		urls = append(urls, url)
	}
	for _, u := range more {
		if u != "" {
			urls = append(urls, u)
		}
	}
	if len(urls) == 0 {
		return nil, fmt.Errorf("rabbitmq: %s.URL is required: amqp://user:password@host:5672/vhost (%s.URLs: the cluster's other nodes)", field, field)
	}
	for _, u := range urls {
		if _, err := amqp091.ParseURI(u); err != nil {
			return nil, fmt.Errorf("rabbitmq: %s: %q: invalid AMQP URL: %w; expected amqp://user:password@host:5672/vhost", field, redactURL(u), err)
		}
	}
	return urls, nil
}

// brokerMajor is the major version the broker announced (server property
// "version"), 0 if unknown.
func brokerMajor(conn *amqp091.Connection) int {
	v, _ := conn.Properties["version"].(string)
	major, _, _ := strings.Cut(v, ".")
	n, _ := strconv.Atoi(major)
	return n
}

// redactURL hides a URL's password in an error.
func redactURL(u string) string {
	uri, err := amqp091.ParseURI(u)
	if err != nil {
		return "(unparsable URL)"
	}
	if uri.Password != "" {
		uri.Password = "xxxxx"
	}
	return uri.String()
}
