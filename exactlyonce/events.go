package exactlyonce

import "time"

// Outcome is what the middleware did with a delivery. Its values are
// short lower-case words, usable as metric labels.
type Outcome string

// The outcomes of a delivery.
const (
	// Processed: the handler ran and its effects committed; acked.
	Processed Outcome = "processed"
	// Duplicate: the key was already done; acked without running the
	// handler.
	Duplicate Outcome = "duplicate"
	// Parked: the key is parked for an operator (now, by a Permanent
	// handler error or, in lease mode, after too many interrupted attempts
	// or a completion that can never commit; or earlier); acked without
	// running the handler again.
	Parked Outcome = "parked"
	// Nacked: not processed, an error returned to the router, which nacks;
	// the broker redelivers. Event.Err says why: a handler error or panic,
	// or one of the Err* sentinels.
	Nacked Outcome = "nacked"
	// FailOpen: the database was unreachable and Config.FailOpen ran the
	// handler without deduplication. Event.Err is the handler's error, if
	// any.
	FailOpen Outcome = "fail_open"
)

// Event describes the outcome of one delivery (Config.OnEvent).
type Event struct {
	Outcome  Outcome
	Consumer string
	Key      string
	// MessageUUID is the delivered message's UUID.
	MessageUUID string
	// FirstSeenAt is when the key was first recorded (Duplicate).
	FirstSeenAt time.Time
	// Duration is the time spent in the middleware, handler included.
	Duration time.Duration
	// ClaimDuration is the time the inbox check took: the claim
	// statement(s), retries after a serialization failure included; in
	// group commit, the batch's claim (the last one, when the batch was
	// rerun without a failed delivery). Zero when no claim ran (an invalid
	// key, FailOpen).
	ClaimDuration time.Duration
	// Err is the error returned to the router (Nacked, or a failed
	// FailOpen run), or the reason a key was parked just now (Parked).
	Err error
	// Attempt is the lease-mode attempt number (0 in transactional mode).
	Attempt int
	// BatchSize is, with group commit (Config.Batch), the number of
	// deliveries collected into the batch this delivery ran in (before
	// duplicates within it and reruns without a failed one); 0 otherwise.
	BatchSize int
	// BatchFirst is true for one delivery of each batch (the first), so
	// that a hook can count each batch once.
	BatchFirst bool
	// Interrupted is true for a lease-mode attempt that follows one whose
	// lease expired mid-attempt, or whose completion failed after the
	// handler ran (a takeover).
	Interrupted bool
}
