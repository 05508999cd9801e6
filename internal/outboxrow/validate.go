// Package outboxrow holds the rules for a message the outbox can store,
// shared by the outbox publisher and the middleware (which checks a
// handler's output messages before it writes any).
package outboxrow

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
)

// Validate reports whether Publish would accept messages for topic: a
// non-empty topic that is valid UTF-8 without NUL, and messages that are not
// nil, have a UUID, and whose UUID and metadata keys and values are valid
// UTF-8 without NUL (the outbox keeps messages byte for byte; JSON would
// silently alter them). It touches no database.
func Validate(topic string, messages ...*message.Message) error {
	if topic == "" {
		return errors.New("empty destination topic")
	}
	if err := pgtext.Check(topic); err != nil {
		return fmt.Errorf("destination topic %q: %w", topic, err)
	}
	for i, msg := range messages {
		if msg == nil {
			return fmt.Errorf("message %d is nil", i)
		}
		if msg.UUID == "" {
			return fmt.Errorf("message %d has an empty UUID", i)
		}
		if err := pgtext.Check(msg.UUID); err != nil {
			return fmt.Errorf("message %d: UUID %w", i, err)
		}
		for k, v := range msg.Metadata {
			if err := pgtext.Check(k); err != nil {
				return fmt.Errorf("message %q: metadata key %q %w (the outbox keeps messages byte for byte)", msg.UUID, k, err)
			}
			if err := pgtext.Check(v); err != nil {
				return fmt.Errorf("message %q: metadata %q: value %w (the outbox keeps messages byte for byte)", msg.UUID, k, err)
			}
		}
	}
	return nil
}

// RunEnd returns the end (exclusive) of the run of consecutive items that
// starts at start: items start+1, start+2, ... up to n belong to it while
// same(j) is true. The middleware and the relay hand each run of one topic
// to a single Publish call.
func RunEnd(n, start int, same func(j int) bool) int {
	end := start + 1
	for end < n && same(end) {
		end++
	}
	return end
}
