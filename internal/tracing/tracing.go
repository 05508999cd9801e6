// Package tracing holds what the middleware and the relay share for
// OpenTelemetry: the W3C trace context carried in message metadata, and
// the tracer. It uses the OpenTelemetry API only: spans go wherever the
// application's TracerProvider sends them (nowhere by default).
package tracing

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the library's spans.
const ScopeName = "github.com/exactlyonce/watermill-exactlyonce"

// The metadata keys of the W3C trace context.
const (
	TraceParent = "traceparent"
	TraceState  = "tracestate"
)

// propagator is W3C trace context whatever the application's global
// propagator (which is a no-op until set): the outbox row carries it, so
// that the consumer's span can link to the producer's.
var propagator = propagation.TraceContext{}

// Tracer returns the library's tracer from tp, or from the global provider
// when tp is nil.
func Tracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(ScopeName)
}

// Inject writes the trace context of each message into its metadata, unless
// the metadata has a traceparent already (the message is being forwarded,
// or the application set it). The context is the message's own when it
// holds a span (msg.SetContext), else fallback (the handler's, when the
// middleware writes a handler's outputs; context.Background() for none).
// Without a span in either, nothing is written.
func Inject(fallback context.Context, msgs ...*message.Message) {
	for _, msg := range msgs {
		if msg == nil || msg.Metadata.Get(TraceParent) != "" {
			continue
		}
		ctx := msg.Context()
		if !trace.SpanContextFromContext(ctx).IsValid() {
			ctx = fallback
		}
		if !trace.SpanContextFromContext(ctx).IsValid() {
			continue
		}
		if msg.Metadata == nil {
			msg.Metadata = message.Metadata{}
		}
		propagator.Inject(ctx, propagation.MapCarrier(msg.Metadata))
	}
}

// InjectContext writes ctx's trace context into the metadata of each
// message that has no traceparent yet (nothing when ctx holds no span).
func InjectContext(ctx context.Context, msgs ...*message.Message) {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	for _, msg := range msgs {
		if msg == nil || msg.Metadata.Get(TraceParent) != "" {
			continue
		}
		if msg.Metadata == nil {
			msg.Metadata = message.Metadata{}
		}
		propagator.Inject(ctx, propagation.MapCarrier(msg.Metadata))
	}
}

// Extract returns the span context carried in metadata (invalid when none).
func Extract(md message.Metadata) trace.SpanContext {
	if md.Get(TraceParent) == "" {
		return trace.SpanContext{}
	}
	ctx := propagator.Extract(context.Background(), propagation.MapCarrier(md))
	return trace.SpanContextFromContext(ctx)
}

// ConsumerStart returns the context and options of a span that processes
// msg: its parent is the span in msg's context if there is one (a tracing
// middleware of the router's), else the producer's span carried in the
// metadata, so that a trace crosses the broker; and it links to the
// producer's span either way.
func ConsumerStart(msg *message.Message) (context.Context, []trace.SpanStartOption) {
	ctx := msg.Context()
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
	producer := Extract(msg.Metadata)
	if !producer.IsValid() {
		return ctx, opts
	}
	opts = append(opts, trace.WithLinks(trace.Link{SpanContext: producer}))
	if !trace.SpanContextFromContext(ctx).IsValid() {
		ctx = trace.ContextWithRemoteSpanContext(ctx, producer)
	}
	return ctx, opts
}
