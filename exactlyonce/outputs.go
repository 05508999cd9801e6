package exactlyonce

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxrow"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxwrite"
	"github.com/exactlyonce/watermill-exactlyonce/internal/tracing"
)

// outputGroup is a run of consecutive output messages with one destination:
// written with one INSERT.
type outputGroup struct {
	topic string
	msgs  []*message.Message
}

type outputSet []outputGroup

// prepareOutputs resolves the destination of every message the handler
// returned and checks each one against what the outbox can store, before
// any SQL: a nil message, no destination, an empty UUID, a topic or
// metadata that is not valid UTF-8 or contains NUL. Errors wrap
// ErrNoDestination or errOutput (see isOutputError). The internal
// destination key is removed from the metadata.
func (m *Guard) prepareOutputs(d *delivery, produced []*message.Message) (outputSet, error) {
	if len(produced) == 0 {
		return nil, nil
	}
	defaultTopic := m.defaultTopic(d.ctx)
	topics := make([]string, len(produced))
	for i, p := range produced {
		topic, err := destination(p, i, defaultTopic)
		if err != nil {
			return nil, err
		}
		if topic == "" {
			return nil, fmt.Errorf("exactlyonce: %w: message %q has no SetDestination, handler publish topic or Config.PublishTopic", ErrNoDestination, p.UUID)
		}
		if err := outboxrow.Validate(topic, p); err != nil {
			return nil, fmt.Errorf("exactlyonce: %w: message %d: %w", errOutput, i, err)
		}
		p.SetContext(d.ctx)
		topics[i] = topic
	}
	var set outputSet
	for start := 0; start < len(produced); {
		end := outboxrow.RunEnd(len(produced), start, func(j int) bool { return topics[j] == topics[start] })
		set = append(set, outputGroup{topic: topics[start], msgs: produced[start:end]})
		start = end
	}
	return set, nil
}

// defaultTopic is where the handler's messages go unless SetDestination
// says otherwise: Config.PublishTopic, or the router handler's publish topic
// (in the delivery's context, ctx).
func (m *Guard) defaultTopic(ctx context.Context) string {
	if m.cfg.PublishTopic != "" {
		return m.cfg.PublishTopic
	}
	return message.PublishTopicFromCtx(ctx)
}

// destination returns the topic of output message i (SetDestination's, or
// defaultTopic) and removes the internal destination key from its metadata.
func destination(p *message.Message, i int, defaultTopic string) (string, error) {
	if p == nil {
		return "", fmt.Errorf("exactlyonce: %w: handler returned a nil message at index %d", errOutput, i)
	}
	topic := defaultTopic
	if t := p.Metadata.Get(topicMetadataKey); t != "" {
		topic = t
	}
	delete(p.Metadata, topicMetadataKey)
	return topic, nil
}

// setContext makes every message's context ctx (the outbox writes run with
// the first message's context).
func (set outputSet) setContext(ctx context.Context) {
	for _, g := range set {
		for _, m := range g.msgs {
			m.SetContext(ctx)
		}
	}
}

// write writes the groups to the outbox through ob, in order.
func (set outputSet) write(ob *lazyOutbox) error {
	for _, g := range set {
		if err := ob.Publish(g.topic, g.msgs...); err != nil {
			return fmt.Errorf("exactlyonce: writing output to the outbox: %w", err)
		}
	}
	return nil
}

// lazyOutbox creates the outbox publisher on first use: most deliveries
// of many handlers write no output.
type lazyOutbox struct {
	tx     *txHandle
	w      *outboxwrite.Writer    // the Guard's
	pub    *outboxwrite.Publisher // its NOTIFY is sent right before the commit
	ctx    context.Context        // the delivery's (its process span)
	tracer trace.Tracer
}

func (l *lazyOutbox) Publish(topic string, messages ...*message.Message) error {
	// Checked before any SQL, with the middleware's sentinels, so that the
	// handler's error says what is wrong and is not retried in a tight loop
	// (see handlerFailed).
	if topic == "" {
		return fmt.Errorf("exactlyonce: OutboxFromContext: %w: Publish was called with an empty topic", ErrNoDestination)
	}
	if err := outboxrow.Validate(topic, messages...); err != nil {
		return fmt.Errorf("exactlyonce: OutboxFromContext: %w: %w", errOutput, err)
	}
	if l.pub == nil {
		tx, err := l.tx.get()
		if err != nil {
			return fmt.Errorf("exactlyonce: outbox: %w", err)
		}
		l.pub = l.w.AtCommit(tx)
	}
	// The rows carry the trace context of the span that wrote them: a
	// child of the messages' context when the handler gave them one with a
	// span, else of the delivery's. A message that has a traceparent
	// already (forwarded) keeps it.
	parent := l.ctx
	if len(messages) > 0 && trace.SpanContextFromContext(messages[0].Context()).IsValid() {
		parent = messages[0].Context()
	}
	ctx, span := l.tracer.Start(parent, "exactlyonce.outbox.write", trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attribute.String("messaging.destination.name", topic), attribute.Int("messaging.batch.message_count", len(messages))))
	tracing.InjectContext(ctx, messages...)
	err := l.pub.Publish(topic, messages...)
	endSpan(span, err)
	return err
}

// beforeCommit sends the wake-on-commit NOTIFY of the rows written, if any
// (debounced among the Guard's deliveries). Call it right before the
// transaction commits; the middleware decides it there, not at the first
// write, because it owns the commit: a handler may write its rows long
// before it returns, or fail after (see internal/outboxwrite's notify.go). A failure only means that no
// NOTIFY went out; the commit reports an aborted transaction.
func (l *lazyOutbox) beforeCommit(ctx context.Context) {
	if l.pub != nil {
		_ = l.pub.BeforeCommit(ctx)
	}
}

// afterCommit wakes the relays of this process (on MySQL, which has no
// NOTIFY: internal/outboxnotify) once the transaction that wrote rows
// committed.
func (l *lazyOutbox) afterCommit() {
	if l.pub != nil {
		l.w.Committed()
	}
}

// Close closes the underlying publisher, if one was created.
func (l *lazyOutbox) Close() error {
	if l.pub == nil {
		return nil
	}
	return l.pub.Close()
}

// topicMetadataKey, set on a message the handler returns (SetDestination),
// overrides its destination topic. The middleware removes it before writing
// the message to the outbox.
const topicMetadataKey = "_exactlyonce_topic"

// SetDestination sets the topic the outbox relay publishes msg to (msg
// being one the handler returns), instead of the handler's publish topic.
func SetDestination(msg *message.Message, topic string) {
	msg.Metadata.Set(topicMetadataKey, topic)
}
