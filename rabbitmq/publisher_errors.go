package rabbitmq

import (
	"errors"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// permanentError marks a failure that is the message's own: it repeats
// whenever the message is published (the outbox relay counts it towards
// RelayConfig.MaxAttempts). Its mark is exactlyonce.Permanent's, a method
// Permanent() bool, so that this package need not import the middleware.
type permanentError struct{ err error }

func permanent(err error) error { return permanentError{err} }

func (e permanentError) Error() string { return e.err.Error() }

func (e permanentError) Unwrap() error { return e.err }

func (e permanentError) Permanent() bool { return true }

// refusesMessage reports whether the broker closed a channel because of the
// message published on it, not the broker's or the destination's state: a
// body over max_message_size (CONTENT_TOO_LARGE, or PRECONDITION_FAILED as
// RabbitMQ reports it), an expiration or user_id it rejects
// (PRECONDITION_FAILED). Access refused, a missing exchange or a locked
// resource are the destination's, and may change.
func refusesMessage(reason error) bool {
	var e *amqp091.Error
	return errors.As(reason, &e) && e.Server && (e.Code == amqp091.PreconditionFailed || e.Code == amqp091.ContentTooLarge)
}

// channelException reports whether the broker closed a channel with a
// channel-level exception, which one message caused (PRECONDITION_FAILED for
// an expiration it refuses, say), rather than because the connection went:
// then amqp091-go closes every channel with the connection's error.
func channelException(reason error) bool {
	var e *amqp091.Error
	if !errors.As(reason, &e) || !e.Server {
		return false
	}
	switch e.Code {
	case amqp091.ContentTooLarge, amqp091.NoRoute, amqp091.NoConsumers, amqp091.AccessRefused,
		amqp091.NotFound, amqp091.ResourceLocked, amqp091.PreconditionFailed:
		return true
	}
	return false
}
