package middleware

import (
	"sync/atomic"
	"time"
)

// EventKind says what happened to a message.
type EventKind int

const (
	// EventProcessed: the handler ran and its effects committed.
	EventProcessed EventKind = iota + 1
	// EventDuplicate: the key was already done; acked without running.
	EventDuplicate
	// EventFailed: the handler returned an error or panicked, or the
	// commit failed; rolled back and nacked.
	EventFailed
	// EventRejected: the message has no usable key; nacked.
	EventRejected
	// EventDBUnavailable: the database could not be reached before the
	// handler ran (ErrDBUnavailable); nacked (fail closed).
	EventDBUnavailable
	// EventFailOpen: the database failed and Config.FailOpen ran the
	// handler without deduplication.
	EventFailOpen
	// EventBusy: lease mode, another worker holds a live lease on the key;
	// nacked after NackDelay.
	EventBusy
	// EventParked: lease mode, the key is parked for an operator (now:
	// after an interrupted attempt under ParkExpired or past
	// MaxInterruptedAttempts, a permanent handler error, or a completion
	// that can never commit after the handler ran; or earlier); acked.
	EventParked
	// EventClaimFailed: a database error other than an unreachable
	// database before the handler ran (ErrClaimFailed); nacked, never
	// fail-open.
	EventClaimFailed
)

// String returns the kind's name, as used in logs and metric labels.
func (k EventKind) String() string {
	switch k {
	case EventProcessed:
		return "processed"
	case EventDuplicate:
		return "duplicate"
	case EventFailed:
		return "failed"
	case EventRejected:
		return "rejected"
	case EventDBUnavailable:
		return "db_unavailable"
	case EventFailOpen:
		return "fail_open"
	case EventBusy:
		return "busy"
	case EventParked:
		return "parked"
	case EventClaimFailed:
		return "claim_failed"
	}
	return "unknown"
}

// Event describes the outcome of one delivery.
type Event struct {
	Kind     EventKind
	Consumer string
	Key      string
	// MessageUUID is the delivered message's UUID.
	MessageUUID string
	// FirstSeenAt is when the key was first recorded (EventDuplicate).
	FirstSeenAt time.Time
	// Duration is the time spent in the middleware.
	Duration time.Duration
	// Err is the error returned to the router, if any (or the permanent
	// handler error of a parked key).
	Err error
	// Attempt is the lease-mode attempt number (0 in transactional mode).
	Attempt int
	// Interrupted is true for a lease-mode attempt that follows one whose
	// lease expired mid-attempt.
	Interrupted bool
}

// Counters counts events with atomics; its Observe method fits
// Config.OnEvent. Useful for tests, expvar, or a quick /metrics.
type Counters struct {
	Processed, Duplicates, Failed, Rejected, DBUnavailable, FailOpen, Busy, Parked, ClaimFailed, Interrupted atomic.Int64
}

// Observe counts e.
func (c *Counters) Observe(e Event) {
	switch e.Kind {
	case EventProcessed:
		c.Processed.Add(1)
	case EventDuplicate:
		c.Duplicates.Add(1)
	case EventFailed:
		c.Failed.Add(1)
	case EventRejected:
		c.Rejected.Add(1)
	case EventDBUnavailable:
		c.DBUnavailable.Add(1)
	case EventFailOpen:
		c.FailOpen.Add(1)
	case EventBusy:
		c.Busy.Add(1)
	case EventParked:
		c.Parked.Add(1)
	case EventClaimFailed:
		c.ClaimFailed.Add(1)
	}
	if e.Interrupted {
		c.Interrupted.Add(1)
	}
}
