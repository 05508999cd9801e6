package exactlyonce

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
)

// ExtendLease extends the current lease-mode attempt's lease to now + d (d
// <= 0 uses Config.Lease.Duration). Call it from a handler that may run longer than
// its lease. It returns ErrLeaseLost when another worker took the key over
// (stop: your completion will be refused), and an error outside lease mode.
//
// It never takes a second database connection while the handler holds one:
// once the handler's transaction began (PgxTxFromContext, StdTxFromContext,
// OutboxFromContext), the extension is written in it, and its row lock keeps
// every other worker off the key until the transaction ends. Before that, it runs on its own,
// and never waits for a connection past the current lease's end: then it
// returns an error (the lease may be lost; stop if the effect must not run
// twice). With a Redis store (LeaseConfig.Store) it is one script, bounded
// the same way.
func ExtendLease(ctx context.Context, d time.Duration) error {
	v := valuesFrom(ctx)
	if v == nil {
		return noDelivery(ctx, "ExtendLease")
	}
	if v.lease == nil {
		return errors.New("exactlyonce: ExtendLease called outside a lease-mode handler")
	}
	return v.lease.extend(ctx, v.tx, d)
}

// leaseState lives in the handler's context in lease mode.
type leaseState struct {
	m             *Guard
	consumer, key string
	token         string
	parked        *inboxdb.ParkedMessage // what a park of the attempt keeps
	mu            sync.Mutex
	info          leaseInfo
}

// leaseInfo is the attempt's part of Info.
type leaseInfo struct {
	attempt     int
	interrupted bool
	leaseUntil  time.Time
}

// minExtendWait is the least an extension outside the handler's
// transaction waits for a connection when its lease is (nearly) over.
const minExtendWait = 500 * time.Millisecond

func (l *leaseState) extend(ctx context.Context, th *txHandle, d time.Duration) error {
	if d <= 0 {
		d = l.m.cfg.Lease.Duration
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	a := l.attempt()
	if th != nil { // nil: a store that is not PostgreSQL, no transaction
		if tx, ok := th.current(); ok {
			a.Tx = tx
		}
	}
	deadline := l.info.leaseUntil
	if wait := time.Now().Add(minExtendWait); deadline.Before(wait) {
		deadline = wait
	}
	ectx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	until, err := l.m.lease.Extend(ectx, a, d)
	if err != nil {
		if errors.Is(err, leasestore.ErrLeaseLost) {
			return fmt.Errorf("exactlyonce: extending the lease of %q for %q: %w", l.key, l.consumer, err)
		}
		if ectx.Err() != nil && ctx.Err() == nil {
			return fmt.Errorf("exactlyonce: extending the lease of %q for %q: no answer from the store before the lease ends at %s: %w",
				l.key, l.consumer, l.info.leaseUntil.Format(time.RFC3339Nano), err)
		}
		return fmt.Errorf("exactlyonce: extending the lease of %q for %q: %w", l.key, l.consumer, err)
	}
	l.info.leaseUntil = until
	return nil
}

// attempt names the attempt for the store, with the message a park of it
// keeps.
func (l *leaseState) attempt() leasestore.Attempt {
	return leasestore.Attempt{Consumer: l.consumer, Key: l.key, Token: l.token, Message: l.parked}
}

func (l *leaseState) snapshot() leaseInfo {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.info
}

func (m *Guard) handleLease(msg *message.Message, h message.HandlerFunc, ev *Event, origCtx context.Context, consumer, key string) ([]*message.Message, error) {
	if !m.lease.Transactional() {
		if err := m.storeOnlyRefusal(origCtx, consumer, key); err != nil {
			ev.Outcome = Nacked
			m.episodes.Fail("store-only:"+consumer, "exactlyonce: consumer "+strconv.Quote(consumer)+": the handler needs what a store-only lease cannot give, messages are refused before the handler runs and redelivered until the configuration is fixed", err,
				watermill.LogFields{"consumer": consumer, "key": key, "message_uuid": msg.UUID})
			sleep(origCtx, m.cfg.NackDelay)
			return nil, reported(err)
		}
	}
	endClaim := m.startClaim(origCtx, ev)
	parked := m.parkedMessage(msg)
	claim, err := m.lease.Claim(origCtx, consumer, key, leasestore.Options{
		Lease: m.cfg.Lease.Duration, MaxInterrupted: m.cfg.Lease.MaxInterruptedAttempts, Message: parked,
	})
	endClaim(err)
	if err != nil {
		return m.claimFailure(msg, h, ev, err)
	}
	m.claimed()
	ev.Attempt = claim.Attempt
	switch claim.Outcome {
	case leasestore.Duplicate:
		ev.Outcome = Duplicate
		ev.FirstSeenAt = claim.Record.FirstSeenAt
		return nil, nil
	case leasestore.Parked:
		ev.Outcome = Parked
		if claim.ParkedNow {
			ev.Err = errors.New(claim.Record.LastError)
			show, replay := m.parkedCommands(consumer, key)
			m.cfg.Logger.Error("exactlyonce: lease expired mid-attempt, key parked for an operator with its message; show it: "+show+"; replay it: "+replay,
				ev.Err, watermill.LogFields{"consumer": consumer, "key": key, "attempt": claim.Attempt, "message_uuid": msg.UUID})
		}
		return nil, nil
	case leasestore.Busy:
		// Expected contention (another worker runs the key, or ran it and
		// stopped: its lease has to expire first), not an error: logged at
		// debug level, and marked for RouterLogger.
		ev.Outcome = Nacked
		var err error
		if claim.LeaseUntil.IsZero() {
			err = fmt.Errorf("exactlyonce: %w: %q for %q is held by another transaction (a claim or completion in progress)", ErrLeaseHeld, key, consumer)
		} else {
			err = fmt.Errorf("exactlyonce: %w: %q for %q, attempt %d, lease until %s", ErrLeaseHeld, key, consumer, claim.Attempt, claim.LeaseUntil.Format(time.RFC3339Nano))
		}
		m.cfg.Logger.Debug("exactlyonce: another worker holds the lease on this key, message will be redelivered", watermill.LogFields{
			"consumer": consumer, "key": key, "attempt": claim.Attempt, "lease_until": claim.LeaseUntil, "message_uuid": msg.UUID})
		sleep(origCtx, m.cfg.NackDelay)
		return nil, reported(err)
	}
	if claim.Interrupted {
		ev.Interrupted = true
		m.cfg.Logger.Info("exactlyonce: retrying a key whose previous attempt was interrupted", watermill.LogFields{
			"consumer": consumer, "key": key, "attempt": claim.Attempt,
		})
	}

	lease := &leaseState{m: m, consumer: consumer, key: key, token: claim.Token, parked: parked, info: leaseInfo{
		attempt:     claim.Attempt,
		interrupted: claim.Interrupted,
		leaseUntil:  claim.LeaseUntil,
	}}
	if !m.lease.Transactional() {
		return m.handleStoreOnly(msg, h, ev, origCtx, lease)
	}
	// The completion transaction begins when the handler first asks for it
	// (or at completion), so no connection is held during an external call
	// that comes before the handler's writes. It does not end with the
	// message's context: the router cancels that when it closes, and once
	// the handler's effect happened, recording it is worth finishing
	// (database/sql would roll the transaction back on cancel).
	th := lazyTx(func() (wsql.Tx, error) { return m.cfg.DB.Conn.BeginTx(context.WithoutCancel(origCtx), nil) })
	defer th.rollback()
	ob := &lazyOutbox{tx: th, w: m.outbox, ctx: origCtx, tracer: m.tracer}
	msg.SetContext(withHandlerContext(origCtx, &handlerValues{tx: th, outbox: ob, consumer: consumer, key: key, lease: lease}))
	produced, herr := m.callHandler(h, msg)
	msg.SetContext(origCtx)
	berr := th.beginErr()
	if herr != nil && berr == nil {
		// The handler's own failure: it knows whether its call happened,
		// and chose a retry (or, with Permanent, an operator).
		th.rollback()
		return m.leaseHandlerFailed(msg, ev, lease, herr)
	}
	return m.completeLease(msg, ev, lease, th, ob, produced, herr, berr)
}

// leaseHandlerFailed records the handler's error: parked for Permanent
// (acked), failed otherwise (nacked; the next delivery runs attempt n+1).
func (m *Guard) leaseHandlerFailed(msg *message.Message, ev *Event, lease *leaseState, herr error) ([]*message.Message, error) {
	consumer, key := lease.consumer, lease.key
	if marked(herr) {
		if ferr := m.recordFailure(msg.Context(), lease, herr, true); ferr != nil {
			// Not recorded: nack, so that the key is not lost.
			ev.Outcome = Nacked
			return nil, fmt.Errorf("exactlyonce: %q for %q: the permanent failure could not be recorded, the message will be redelivered: %w (handler: %w)", key, consumer, ferr, herr)
		}
		return m.parkedNow(msg, ev, herr, consumer, key, lease.info.attempt)
	}
	ev.Outcome = Nacked
	_ = m.recordFailure(msg.Context(), lease, herr, false)
	return nil, m.handlerFailed(msg, herr, consumer, key)
}

// storeOnlyRefusal returns why consumer's handler cannot run under a
// store-only lease, known before it runs: it is registered with a publish
// topic (router.AddHandler: it means to return messages, which the store
// cannot record), or an earlier delivery showed that it needs a
// transaction, an outbox or outputs. Nil when nothing is known against it,
// and for a key already settled (done, parked, discarded): the claim acks it without running
// the handler.
func (m *Guard) storeOnlyRefusal(ctx context.Context, consumer, key string) error {
	topic := message.PublishTopicFromCtx(ctx)
	why, known := m.misconfigured.Load(misconfiguredKey(ctx, consumer))
	if topic == "" && !known {
		return nil
	}
	if rec, err := m.lease.Get(ctx, consumer, key); err == nil && inboxdb.Settled(rec.Status) {
		return nil
	}
	if topic := message.PublishTopicFromCtx(ctx); topic != "" {
		return fmt.Errorf("exactlyonce: consumer %q: %w: handler %q is registered with publish topic %q, but the lease store (Config.Lease.Store) is not PostgreSQL and cannot record output messages with its completion: refused before the handler ran; register it with router.AddConsumerHandler (no publish topic), or use the PostgreSQL lease store", consumer, ErrClaimFailed, message.HandlerNameFromCtx(ctx), topic)
	}
	if known {
		return fmt.Errorf("exactlyonce: consumer %q, handler %q: %w: refused before the handler ran, because an earlier delivery showed what it needs: %w", consumer, message.HandlerNameFromCtx(ctx), ErrClaimFailed, why.(error))
	}
	return nil
}

// misconfiguredKey names a handler for Middleware.misconfigured: its
// consumer and its router handler name, so that a handler's mistake does
// not refuse another handler recording under the same consumer.
func misconfiguredKey(ctx context.Context, consumer string) [2]string {
	return [2]string{consumer, message.HandlerNameFromCtx(ctx)}
}

// handleStoreOnly runs the handler of a lease whose store is not
// PostgreSQL (LeaseConfig.Store) and records its completion there. The
// handler gets no transaction and no outbox: one that asked for them, or
// returned output messages, is misconfigured, and no retry can fix that.
// Its external effect may have happened, so the key is parked with its
// message (the handler never runs again for it: an operator replays the
// message once the handler is fixed), and the handler's later keys are
// refused before the handler runs (storeOnlyRefusal).
func (m *Guard) handleStoreOnly(msg *message.Message, h message.HandlerFunc, ev *Event, origCtx context.Context, lease *leaseState) ([]*message.Message, error) {
	consumer, key := lease.consumer, lease.key
	use := &storeOnlyUse{}
	msg.SetContext(withHandlerContext(origCtx, &handlerValues{consumer: consumer, key: key, lease: lease, storeOnly: use}))
	produced, herr := m.callHandler(h, msg)
	msg.SetContext(origCtx)
	if use.asked.Load() || len(produced) > 0 {
		what := "asked for a transaction or an outbox"
		if len(produced) > 0 {
			what = fmt.Sprintf("returned %d output messages", len(produced))
		}
		why := fmt.Errorf("the handler %s, which the lease store (Config.Lease.Store) cannot record with its completion; use the PostgreSQL lease store for a handler with database writes or outputs", what)
		m.misconfigured.Store(misconfiguredKey(origCtx, consumer), why)
		reason := fmt.Errorf("exactlyonce: %q for %q: configuration error: %w; parked so that the handler (and any external call it made) does not run again for this key: replay it once the handler is fixed", key, consumer, why)
		if herr != nil {
			reason = fmt.Errorf("%w (handler: %w)", reason, herr)
		}
		if ferr := m.recordFailure(origCtx, lease, reason, true); ferr != nil {
			// Not parked: the key stays processing until its lease
			// expires; the refusal above keeps the handler from running
			// it again in this process.
			ev.Outcome = Nacked
			sleep(origCtx, m.cfg.NackDelay)
			return nil, fmt.Errorf("%w; the park could not be recorded (%w), the message will be redelivered", reason, ferr)
		}
		return m.parkedNow(msg, ev, reason, consumer, key, lease.info.attempt)
	}
	if herr != nil {
		return m.leaseHandlerFailed(msg, ev, lease, herr)
	}
	// Like the PostgreSQL completion, it outlives the message's context.
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(origCtx), completionTimeout)
	defer cancel()
	if err := m.lease.Complete(finishCtx, lease.attempt()); err != nil {
		ev.Outcome = Nacked
		if errors.Is(err, leasestore.ErrLeaseLost) {
			return nil, fmt.Errorf("exactlyonce: completing %q for %q: %w", key, consumer, err)
		}
		return nil, fmt.Errorf("exactlyonce: %q for %q: completion failed after the handler ran; the key stays processing until its lease expires, then it runs again as an interrupted attempt (or is parked after LeaseConfig.MaxInterruptedAttempts): %w", key, consumer, err)
	}
	ev.Outcome = Processed
	return nil, nil
}

// completeLease commits the completion of an attempt whose handler
// succeeded (or under which the database failed): its external effect
// probably happened. How a failure here ends depends on whether repeating
// the attempt could ever succeed:
//
//   - deterministic (an output the outbox refuses, a constraint or data
//     error, also at COMMIT): repeating would repeat the effect and fail the
//     same way, so the key is parked with the reason, marked interrupted,
//     and the message acked;
//   - lease lost (another worker took over, or an operator changed the
//     record): rolled back, the new holder decides;
//   - anything else (the database unreachable, the commit's outcome
//     unknown): nothing is recorded, the key stays processing until its
//     lease expires; then it runs again with Interrupted set, at most
//     MaxInterruptedAttempts times. Never a blind immediate retry.
func (m *Guard) completeLease(msg *message.Message, ev *Event, lease *leaseState, th *txHandle, ob *lazyOutbox,
	produced []*message.Message, herr, berr error) ([]*message.Message, error) {
	consumer, key := lease.consumer, lease.key
	// The completion's statements outlive the message's context (see the
	// completion transaction), bounded by their own timeout.
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), completionTimeout)
	defer cancel()
	unknown := func(cause error) ([]*message.Message, error) {
		th.rollback()
		ev.Outcome = Nacked
		return nil, fmt.Errorf("exactlyonce: %q for %q: completion failed after the handler ran; the key stays processing until its lease expires, then it runs again as an interrupted attempt (or is parked after LeaseConfig.MaxInterruptedAttempts): %w", key, consumer, cause)
	}
	park := func(cause error) ([]*message.Message, error) {
		th.rollback()
		reason := "completion failed after the handler ran (its effect probably happened), and would fail the same way again: " + cause.Error()
		if pgerr.InFailedTransaction(cause) {
			reason = "completion failed after the handler ran (its effect probably happened): a statement of the handler's transaction failed and the handler did not return the error, which aborted the transaction: " + cause.Error()
		}
		if err := m.lease.ParkInterrupted(finishCtx, lease.attempt(), reason); err != nil {
			if errors.Is(err, leasestore.ErrLeaseLost) {
				ev.Outcome = Nacked
				return nil, fmt.Errorf("exactlyonce: %q for %q: %w (completion: %w)", key, consumer, err, cause)
			}
			return unknown(fmt.Errorf("%w (and parking failed: %w)", cause, err))
		}
		return m.parkedNow(msg, ev, fmt.Errorf("completion can never commit: %w", cause), consumer, key, lease.info.attempt)
	}
	switch {
	case berr != nil && herr != nil:
		return unknown(fmt.Errorf("%w: begin completion: %w (handler: %w)", ErrDBUnavailable, berr, herr))
	case berr != nil:
		return unknown(fmt.Errorf("%w: begin completion: %w", ErrDBUnavailable, berr))
	}
	outputs, err := m.prepareOutputs(msg, produced)
	if err != nil {
		return park(err)
	}
	outputs.setContext(finishCtx)
	if err := outputs.write(ob); err != nil {
		if pgerr.Deterministic(err) || isOutputError(err) {
			return park(err)
		}
		return unknown(err)
	}
	tx, err := th.get()
	if err != nil {
		return unknown(fmt.Errorf("%w: begin completion: %w", ErrDBUnavailable, err))
	}
	a := lease.attempt()
	a.Tx = tx
	if err := m.lease.Complete(finishCtx, a); err != nil {
		switch {
		case errors.Is(err, leasestore.ErrLeaseLost):
			th.rollback()
			ev.Outcome = Nacked
			return nil, fmt.Errorf("exactlyonce: completing %q for %q: %w", key, consumer, err)
		case pgerr.SerializationFailure(err):
			// Under REPEATABLE READ or SERIALIZABLE: the record changed
			// after this transaction's snapshot. Only a takeover or an
			// operator changes a held record; check in a fresh statement.
			th.rollback()
			if owns, oerr := m.lease.Owns(finishCtx, lease.attempt()); oerr == nil && !owns {
				ev.Outcome = Nacked
				return nil, fmt.Errorf("exactlyonce: completing %q for %q: %w (%w)", key, consumer, leasestore.ErrLeaseLost, err)
			}
			return unknown(err)
		case pgerr.Deterministic(err):
			return park(err)
		}
		return unknown(err)
	}
	ob.beforeCommit(finishCtx)
	if err := th.commit(); err != nil {
		if pgerr.Deterministic(err) {
			// The server refused the commit (a deferred constraint): it
			// did not happen, and would not happen again.
			return park(fmt.Errorf("commit: %w", err))
		}
		ev.Outcome = Nacked
		what := "failed, its outcome is unknown"
		if pgerr.CommitRefused(err) {
			// Nothing committed, but whether it would again is unknown
			// (the statement that aborted the transaction is not known):
			// the attempt's effect probably happened, so it is treated as
			// interrupted, never retried blindly.
			what = "refused by the server, nothing committed (" + refusalCause(err) + ")"
		}
		return nil, fmt.Errorf("exactlyonce: completion of %q for %q %s; the key stays processing until its lease expires, then it runs again as an interrupted attempt (or is parked after LeaseConfig.MaxInterruptedAttempts): %w", key, consumer, what, err)
	}
	ev.Outcome = Processed
	return nil, nil
}

// completionTimeout bounds the statements of a lease-mode completion, which
// do not end with the message's context.
const completionTimeout = 30 * time.Second

// recordFailure records a failed attempt so that the next delivery can run
// at once instead of waiting for the lease to expire. If it cannot be
// recorded, the lease expiry covers it; the error is logged and returned.
func (m *Guard) recordFailure(ctx context.Context, l *leaseState, cause error, permanent bool) error {
	err := m.lease.Fail(context.WithoutCancel(ctx), l.attempt(), cause.Error(), permanent)
	if err != nil {
		m.cfg.Logger.Error("exactlyonce: could not record the failed attempt; the lease expiry will release the key", err,
			watermill.LogFields{"consumer": l.consumer, "key": l.key, "attempt": l.info.attempt})
	}
	return err
}

// parkedNow reports a key parked by this delivery (a Permanent handler
// error, or a completion that can never commit), its message kept with
// it: logged with the commands that show and replay it, acked.
func (m *Guard) parkedNow(msg *message.Message, ev *Event, reason error, consumer, key string, attempt int) ([]*message.Message, error) {
	ev.Outcome = Parked
	ev.Err = reason
	show, replay := m.parkedCommands(consumer, key)
	m.cfg.Logger.Error("exactlyonce: key parked for an operator with its message, message acked; show it: "+show+"; replay it: "+replay, reason,
		watermill.LogFields{"consumer": consumer, "key": key, "attempt": attempt, "message_uuid": msg.UUID})
	return nil, nil
}
