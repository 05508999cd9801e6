package middleware

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
)

// ErrLeaseHeld is returned (wrapped) in lease mode when another worker holds
// a live lease on the key. The message is nacked, after NackDelay, never
// acked: the holder may still fail, and then this copy must run.
var ErrLeaseHeld = errors.New("exactlyonce: another worker holds the lease on this key")

// ErrLeaseLost is inbox.ErrLeaseLost: the attempt's lease expired and
// another worker took the key over before this one completed.
var ErrLeaseLost = inbox.ErrLeaseLost

// PermanentError marks a handler error that retrying cannot fix (a rejected
// phone number, a payload the provider refuses). In lease mode the key is
// recorded as parked with the error, and the message is acked.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err as a PermanentError. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// LeaseInfo is what a lease-mode handler knows about its attempt.
type LeaseInfo struct {
	// IdempotencyKey is the key to pass to the external provider (for
	// example as the Idempotency-Key HTTP header). It is the same for every
	// attempt of the same (consumer, message key): "<consumer>:<key>", or
	// "sha256:<hex>" of both when that would be longer than 255 bytes.
	IdempotencyKey string
	// Attempt is 1 for the first run of the key, and counts up.
	Attempt int
	// Interrupted is true when the previous attempt's lease expired while
	// it was processing: the previous worker died or hung, and its call to
	// the provider may or may not have happened. Pass the same
	// IdempotencyKey and the provider can tell.
	Interrupted bool
	// LeaseUntil is when the lease ends unless extended.
	LeaseUntil time.Time
}

// LeaseFromContext returns the lease-mode attempt's information; false in
// transactional mode or outside the middleware.
func LeaseFromContext(ctx context.Context) (LeaseInfo, bool) {
	v := valuesFrom(ctx)
	if v == nil || v.lease == nil {
		return LeaseInfo{}, false
	}
	return v.lease.info, true
}

// ExtendLease extends the current lease-mode attempt's lease to now + d (d
// <= 0 uses Config.Lease). Call it from a handler that may run longer than
// its lease. It returns ErrLeaseLost when another worker took the key over
// (stop: your completion will be refused), and an error outside lease mode.
func ExtendLease(ctx context.Context, d time.Duration) error {
	v := valuesFrom(ctx)
	if v == nil || v.lease == nil {
		return errors.New("exactlyonce: ExtendLease called outside a lease-mode handler")
	}
	return v.lease.extend(ctx, d)
}

// leaseState lives in the handler's context in lease mode.
type leaseState struct {
	m             *Middleware
	consumer, key string
	info          LeaseInfo
}

func (l *leaseState) extend(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		d = l.m.cfg.Lease
	}
	until, err := l.m.store.ExtendLease(ctx, l.m.cfg.DB, l.consumer, l.key, l.info.Attempt, d)
	if err != nil {
		return err
	}
	l.info.LeaseUntil = until
	return nil
}

func idempotencyKey(consumer, key string) string {
	k := consumer + ":" + key
	if len(k) <= 255 {
		return k
	}
	sum := sha256.Sum256([]byte(consumer + "\x00" + key))
	return "sha256:" + hex.EncodeToString(sum[:])
}

func (m *Middleware) handleLease(msg *message.Message, h message.HandlerFunc, ev *Event, origCtx context.Context, consumer, key string) ([]*message.Message, error) {
	claim, err := m.store.ClaimLease(origCtx, m.cfg.DB, consumer, key, m.cfg.Lease, m.cfg.OnExpired)
	if err != nil {
		return m.dbFailure(msg, h, ev, err)
	}
	ev.Attempt = claim.Attempt
	switch claim.Outcome {
	case inbox.LeaseDuplicate:
		ev.Kind = EventDuplicate
		ev.FirstSeenAt = claim.Record.FirstSeenAt
		return nil, nil
	case inbox.LeaseParked:
		ev.Kind = EventParked
		if claim.ParkedNow {
			m.cfg.Logger.Error("exactlyonce: lease expired mid-attempt, key parked for an operator",
				errors.New(claim.Record.LastError), watermill.LogFields{"consumer": consumer, "key": key, "attempt": claim.Attempt})
		}
		return nil, nil
	case inbox.LeaseBusy:
		ev.Kind = EventBusy
		sleep(origCtx, m.cfg.NackDelay)
		return nil, fmt.Errorf("%w: %q for %q, attempt %d, lease until %s", ErrLeaseHeld, key, consumer, claim.Attempt, claim.LeaseUntil.Format(time.RFC3339Nano))
	}
	if claim.Interrupted {
		ev.Interrupted = true
		m.cfg.Logger.Info("exactlyonce: retrying a key whose previous attempt was interrupted", watermill.LogFields{
			"consumer": consumer, "key": key, "attempt": claim.Attempt,
		})
	}

	lease := &leaseState{m: m, consumer: consumer, key: key, info: LeaseInfo{
		IdempotencyKey: idempotencyKey(consumer, key),
		Attempt:        claim.Attempt,
		Interrupted:    claim.Interrupted,
		LeaseUntil:     claim.LeaseUntil,
	}}
	// The completion transaction begins when the handler first asks for it
	// (or at completion), so no connection is held during an external call
	// that comes before the handler's writes.
	th := lazyTx(func() (wsql.Tx, error) { return m.cfg.DB.BeginTx(origCtx, nil) })
	defer th.rollback()
	ob := &lazyOutbox{tx: th, tables: m.cfg.Tables}
	msg.SetContext(withHandlerContext(origCtx, &handlerValues{tx: th, outbox: ob, consumer: consumer, key: key, lease: lease}))
	produced, herr := callHandler(h, msg)
	msg.SetContext(origCtx)
	berr := th.beginErr()
	if herr != nil && berr == nil {
		// The handler's own failure: it knows whether its call happened,
		// and chose a retry (or, with Permanent, an operator).
		th.rollback()
		var perm *PermanentError
		if errors.As(herr, &perm) {
			ev.Kind = EventParked
			ev.Err = herr
			if ferr := m.recordFailure(origCtx, consumer, key, claim.Attempt, herr, true); ferr != nil {
				// Not recorded: nack, so that the key is not lost.
				return nil, fmt.Errorf("exactlyonce: permanent failure could not be recorded: %w (handler: %w)", ferr, herr)
			}
			m.cfg.Logger.Error("exactlyonce: permanent handler error, key parked and message acked", herr,
				watermill.LogFields{"consumer": consumer, "key": key, "attempt": claim.Attempt})
			return nil, nil
		}
		ev.Kind = EventFailed
		_ = m.recordFailure(origCtx, consumer, key, claim.Attempt, herr, false)
		return nil, herr
	}

	// From here the handler succeeded, or the database failed under it:
	// its external effect may have happened. Such a failure is not recorded
	// as failed (that would retry at once, blind); the key stays processing
	// until its lease expires and OnExpired decides, with Interrupted set.
	unknown := func(cause error) ([]*message.Message, error) {
		th.rollback()
		ev.Kind = EventFailed
		return nil, fmt.Errorf("exactlyonce: %q for %q: completion failed after the handler ran; the key stays processing until its lease expires, then OnExpired decides: %w", key, consumer, cause)
	}
	switch {
	case berr != nil && herr != nil:
		return unknown(fmt.Errorf("%w: begin completion: %w (handler: %w)", ErrDBUnavailable, berr, herr))
	case berr != nil:
		return unknown(fmt.Errorf("%w: begin completion: %w", ErrDBUnavailable, berr))
	}
	if err := m.writeOutputs(msg, ob, produced); err != nil {
		return unknown(err)
	}
	tx, err := th.get()
	if err != nil {
		return unknown(fmt.Errorf("%w: begin completion: %w", ErrDBUnavailable, err))
	}
	if err := m.store.CompleteTx(origCtx, tx, consumer, key, claim.Attempt); err != nil {
		if errors.Is(err, inbox.ErrLeaseLost) {
			th.rollback()
			ev.Kind = EventFailed
			return nil, fmt.Errorf("exactlyonce: %w", err)
		}
		return unknown(err)
	}
	if err := th.commit(); err != nil {
		ev.Kind = EventFailed
		return nil, fmt.Errorf("exactlyonce: completion of %q for %q not committed (the key stays processing until its lease expires, then OnExpired decides): %w", key, consumer, err)
	}
	ev.Kind = EventProcessed
	return nil, nil
}

// recordFailure records a failed attempt so that the next delivery can run
// at once instead of waiting for the lease to expire. If it cannot be
// recorded, the lease expiry covers it; the error is logged and returned.
func (m *Middleware) recordFailure(ctx context.Context, consumer, key string, attempt int, cause error, permanent bool) error {
	err := m.store.Fail(context.WithoutCancel(ctx), m.cfg.DB, consumer, key, attempt, cause.Error(), permanent)
	if err != nil {
		m.cfg.Logger.Error("exactlyonce: could not record the failed attempt; the lease expiry will release the key", err,
			watermill.LogFields{"consumer": consumer, "key": key, "attempt": attempt})
	}
	return err
}
