package exactlyonce

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
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

// handleLease runs a delivery in lease mode: the claim commits on its own
// with a lease, the handler runs, then its completion commits (endLease).
func (m *Guard) handleLease(d *delivery, h message.HandlerFunc) {
	if !m.lease.Transactional() {
		if err := m.storeOnlyRefusal(d); err != nil {
			m.episodes.Fail("store-only:"+d.consumer, "exactlyonce: consumer "+strconv.Quote(d.consumer)+": the handler needs what a store-only lease cannot give, messages are refused before the handler runs and redelivered until the configuration is fixed", err,
				watermill.LogFields{"consumer": d.consumer, "key": d.key, "message_uuid": d.msg.UUID})
			d.nackLater(reported(err))
			return
		}
	}
	endClaim := m.startClaim(d)
	parked := m.parkedMessage(d)
	claim, err := m.lease.Claim(d.ctx, d.consumer, d.key, leasestore.Options{
		Lease: m.cfg.Lease.Duration, MaxInterrupted: m.cfg.Lease.MaxInterruptedAttempts, Message: parked,
	})
	endClaim(err)
	if err != nil {
		m.claimFailure(d, h, err)
		return
	}
	m.claimed()
	d.ev.Attempt = claim.Attempt
	switch claim.Outcome {
	case leasestore.Duplicate:
		d.ev.FirstSeenAt = claim.Record.FirstSeenAt
		d.settle(Duplicate, nil)
		return
	case leasestore.Parked:
		if !claim.ParkedNow {
			d.settle(Parked, nil)
			return
		}
		reason := errors.New(claim.Record.LastError)
		d.settle(Parked, reason)
		show, replay := m.parkedCommands(d.consumer, d.key)
		m.cfg.Logger.Error("exactlyonce: lease expired mid-attempt, key parked for an operator with its message; show it: "+show+"; replay it: "+replay,
			reason, watermill.LogFields{"consumer": d.consumer, "key": d.key, "attempt": claim.Attempt, "message_uuid": d.msg.UUID})
		return
	case leasestore.Busy:
		// Expected contention (another worker runs the key, or ran it and
		// stopped: its lease has to expire first), not an error: logged at
		// debug level, and marked for RouterLogger.
		var err error
		if claim.LeaseUntil.IsZero() {
			err = fmt.Errorf("exactlyonce: %w: %q for %q is held by another transaction (a claim or completion in progress)", ErrLeaseHeld, d.key, d.consumer)
		} else {
			err = fmt.Errorf("exactlyonce: %w: %q for %q, attempt %d, lease until %s", ErrLeaseHeld, d.key, d.consumer, claim.Attempt, claim.LeaseUntil.Format(time.RFC3339Nano))
		}
		m.cfg.Logger.Debug("exactlyonce: another worker holds the lease on this key, message will be redelivered", watermill.LogFields{
			"consumer": d.consumer, "key": d.key, "attempt": claim.Attempt, "lease_until": claim.LeaseUntil, "message_uuid": d.msg.UUID})
		d.nackLater(reported(err))
		return
	}
	if claim.Interrupted {
		d.ev.Interrupted = true
		m.cfg.Logger.Info("exactlyonce: retrying a key whose previous attempt was interrupted", watermill.LogFields{
			"consumer": d.consumer, "key": d.key, "attempt": claim.Attempt,
		})
	}

	lease := &leaseState{m: m, consumer: d.consumer, key: d.key, token: claim.Token, parked: parked, info: leaseInfo{
		attempt:     claim.Attempt,
		interrupted: claim.Interrupted,
		leaseUntil:  claim.LeaseUntil,
	}}
	if !m.lease.Transactional() {
		m.handleStoreOnly(d, h, lease)
		return
	}
	// The completion transaction begins when the handler first asks for it
	// (or at completion), so no connection is held during an external call
	// that comes before the handler's writes. It does not end with the
	// message's context: the router cancels that when it closes, and once
	// the handler's effect happened, recording it is worth finishing
	// (database/sql would roll the transaction back on cancel).
	var handlerDone atomic.Bool
	th := lazyTx(func() (wsql.Tx, error) {
		tx, err := m.cfg.DB.Conn.BeginTx(context.WithoutCancel(d.ctx), nil)
		if err != nil || handlerDone.Load() {
			return tx, err
		}
		// Begun by the handler: marked for the check before the
		// completion (MySQL, CheckMark).
		if err := m.store.MarkTx(context.WithoutCancel(d.ctx), tx); err != nil {
			_ = tx.Rollback()
			return nil, err
		}
		return tx, nil
	})
	defer th.rollback()
	ob := &lazyOutbox{tx: th, w: m.outbox, ctx: d.ctx, tracer: m.tracer}
	produced, herr := m.runHandler(d, h, &handlerValues{tx: th, outbox: ob, consumer: d.consumer, key: d.key, lease: lease})
	handlerDone.Store(true)
	// The completion's statements outlive the message's context (see the
	// completion transaction), bounded by their own timeout.
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(d.ctx), completionTimeout)
	defer cancel()
	end := leaseResult{stage: stageHandler, err: herr, handlerErr: herr}
	switch berr := th.beginErr(); {
	case berr != nil:
		// The database failed under the handler (which may have ignored
		// the error): its external effect may have happened.
		end = leaseResult{stage: stageBegin, err: berr, handlerErr: herr}
	case herr == nil:
		end.stage, end.err = m.completeLease(finishCtx, d, lease, th, ob, produced)
	}
	m.endLease(finishCtx, d, lease, th, end)
}

// completeLease runs the completion of an attempt whose handler succeeded:
// its output messages, the done record, COMMIT, in the handler's
// transaction. It returns the stage that failed and its error, or
// stageNone. A serialization failure of the done record (under REPEATABLE
// READ or SERIALIZABLE: the record changed after the transaction's
// snapshot) is checked in a fresh statement, after a rollback: only a
// takeover or an operator changes a held record, and then the error wraps
// ErrLeaseLost.
func (m *Guard) completeLease(ctx context.Context, d *delivery, l *leaseState, th *txHandle, ob *lazyOutbox,
	produced []*message.Message) (leaseStage, error) {
	outputs, err := m.prepareOutputs(d, produced)
	if err != nil {
		return stageOutputs, err
	}
	outputs.setContext(ctx)
	if tx, ok := th.current(); ok {
		// The handler used its transaction: before the completion's
		// statements, the check that the server did not end it (MySQL: a
		// deadlock the handler ignored), after which they would commit on
		// their own.
		if err := m.store.CheckMark(ctx, tx); err != nil {
			return stageCommit, err
		}
	}
	if err := outputs.write(ob); err != nil {
		return stageWrite, err
	}
	tx, err := th.get()
	if err != nil {
		return stageBegin, err
	}
	a := l.attempt()
	a.Tx = tx
	if err := m.lease.Complete(ctx, a); err != nil {
		if pgerr.SerializationFailure(err) && !errors.Is(err, leasestore.ErrLeaseLost) {
			th.rollback()
			if owns, oerr := m.lease.Owns(ctx, l.attempt()); oerr == nil && !owns {
				err = fmt.Errorf("%w (%w)", leasestore.ErrLeaseLost, err)
			}
		}
		return stageComplete, err
	}
	ob.beforeCommit(ctx)
	if err := th.commit(); err != nil {
		return stageCommit, err
	}
	ob.afterCommit()
	return stageNone, nil
}

// handleStoreOnly runs the handler of a lease whose store is not
// PostgreSQL (LeaseConfig.Store) and records its completion there. The
// handler gets no transaction and no outbox: one that asked for them, or
// returned output messages, is misconfigured, and no retry can fix that.
// Its external effect may have happened, so the key is parked with its
// message (the handler never runs again for it: an operator replays the
// message once the handler is fixed), and the handler's later keys are
// refused before the handler runs (storeOnlyRefusal).
func (m *Guard) handleStoreOnly(d *delivery, h message.HandlerFunc, lease *leaseState) {
	use := &storeOnlyUse{}
	produced, herr := m.runHandler(d, h, &handlerValues{consumer: d.consumer, key: d.key, lease: lease, storeOnly: use})
	// Like the PostgreSQL completion, it outlives the message's context.
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(d.ctx), completionTimeout)
	defer cancel()
	end := leaseResult{stage: stageHandler, err: herr, handlerErr: herr}
	switch {
	case use.asked.Load() || len(produced) > 0:
		what := "asked for a transaction or an outbox"
		if len(produced) > 0 {
			what = fmt.Sprintf("returned %d output messages", len(produced))
		}
		why := fmt.Errorf("the handler %s, which only the PostgreSQL lease store can record with its completion (Config.Lease.Store)", what)
		m.misuses.set(handlerOf(d), why)
		reason := fmt.Errorf("exactlyonce: %q for %q: parked on a configuration error: %w", d.key, d.consumer, why)
		if herr != nil {
			reason = fmt.Errorf("%w (handler: %w)", reason, herr)
		}
		end = leaseResult{stage: stageMisuse, err: reason, handlerErr: herr}
	case herr == nil:
		end.stage, end.err = stageComplete, m.lease.Complete(finishCtx, lease.attempt())
		if end.err == nil {
			end.stage = stageNone
		}
	}
	m.endLease(finishCtx, d, lease, nil, end)
}

// leaseStage is where a lease-mode attempt stopped: the stage that failed,
// or stageNone when its completion committed.
type leaseStage int

const (
	stageNone     leaseStage = iota // the completion committed
	stageHandler                    // the handler returned an error (its transaction, if any, began)
	stageMisuse                     // store-only: the handler needed what the store cannot give (a configuration error)
	stageBegin                      // the completion's transaction could not begin (ErrDBUnavailable)
	stageOutputs                    // the handler's output messages were refused before any SQL
	stageWrite                      // writing the output messages to the outbox
	stageComplete                   // recording the key done (Complete)
	stageCommit                     // the completion's COMMIT
	stagePark                       // parking the key after a completion that can never commit
)

// leaseResult is what a lease-mode attempt came to: where it stopped,
// with that stage's error, the handler's error, and, at stagePark, the
// completion's failure that made it park.
type leaseResult struct {
	stage      leaseStage
	err        error
	handlerErr error
	cause      error // stagePark
}

// leaseEnd is how a lease-mode attempt ends (classifyLease).
type leaseEnd int

const (
	// leaseDone: the completion committed: processed, acked.
	leaseDone leaseEnd = iota
	// leaseFailed: the handler returned an error: it knows whether its
	// call happened, and chose a retry. The attempt is recorded failed
	// (the next delivery runs attempt n+1 at once), nacked.
	leaseFailed
	// leasePark: no retry can succeed: the handler's Permanent error, a
	// store-only misconfiguration, or a completion that would fail the
	// same way again (an output the outbox refuses, a constraint or data
	// error, also at COMMIT), after the handler's effect probably
	// happened. The key is parked with its message (a completion's park
	// marks the attempt interrupted), acked.
	leasePark
	// leaseAfterLease: the completion's outcome is unknown, or it cannot
	// be recorded (the database unreachable or refusing writes, a standby;
	// a COMMIT lost or refused for a reason not known to repeat): nothing
	// is recorded, nacked. The key
	// stays processing until its lease expires; then it runs again as an
	// interrupted attempt, at most MaxInterruptedAttempts times. Never a
	// blind immediate retry.
	leaseAfterLease
	// leaseLost: another worker took the key over, or an operator changed
	// its record: rolled back, nacked; the new holder decides.
	leaseLost
)

// classifyLease decides how a lease-mode attempt ends from the stage it
// stopped at and that stage's error. It does no I/O: endLease acts on it.
func classifyLease(stage leaseStage, err error) leaseEnd {
	if stage >= stageWrite && stage <= stageCommit && pgerr.ReadOnly(err) {
		// The server refuses writes (a standby, a read-only server): the
		// primary would take the completion, so it is not parked.
		return leaseAfterLease
	}
	switch stage {
	case stageNone:
		return leaseDone
	case stageHandler:
		if marked(err) {
			return leasePark
		}
		return leaseFailed
	case stageMisuse, stageOutputs:
		return leasePark
	case stageWrite:
		if pgerr.Deterministic(err) || isOutputError(err) {
			return leasePark
		}
	case stageComplete:
		switch {
		case errors.Is(err, leasestore.ErrLeaseLost):
			return leaseLost
		case pgerr.SerializationFailure(err):
			// Lost or not, checked by completeLease: here it still owned
			// the key; whether a new transaction would succeed is unknown.
			return leaseAfterLease
		case pgerr.Deterministic(err):
			return leasePark
		}
	case stageCommit:
		if pgerr.Deterministic(err) {
			// The server refused the commit (a deferred constraint): it
			// did not happen, and would not happen again.
			return leasePark
		}
	case stagePark:
		if errors.Is(err, leasestore.ErrLeaseLost) {
			return leaseLost
		}
	}
	return leaseAfterLease
}

// endLease ends a lease-mode attempt as classifyLease says: the one place
// that acts on it, and settles the delivery. th is the completion
// transaction (nil for a store-only lease), rolled back before anything is
// recorded; ctx bounds the completion's statements.
func (m *Guard) endLease(ctx context.Context, d *delivery, l *leaseState, th *txHandle, f leaseResult) {
	for {
		end := classifyLease(f.stage, f.err)
		if end != leaseDone && th != nil {
			th.rollback()
		}
		switch end {
		case leaseDone:
			d.settle(Processed, nil)
		case leaseFailed:
			_ = m.recordFailure(d.ctx, l, f.err, false)
			m.handlerFailed(d, f.err)
		case leaseLost:
			if f.stage == stagePark {
				d.nack(fmt.Errorf("exactlyonce: %q for %q: %w (completion: %w)", d.key, d.consumer, f.err, f.cause))
			} else {
				d.nack(fmt.Errorf("exactlyonce: completing %q for %q: %w", d.key, d.consumer, f.err))
			}
		case leaseAfterLease:
			err := afterLeaseError(d, f)
			if errors.Is(err, ErrDBReadOnly) {
				// The server refuses writes: so will it for the next
				// delivery, until the middleware reaches the primary.
				d.nackLater(m.readOnlyFailed(d, err))
				break
			}
			d.nack(err)
		case leasePark:
			switch f.stage {
			case stageHandler:
				if ferr := m.recordFailure(d.ctx, l, f.err, true); ferr != nil {
					// Not recorded: nack, so that the key is not lost.
					d.nack(fmt.Errorf("exactlyonce: %q for %q: the permanent failure could not be recorded: %w (handler: %w)", d.key, d.consumer, ferr, f.err))
					break
				}
				m.parkedNow(d, f.err, l.info.attempt)
			case stageMisuse:
				if ferr := m.recordFailure(d.ctx, l, f.err, true); ferr != nil {
					// Not parked: the key stays processing until its lease
					// expires; the refusal (storeOnlyRefusal) keeps the
					// handler from running it again in this process.
					d.nackLater(fmt.Errorf("%w (the park could not be recorded: %w)", f.err, ferr))
					break
				}
				m.parkedNow(d, f.err, l.info.attempt)
			default: // a completion that can never commit
				cause := f.err
				if f.stage == stageCommit {
					cause = fmt.Errorf("commit: %w", cause)
				}
				if err := m.lease.ParkInterrupted(ctx, l.attempt(), parkReason(cause)); err != nil {
					f = leaseResult{stage: stagePark, err: err, handlerErr: f.handlerErr, cause: cause}
					continue
				}
				m.parkedNow(d, fmt.Errorf("completion can never commit: %w", cause), l.info.attempt)
			}
		}
		return
	}
}

// parkReason is the reason recorded with a key parked because its
// completion can never commit, after cause.
func parkReason(cause error) string {
	if pgerr.InFailedTransaction(cause) {
		return "completion failed after the handler ran (its effect probably happened): a statement of the handler's transaction failed and the handler did not return the error, which aborted the transaction: " + cause.Error()
	}
	return "completion failed after the handler ran (its effect probably happened), and would fail the same way again: " + cause.Error()
}

// afterLeaseError is the error of an attempt whose completion failed with
// an unknown outcome (leaseAfterLease).
func afterLeaseError(d *delivery, f leaseResult) error {
	cause := pgerr.IfReadOnly(f.err)
	switch f.stage {
	case stageCommit:
		what := "failed, its outcome is unknown"
		if pgerr.CommitRefused(f.err) {
			// Nothing committed, but whether it would again is unknown
			// (the statement that aborted the transaction is not known):
			// the attempt's effect probably happened, so it is treated as
			// interrupted, never retried blindly.
			what = "refused by the server, nothing committed (" + refusalCause(f.err) + ")"
		}
		return fmt.Errorf("exactlyonce: completion of %q for %q %s: %w", d.key, d.consumer, what, cause)
	case stageBegin:
		// A hot standby refuses BEGIN READ WRITE (0A000): read-only, not
		// unreachable.
		sentinel := ErrDBUnavailable
		if pgerr.ReadOnly(f.err) {
			sentinel = ErrDBReadOnly
		}
		if f.handlerErr != nil {
			cause = fmt.Errorf("%w: begin completion: %w (handler: %w)", sentinel, f.err, f.handlerErr)
		} else {
			cause = fmt.Errorf("%w: begin completion: %w", sentinel, f.err)
		}
	case stagePark:
		cause = fmt.Errorf("%w (and parking failed: %w)", f.cause, f.err)
	}
	return fmt.Errorf("exactlyonce: %q for %q: completion failed after the handler ran: %w", d.key, d.consumer, cause)
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

// storeOnlyRefusal returns why the delivery's handler cannot run under a
// store-only lease, known before it runs: it is registered with a publish
// topic (router.AddHandler: it means to return messages, which the store
// cannot record), or an earlier delivery showed that it needs a
// transaction, an outbox or outputs (Guard.misuses). Nil when nothing is
// known against it, and for a key already settled (done, parked,
// discarded): the claim acks it without running the handler.
func (m *Guard) storeOnlyRefusal(d *delivery) error {
	topic := message.PublishTopicFromCtx(d.ctx)
	why := m.misuses.get(handlerOf(d))
	if topic == "" && why == nil {
		return nil
	}
	if rec, err := m.lease.Get(d.ctx, d.consumer, d.key); err == nil && inboxdb.Settled(rec.Status) {
		return nil
	}
	handler := message.HandlerNameFromCtx(d.ctx)
	if topic != "" {
		return fmt.Errorf("exactlyonce: consumer %q: handler %q has publish topic %q, which the lease store (Config.Lease.Store) cannot record: %w", d.consumer, handler, topic, ErrClaimFailed)
	}
	return fmt.Errorf("exactlyonce: consumer %q, handler %q: %w: on an earlier delivery, %w", d.consumer, handler, ErrClaimFailed, why)
}

// handlerID names a handler: its consumer and its router handler name, so
// that a handler's mistake does not refuse another handler recording under
// the same consumer.
type handlerID struct{ consumer, handler string }

func handlerOf(d *delivery) handlerID {
	return handlerID{d.consumer, message.HandlerNameFromCtx(d.ctx)}
}

// misuses remembers, per handler, why it cannot run under a store-only
// lease: it asked for a transaction or an outbox, or returned messages.
// Only a run shows that (New sees the configuration, not the handlers,
// and refuses what the configuration alone shows: Config.DB, Batch,
// FailOpen, PublishTopic), so it is kept by the Guard, for its lifetime:
// the handler's later keys are refused before it runs (storeOnlyRefusal).
type misuses struct {
	some atomic.Bool // a misuse is known: most Guards never have one
	mu   sync.Mutex
	why  map[handlerID]error
}

// get returns why the handler cannot run, or nil.
func (s *misuses) get(id handlerID) error {
	if !s.some.Load() {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.why[id]
}

func (s *misuses) set(id handlerID, why error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.why == nil {
		s.why = map[handlerID]error{}
	}
	s.why[id] = why
	s.some.Store(true)
}
