package main

import (
	"errors"

	"github.com/ThreeDotsLabs/watermill"
)

// quietLogger logs, at debug level instead of error, the errors a service
// expects as part of normal operation. Watermill's router logs every error a
// handler returns as "Handler returned error" at error level; under the
// exactly-once middleware in lease mode, a copy of a message that arrives
// while another worker holds the key's lease is nacked with an error wrapping
// exactlyonce.ErrLeaseHeld, and redelivered later: normal contention, not a
// failure. Wrap the router's logger with it (message.NewRouter(cfg,
// quietLogger{...})) to keep such nacks out of error-level logs and alerts;
// every other error is still logged at error level.
type quietLogger struct {
	watermill.LoggerAdapter
	expected []error // logged at debug when the error wraps one of these
}

func (l quietLogger) Error(msg string, err error, fields watermill.LogFields) {
	for _, e := range l.expected {
		if errors.Is(err, e) {
			l.Debug(msg, fields.Add(watermill.LogFields{"err": err.Error()}))
			return
		}
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l quietLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return quietLogger{LoggerAdapter: l.LoggerAdapter.With(fields), expected: l.expected}
}
