package outbox

import (
	"context"

	"github.com/exactlyonce/watermill-exactlyonce/msgid"
)

// BatchPublisher is implemented by publishers that can have many messages in
// flight at once and say, message by message, which ones the broker
// confirmed (rabbitmq.Publisher does, with a window of outstanding publisher
// confirms). When RelayConfig.Publisher implements it, the Relay hands each
// batch to PublishBatch in one call instead of calling Publish per run of one
// topic, and does the same bookkeeping with the outcomes: it deletes the rows
// whose message was confirmed, and records a failure for each other row
// (counted towards RelayConfig.MaxAttempts only when it is permanent: see
// RelayConfig.IsPermanent).
type BatchPublisher interface {
	// PublishBatch publishes each batch[i].Message to batch[i].Topic, in
	// order, and returns one error per message (len(batch) of them): nil
	// when the broker confirmed the message (it has it: the Relay deletes
	// the row), else why not (nack, returned as unroutable, channel or
	// connection lost, ctx ended). A message whose outcome is unknown is a
	// failure: its row stays and is published again later. Mark an error
	// permanent (exactlyonce.Permanent, or a method Permanent() bool) only
	// when it is the message's own and will repeat (the broker refused this
	// message: too large, a property it rejects); never for the broker's
	// state. PublishBatch returns when every message has an outcome, and at
	// the latest soon after ctx ends. It must be safe for concurrent use
	// (RelayConfig.Workers call it concurrently).
	PublishBatch(ctx context.Context, batch []msgid.TopicMessage) []error
}
