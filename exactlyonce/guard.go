package exactlyonce

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/watermill-exactlyonce/internal/episode"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxwrite"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlexec"
	"github.com/exactlyonce/watermill-exactlyonce/internal/tracing"
)

// Guard is the exactly-once middleware: it guards the handlers it wraps so
// that their effects happen once. Create it with New and attach its
// Middleware method to a router (router.AddMiddleware) or to handlers
// (handler.AddMiddleware). One handler takes one exactly-once middleware:
// wrapped by two (one router-wide, another on the handler), every
// delivery fails with ErrNestedMiddleware.
type Guard struct {
	cfg       Config
	customKey bool // Config.Key was set (not the message UUID)
	store     *inboxdb.Store
	conn      sqlexec.DB         // Config.DB.Conn, classified once (a pgx pool: BEGIN and the claim in one round trip)
	lease     leasestore.Backend // lease mode's store
	conncheck connCheck          // the connection checked before the first claim (MySQL)
	names     pgerr.Tables
	scopes    scopes
	tracer    trace.Tracer
	// misuses holds, per handler, why it cannot run under a store-only
	// lease (it asked for a transaction or an outbox, or returned
	// messages): its later keys are refused before it runs, for the
	// Guard's lifetime.
	misuses  misuses
	episodes *episode.Log
	check    startupCheck
	// outbox writes the deliveries' output messages, and holds the
	// debounce of their wake-on-commit NOTIFYs.
	outbox *outboxwrite.Writer
}

// New checks cfg, applies its defaults and returns the middleware. It does
// not touch the database. The first delivery whose claim succeeded runs a
// start-up check once, after it was handled, and logs what it finds: tables missing or older than
// this version of the library (sqlschema.Check), or, with the Redis lease
// store, a server without an append-only file or with an eviction policy
// (redisstore.Store.CheckServer). It fails nothing: a store that cannot be
// reached then is checked again after the next successful claim; tables
// missing altogether are reported by the failing claims.
// Deliveries that need what is missing fail with ErrClaimFailed wrapping
// sqlschema.ErrNotMigrated; run sqlschema.Check yourself to fail a
// deployment on it.
func New(cfg Config) (*Guard, error) {
	customKey := cfg.Key != nil
	if cfg.storeOnly() {
		if err := cfg.validateStoreOnly(); err != nil {
			return nil, err
		}
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: cfg.DB, MaxKeyLength: cfg.MaxKeyLength,
		LiteralClaim: cfg.LiteralClaim, OnLiteralClaim: literalClaimLogger(cfg.Logger)})
	if err != nil {
		return nil, fmt.Errorf("exactlyonce: %w", err)
	}
	ob, err := outboxwrite.New(cfg.DB)
	if err != nil {
		return nil, fmt.Errorf("exactlyonce: %w", err)
	}
	names := pgerr.Tables{Schema: cfg.DB.Schema, Inbox: cfg.DB.InboxTable, Outbox: cfg.DB.OutboxTable}
	m := &Guard{cfg: cfg, customKey: customKey, store: store, conn: sqlexec.Of(cfg.DB.Conn), names: names, tracer: tracing.Tracer(cfg.TracerProvider),
		episodes: episode.New(cfg.Logger, 0, 0), outbox: ob}
	m.check.pending.Store(true)
	switch {
	case cfg.storeOnly():
		if m.lease = leasestore.BackendOf(cfg.Lease.Store); m.lease == nil {
			return nil, errors.New("exactlyonce: Config.Lease.Store has no backend (use redisstore.New)")
		}
	case cfg.Lease != nil:
		m.lease = &leasestore.Postgres{Store: store, DB: cfg.DB.Conn}
	}
	return m, nil
}

// Middleware wraps h. It has the signature of message.HandlerMiddleware.
func (m *Guard) Middleware(h message.HandlerFunc) message.HandlerFunc {
	var b *batcher
	if m.cfg.Batch != nil {
		b = newBatcher(m, h)
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		prev := msg.Context()
		if valuesFrom(prev) != nil {
			return m.nested(msg)
		}
		start := time.Now()
		ctx, opts := tracing.ConsumerStart(msg)
		ctx, span := m.tracer.Start(ctx, "exactlyonce.process", append(opts,
			trace.WithAttributes(attribute.String("messaging.message.id", msg.UUID)))...)
		d := &delivery{msg: msg, orig: prev, ctx: ctx, ev: Event{MessageUUID: msg.UUID}}
		m.handle(d, h, b)
		if d.wait {
			sleep(d.ctx, m.cfg.NackDelay)
		}
		out, err := d.result()
		ev := d.ev
		ev.Duration = time.Since(start)
		span.SetAttributes(
			attribute.String("exactlyonce.consumer", ev.Consumer),
			attribute.String("exactlyonce.outcome", string(ev.Outcome)))
		if ev.Attempt > 0 {
			span.SetAttributes(attribute.Int("exactlyonce.attempt", ev.Attempt))
		}
		endSpan(span, err)
		// Before the event: a delivery is reported once all of it is done.
		m.runCheck(prev)
		m.cfg.OnEvent(ev)
		return out, err
	}
}

// nested refuses a delivery that an exactly-once middleware outside this
// one is already handling: its context carries that middleware's
// handlerValues, which every mode puts only in the context it passes to
// the handler it wraps (and takes off the message when the handler
// returns, so that Watermill's Retry, outside, calls again with a clean
// message). Claiming here would wait for the outer claim's uncommitted row
// (transactional mode and group commit: a hang), or find its lease held
// (lease mode: nacked as ErrLeaseHeld on every redelivery). Nothing is
// claimed; the outer middleware rolls back and returns the error after
// NackDelay (handlerFailed), and every redelivery fails the same way,
// logged at ERROR each time, until the wiring is fixed.
func (m *Guard) nested(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	outer := valuesFrom(ctx)
	handler := message.HandlerNameFromCtx(ctx)
	consumer := m.cfg.Consumer
	if consumer == "" {
		consumer = handler
	}
	err := fmt.Errorf("exactlyonce: %w: handler %q, message %q: an outer exactly-once middleware (AddMiddleware) already handles key %q of consumer %q",
		ErrNestedMiddleware, handler, msg.UUID, outer.key, outer.consumer)
	m.cfg.Logger.Error("exactlyonce: two exactly-once middlewares wrap one handler: the delivery is refused, and will be redelivered and refused until the wiring is fixed", err,
		watermill.LogFields{"handler": handler, "message_uuid": msg.UUID, "consumer": consumer})
	err = reported(err)
	m.cfg.OnEvent(Event{Outcome: Nacked, Consumer: consumer, MessageUUID: msg.UUID, Err: err})
	return nil, err
}

// handle derives the consumer and key and hands the delivery to its mode,
// which settles it.
func (m *Guard) handle(d *delivery, h message.HandlerFunc, b *batcher) {
	d.consumer = m.cfg.Consumer
	if d.consumer == "" {
		d.consumer = message.HandlerNameFromCtx(d.orig)
	}
	d.ev.Consumer = d.consumer

	var key string
	var err error
	d.under(d.ctx, func() { key, err = m.cfg.Key(d.msg) })
	if err == nil {
		err = m.store.ValidateKey(d.consumer, key)
	}
	if err != nil {
		// Never succeeds on redelivery: the wait keeps a consumer without a
		// poison queue from spinning on it (it still blocks that consumer).
		d.nackLater(keyError(d.msg, d.consumer, err, m.customKey))
		return
	}
	d.key, d.ev.Key = key, key
	if m.lease == nil || m.lease.Transactional() {
		if err := m.conncheck.check(d.ctx, m.cfg.DB); err != nil {
			err = claimError(d, ErrClaimFailed, err)
			m.claimFailed(err, nil)
			d.nackLater(reported(err)) // a configuration error: never succeeds on redelivery
			return
		}
	}
	switch {
	case m.cfg.Lease != nil:
		m.handleLease(d, h)
	case b != nil:
		m.scopes.check(m, d)
		b.handleBatched(d)
	default:
		m.scopes.check(m, d)
		m.handleTransactional(d, h)
	}
}

func keyError(msg *message.Message, consumer string, err error, customKey bool) error {
	if !errors.Is(err, ErrInvalidKey) {
		// The Key function's own error: say so, and keep it branchable.
		err = fmt.Errorf("%w: Config.Key: %w", ErrInvalidKey, err)
	}
	hint := ""
	switch {
	case errors.Is(err, inboxdb.ErrEmptyKey) && customKey:
		hint = ": Config.Key returned an empty key for this message"
	case errors.Is(err, inboxdb.ErrEmptyKey):
		hint = ": set a UUID on the message (rabbitmq.Marshaler reads message_id) or Config.Key"
	case errors.Is(err, inboxdb.ErrEmptyConsumer):
		hint = ": Config.Consumer is empty and no Watermill router names the handler"
	}
	return fmt.Errorf("exactlyonce: message %q for handler %q cannot be deduplicated: %w%s", msg.UUID, consumer, err, hint)
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// endSpan records err on span, if any, and ends it.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// startClaim starts the delivery's claim span; the function it returns
// ends it and records the claim's time in the delivery's event.
func (m *Guard) startClaim(d *delivery) func(error) {
	start := time.Now()
	_, span := m.tracer.Start(d.ctx, "exactlyonce.claim")
	return func(err error) {
		d.ev.ClaimDuration = time.Since(start)
		endSpan(span, err)
	}
}
