package exactlyonce

import (
	"errors"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
)

// Errors the middleware returns to the router, always wrapped in a message
// that starts with "exactlyonce: " and names the consumer and key. Branch
// on them with errors.Is; IsPermanent groups the ones that no redelivery
// can fix. A recovered handler panic is returned as Watermill's
// middleware.RecoveredPanicError (value and stack), wrapped.
var (
	// ErrInvalidKey: the message cannot be deduplicated: its key is empty
	// (a producer that is not Watermill, with no UUID: see the rabbitmq
	// package), too long, not valid UTF-8 or contains NUL, or there is no
	// consumer name. Nacked after NackDelay; a poison queue should take it
	// (IsPermanent).
	ErrInvalidKey = inboxdb.ErrInvalidKey

	// ErrDBUnavailable: the database could not be reached before the
	// handler ran (the connection could not be made or was lost, the server
	// is shutting down or full). Nothing was processed; nacked after
	// NackDelay, or run fail-open with Config.FailOpen. docs/guarantees.md
	// lists the errors that count.
	ErrDBUnavailable = errors.New("database unavailable")

	// ErrDBReadOnly: the database took the connection but refuses writes
	// (PostgreSQL's 25006, MySQL's read-only refusals: see
	// docs/clusters.md): the middleware is connected to a standby (a hot
	// standby, a replica), or the server or the session is read-only
	// (default_transaction_read_only, MySQL read_only). Its text says so
	// and what to do: connect to the primary, e.g. a multi-host URL with
	// target_session_attrs=read-write, or a proxy that follows the
	// primary. Mostly at the claim (the inbox INSERT is the transaction's
	// first write): nothing was processed. At a handler's write or at
	// COMMIT, nothing of the transaction committed. Either way the message
	// is nacked after NackDelay (never run fail-open: the database is
	// there, and another copy may be running the key), logged once per
	// episode (when it starts, while it goes on, when it ends), not per
	// message; in lease mode a completion refused so is not parked (the
	// primary would take it). The same running middleware goes on once
	// its connections reach a primary again (a standby promoted in place).
	ErrDBReadOnly = pgerr.ErrDBReadOnly

	// ErrClaimFailed: any other database error before the handler ran (a
	// serialization failure that kept recurring, a lock or statement
	// timeout, a pooler's refusal, tables not migrated: then it also wraps
	// sqlschema.ErrNotMigrated). Nothing was processed; nacked after
	// NackDelay, never run fail-open.
	ErrClaimFailed = errors.New("claim failed")

	// ErrLeaseHeld: lease mode, another worker holds a live lease on the
	// key. Nacked after NackDelay, never acked: the holder may still fail,
	// and then this copy must run.
	ErrLeaseHeld = errors.New("another worker holds the lease on this key")

	// ErrLeaseLost: lease mode, the attempt's lease expired and another
	// worker took the key over (or an operator changed its record) before
	// this one completed. ExtendLease returns it too: stop, the completion
	// will be refused.
	ErrLeaseLost = inboxdb.ErrLeaseLost

	// ErrNoDestination: the handler returned messages, but neither the
	// handler's publish topic, Config.PublishTopic nor SetDestination gave
	// them a topic. A configuration error: rolled back and nacked after
	// NackDelay, so that nothing is lost while you fix it.
	ErrNoDestination = errors.New("output message has no destination topic")

	// ErrNoMiddleware: a context helper (PgxTxFromContext, OutboxFromContext,
	// Exec, InfoFromContext...) was given a context that carries no
	// delivery of this middleware: the middleware does not wrap the
	// handler (the error then names the handler and says how to add it),
	// or the handler passed a context that is not msg.Context() or derived
	// from it. OutboxOnly's refusal wraps it too. It is permanent
	// (IsPermanent): redelivering cannot fix the wiring, so a poison queue
	// filtered by IsPermanent takes the message out of the loop, kept.
	ErrNoMiddleware = errors.New("no exactly-once delivery in this context")

	// ErrNestedMiddleware: two exactly-once middlewares wrap one handler
	// (typically one added router-wide, router.AddMiddleware, and another
	// on the handler, handler.AddMiddleware). The inner one refuses every
	// delivery before it claims anything, logs it at ERROR and returns
	// this error through the outer one, which rolls back (or, in lease
	// mode, records the attempt failed) and returns it after NackDelay:
	// the message is nacked and redelivered, failing the same way, until
	// the wiring is fixed. Nothing is lost; the handler never runs. It is
	// permanent (IsPermanent), as ErrNoMiddleware is. Fix: add one
	// middleware to each handler (handler.AddMiddleware) instead of
	// router-wide, or one router-wide and none per handler.
	ErrNestedMiddleware = errors.New("two exactly-once middlewares wrap this handler")
)

// errOutput marks errors about the handler's output messages that no retry
// can fix (a nil message, an empty UUID, text the outbox cannot store):
// refused before any SQL ran.
var errOutput = errors.New("invalid output message")

// Permanent marks an error that no retry can fix. It is the library's one
// mark of a permanent failure, for handlers and publishers alike.
//
// Returned by a handler (a phone number the provider rejects, a payload
// that will never parse), in both modes: the handler's transaction is
// rolled back, the key is recorded as parked with the error as its reason,
// and the message is kept with it (see Config.MaxParkedPayload) and acked:
// later deliveries of the key are acked as parked too, until an operator
// replays the kept message or releases the key (inbox.Store.Release).
//
// Returned by a publisher the outbox relay uses (outbox.RelayConfig), it
// says that the broker (or the publisher, before sending) refused this
// message for a reason that repeats whenever it is published, whatever the
// broker's state: too large, a property or header the broker rejects, not
// marshallable. The relay counts such failures against the row and
// quarantines it after RelayConfig.MaxAttempts of them. Never mark the
// broker's own state (a connection lost, a timeout, a nack, an unroutable
// message, an unknown outcome): that is retried for as long as it lasts.
//
// The mark is a method Permanent() bool returning true, which the error
// returned has: a package can mark its errors the same way without
// importing this one (rabbitmq.Publisher does), and the middleware and the
// relay recognise them anywhere in the error's chain. Permanent(nil) is
// nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string   { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() error   { return e.err }
func (e *permanentError) Permanent() bool { return true }

// marked reports whether err, or an error it wraps, carries the mark of
// Permanent: a method Permanent() bool that returns true.
func marked(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}

// IsPermanent reports whether err says that redelivering the message can
// never succeed: it is marked permanent (made by Permanent, or an error
// with a method Permanent() bool that returns true; returned to the router
// only when the key could not be parked, or in a fail-open run), its key is
// invalid (ErrInvalidKey), the handler's output messages cannot be stored,
// or the middleware does not wrap the handler (ErrNoMiddleware) or wraps
// it twice (ErrNestedMiddleware). Use it as the filter of Watermill's
// PoisonQueueWithFilter, added before (outside) this middleware.
// Configuration errors (ErrNoDestination, sqlschema.ErrNotMigrated) are not
// permanent: the message waits in the queue until the configuration is
// fixed.
func IsPermanent(err error) bool {
	return marked(err) || errors.Is(err, ErrInvalidKey) || errors.Is(err, errOutput) || errors.Is(err, ErrNoMiddleware) ||
		errors.Is(err, ErrNestedMiddleware)
}
