package exactlyonce_test

import (
	"context"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// capturePublisher keeps what the relay publishes (the broker's part).
type capturePublisher struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *capturePublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		c := message.NewMessage(m.UUID, m.Payload)
		c.Metadata = maps.Clone(m.Metadata)
		p.msgs = append(p.msgs, c)
	}
	return nil
}
func (p *capturePublisher) Close() error { return nil }

// spansNamed returns the ended spans called name.
func spansNamed(sr *tracetest.SpanRecorder, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range sr.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func outcomeOf(s sdktrace.ReadOnlySpan) string {
	for _, a := range s.Attributes() {
		if a.Key == "exactlyonce.outcome" {
			return a.Value.AsString()
		}
	}
	return ""
}

// The trace crosses the outbox: the producer's span context is captured
// into the row's metadata when the row is written; the relay's publish span
// is its child; the consumer's process span (with claim, handler and outbox
// write spans under it) continues the producer's trace and links to it;
// the consumer's own outputs carry its outbox-write span's context. In each
// mode; a duplicate has a process span and no handler span; a router's own
// span in the message's context is the parent instead, still linked to the
// producer.
func TestTraceContextThroughTheOutbox(t *testing.T) {
	t.Parallel()
	modes := map[string]func(*exactlyonce.Config){
		"transactional": func(*exactlyonce.Config) {},
		"lease":         func(c *exactlyonce.Config) { c.Lease = &exactlyonce.LeaseConfig{} },
		"batch":         func(c *exactlyonce.Config) { c.Batch = &exactlyonce.BatchConfig{MaxWait: time.Millisecond} },
	}
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			d := testenv.Drivers(t)[0]
			tables := testenv.WithConn(testenv.Schema(t), d.DB)
			sr := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))

			// The producer writes a row inside its own span.
			pctx, pspan := tp.Tracer("test").Start(ctx, "producer")
			producer := pspan.SpanContext()
			tx, err := d.DB.BeginTx(ctx, nil)
			require.NoError(t, err)
			w, err := outbox.NewWriter(tables)
			require.NoError(t, err)
			pub, err := w.Publisher(tx)
			require.NoError(t, err)
			m := message.NewMessage("order-1", []byte("{}"))
			m.SetContext(pctx)
			require.NoError(t, pub.Publish("orders", m))
			require.NoError(t, tx.Commit())
			pspan.End()

			// The relay publishes it.
			broker := &capturePublisher{}
			relay, err := outbox.NewRelay(outbox.RelayConfig{DB: tables, Publisher: broker, TracerProvider: tp, Logger: testenv.Logger(t), NoListen: true})
			require.NoError(t, err)
			n, err := relay.Flush(ctx)
			require.NoError(t, err)
			require.Equal(t, 1, n)
			require.Len(t, broker.msgs, 1)
			require.Contains(t, broker.msgs[0].Metadata.Get("traceparent"), producer.SpanID().String(), "captured at write time")
			rp := spansNamed(sr, "exactlyonce.relay.publish")
			require.Len(t, rp, 1)
			require.Equal(t, producer.TraceID(), rp[0].SpanContext().TraceID())
			require.Equal(t, producer.SpanID(), rp[0].Parent().SpanID())

			// The consumer processes it (and a duplicate of it).
			var events []exactlyonce.Event
			var evMu sync.Mutex
			cfg := exactlyonce.Config{DB: tables, Consumer: "c", TracerProvider: tp, Logger: testenv.Logger(t),
				OnEvent: func(e exactlyonce.Event) { evMu.Lock(); events = append(events, e); evMu.Unlock() }}
			mode(&cfg)
			eo, err := exactlyonce.New(cfg)
			require.NoError(t, err)
			var inHandler trace.SpanContext
			h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				inHandler = trace.SpanContextFromContext(msg.Context())
				out := message.NewMessage("shipped-"+msg.UUID, nil)
				exactlyonce.SetDestination(out, "shipments")
				return []*message.Message{out}, nil
			})
			delivery := func() *message.Message {
				in := message.NewMessage(broker.msgs[0].UUID, broker.msgs[0].Payload)
				in.Metadata = maps.Clone(broker.msgs[0].Metadata)
				return in
			}
			_, err = h(delivery())
			require.NoError(t, err)
			_, err = h(delivery())
			require.NoError(t, err)

			procs := spansNamed(sr, "exactlyonce.process")
			require.Len(t, procs, 2)
			require.Equal(t, []string{"processed", "duplicate"}, []string{outcomeOf(procs[0]), outcomeOf(procs[1])})
			for _, p := range procs {
				require.Equal(t, producer.TraceID(), p.SpanContext().TraceID(), "the consumer continues the producer's trace")
				require.Equal(t, producer.SpanID(), p.Parent().SpanID())
				require.Len(t, p.Links(), 1)
				require.Equal(t, producer.SpanID(), p.Links()[0].SpanContext.SpanID(), "linked to the producer")
				require.Equal(t, trace.SpanKindConsumer, p.SpanKind())
			}
			proc := procs[0].SpanContext()
			handlers := spansNamed(sr, "exactlyonce.handler")
			require.Len(t, handlers, 1, "no handler span for the duplicate")
			require.Equal(t, proc.SpanID(), handlers[0].Parent().SpanID())
			require.Equal(t, handlers[0].SpanContext().SpanID(), inHandler.SpanID(), "the handler's context holds its span")
			claims := spansNamed(sr, "exactlyonce.claim")
			require.Len(t, claims, 2)
			require.Equal(t, proc.SpanID(), claims[0].Parent().SpanID())
			writes := spansNamed(sr, "exactlyonce.outbox.write")
			require.Len(t, writes, 1)
			require.Equal(t, proc.SpanID(), writes[0].Parent().SpanID())

			// The output row carries the consumer's write span.
			var meta string
			require.NoError(t, seam.QueryRow(ctx, d.DB, "SELECT metadata->>'traceparent' FROM "+tables.Outbox()+" WHERE uuid = 'shipped-order-1'", nil, &meta))
			require.Equal(t, "00-"+producer.TraceID().String()+"-"+writes[0].SpanContext().SpanID().String()+"-01", meta)

			evMu.Lock()
			require.Len(t, events, 2)
			for _, e := range events {
				require.Positive(t, e.ClaimDuration, "Event.ClaimDuration (%s)", e.Outcome)
				require.LessOrEqual(t, e.ClaimDuration, e.Duration)
			}
			evMu.Unlock()

			// A router's tracing middleware put a span in the message's
			// context: it is the parent; the producer stays linked.
			rctx, rspan := tp.Tracer("test").Start(ctx, "router")
			in := delivery()
			in.UUID = "order-2"
			in.SetContext(rctx)
			_, err = h(in)
			require.NoError(t, err)
			rspan.End()
			procs = spansNamed(sr, "exactlyonce.process")
			require.Len(t, procs, 3)
			require.Equal(t, rspan.SpanContext().SpanID(), procs[2].Parent().SpanID())
			require.Equal(t, producer.SpanID(), procs[2].Links()[0].SpanContext.SpanID())
			require.Equal(t, rctx, in.Context(), "the message's context is given back")
		})
	}
}

// Without a span anywhere (no TracerProvider, no traceparent), nothing is
// added to the rows' metadata.
func TestNoTraceNoMetadata(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testenv.Drivers(t)[0]
	tables := testenv.WithConn(testenv.Schema(t), d.DB)
	eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, Consumer: "c", Logger: testenv.Logger(t), PublishTopic: "out"})
	require.NoError(t, err)
	_, err = eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage("o", nil)}, nil
	})(message.NewMessage("m", nil))
	require.NoError(t, err)
	var meta string
	require.NoError(t, seam.QueryRow(ctx, d.DB, "SELECT metadata::text FROM "+tables.Outbox(), nil, &meta))
	require.False(t, strings.Contains(meta, "traceparent"), meta)
}
