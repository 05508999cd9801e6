package outbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
)

// BatchPublisher is implemented by publishers that can have many messages in
// flight at once and say, message by message, which ones the broker
// confirmed (rabbitmq.Publisher does, with a window of outstanding publisher
// confirms). When RelayConfig.Publisher implements it, the Relay hands each
// batch to PublishBatch in one call instead of calling Publish per run of one
// topic, and does the same bookkeeping with the outcomes: it deletes the rows
// whose message was confirmed, and records a failure for each other row (see
// RelayConfig.MaxAttempts; the messages before and after a failed one in the
// call are the evidence earlier and later in the batch).
type BatchPublisher interface {
	// PublishBatch publishes msgs[i] to topics[i], in order, and returns one
	// error per message (len(msgs) of them): nil when the broker confirmed
	// the message (it has it: the Relay deletes the row), else why not
	// (nack, returned as unroutable, channel or connection lost, ctx ended).
	// A message whose outcome is unknown is a failure: its row stays and is
	// published again later. When the outcome is unknown for a reason that
	// is not the message's own (the connection was lost with it in flight),
	// return an error with a method Unconfirmed() bool that returns true:
	// the Relay then never blames the row for it (see
	// RelayConfig.MaxAttempts). Confirms of messages in flight together
	// arrive in any order, so without the mark a connection lost mid-window
	// would look like failures with accepted messages around them. PublishBatch returns when every message has an
	// outcome, and at the latest soon after ctx ends. It must be safe for
	// concurrent use (RelayConfig.Workers call it concurrently).
	PublishBatch(ctx context.Context, topics []string, msgs []*message.Message) []error
}
