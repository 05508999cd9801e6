package outbox

import "errors"

// Permanent marks a publish error as the message's own: the broker (or the
// publisher, before sending) refused this message for a reason that will
// repeat whenever it is published, whatever the broker's state — it is too
// large, it carries a property or header the broker rejects, it cannot be
// marshalled. The Relay counts such failures against the row and
// quarantines it after RelayConfig.MaxAttempts of them.
//
// Never mark the broker's own state as permanent: a connection or channel
// lost, a timeout, a nack (a full queue with overflow reject-publish), an
// unroutable message (its queue is missing), an unknown outcome. Those are
// retried with the row's backoff for as long as they last, and never
// quarantine it.
//
// A publisher can also mark its errors without importing this package: an
// error with a method Permanent() bool that returns true is permanent (see
// IsPermanent). Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err}
}

type permanentError struct{ err error }

func (e permanentError) Error() string   { return e.err.Error() }
func (e permanentError) Unwrap() error   { return e.err }
func (e permanentError) Permanent() bool { return true }

// IsPermanent reports whether err, or an error it wraps, has a method
// Permanent() bool that returns true: made by Permanent, or by a publisher
// that marks the failures that are the message's own (rabbitmq.Publisher
// does). It is RelayConfig.IsPermanent's default.
func IsPermanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}
